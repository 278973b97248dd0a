"""A run directory belongs to one resolved recipe.

``recipe.toml`` in the run directory records the resolved recipe of the run
there, and binds the directory whether or not checkpoints are left. A recipe
that differs in any key that changes the model, the data or the optimisation
is refused, listing the keys. The same recipe resumes from the newest
checkpoint; with no checkpoint left (deleted, or a run stopped before its
first one), the old run's files are moved into ``previous/<n>/`` and the run
starts afresh: nothing is overwritten, nothing appended to an old
``history.csv``. ``restart`` moves the old run's files (checkpoints, history,
model, results, recipe) into ``previous/<n>/`` whatever recipe they belong
to. Every path the run writes is checked for writability before anything is
built.
"""

import json
import os
import shutil
import tempfile
import tomllib
import warnings

import numpy as np

from keras_mone.recipes.schema import RecipeError
from keras_mone.training import checkpoint as checkpoint_lib

RECIPE_FILE = "recipe.toml"
CHECKPOINT_FOLDER = "checkpoint"
#: Keys that may differ between the run in a directory and the one resuming it:
#: they change neither the model, nor the data, nor the optimisation.
SAFE_TO_CHANGE = ("description", "output_dir", "checkpoint_steps", "eval_batch_size")
#: Files of one run, moved together by a restart.
RUN_FILES = (RECIPE_FILE, CHECKPOINT_FOLDER, "history.csv", "model.keras", "results.json")


def to_toml(recipe, name):
    """The resolved recipe as TOML text (what ``recipe.toml`` in the run directory holds)."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, (np.floating, float)):
            return repr(float(v))
        return str(v)

    lines = [f"# Resolved recipe {name!r}"]
    lines += [f"{k} = {value(v)}" for k, v in recipe.items() if k != "base"]
    return "\n".join(lines) + "\n"


def differing_keys(recipe, name, path):
    """``{key: (recorded, requested)}`` of the keys in which ``recipe`` differs
    from the resolved recipe recorded at ``path`` (safe keys left out)."""
    try:
        with open(path, "rb") as f:
            recorded = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise RecipeError(
            f"recipe {name!r}: the run directory's {path!r} cannot be read ({error}), so the run there "
            "cannot be compared with this recipe. Choose another output_dir, or pass --restart "
            "(keras-mone train) / resume=False to move that run to previous/ and start over."
        ) from error
    requested = tomllib.loads(to_toml(recipe, name))
    return {
        key: (recorded.get(key), requested.get(key))
        for key in sorted(set(recorded) | set(requested))
        if key not in SAFE_TO_CHANGE and recorded.get(key) != requested.get(key)
    }


def archive(directory, name, files=RUN_FILES):
    """Moves ``files`` (the run files by default) of ``directory`` into a new ``previous/<n>/``; returns it
    (``None`` when none is there)."""
    present = [f for f in files if os.path.lexists(os.path.join(directory, f))]
    if not present:
        return None
    previous = os.path.join(directory, "previous")
    try:
        os.makedirs(previous, exist_ok=True)
        number = 1 + max((int(n) for n in os.listdir(previous) if n.isdigit()), default=0)
        target = os.path.join(previous, str(number))
        os.makedirs(target)
        for file in present:
            shutil.move(os.path.join(directory, file), os.path.join(target, file))
    except OSError as error:
        raise RecipeError(
            f"recipe {name!r}: cannot move the old run in {directory!r} to {previous!r}: {error}"
        ) from error
    return target


def _refuse_changed(recipe, name, directory, step):
    recorded = os.path.join(directory, RECIPE_FILE)
    changed = differing_keys(recipe, name, recorded) if os.path.exists(recorded) else {}
    if changed:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        held = f"checkpoint at step {step}" if step is not None else f"{recorded!r}, no checkpoint"
        raise RecipeError(
            f"recipe {name!r}: {directory!r} holds a run ({held}) of a different "
            f"recipe ({listed}). Resume it with the same keys, choose another output_dir, or pass "
            "--restart (keras-mone train) / resume=False to move the old run to previous/ and start over."
        )


def _check_writable(directory, name):
    """Raises ``RecipeError`` naming the first path of the run that cannot be written."""

    def fail(path, why):
        raise RecipeError(f"recipe {name!r}: {path!r} {why}; the run writes there (fix it, or choose another output_dir).")

    for sub in ("", CHECKPOINT_FOLDER):
        path = os.path.join(directory, sub) if sub else directory
        if os.path.exists(path) and not os.path.isdir(path):
            fail(path, "is a file, not a directory")
        if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
            fail(path, "is a directory that is not writable")
    for file in RUN_FILES:
        path = os.path.join(directory, file)
        if file == CHECKPOINT_FOLDER or not os.path.lexists(path):
            continue
        if os.path.isdir(path) or not os.path.isfile(path):
            fail(path, "is not a regular file")
        if not os.access(path, os.W_OK):
            fail(path, "is not writable")


def claim(recipe, name, resume=True):
    """Prepares ``recipe["output_dir"]`` for a run of ``recipe``, before anything is built.

    With ``resume``, a directory whose ``recipe.toml`` records another recipe
    is refused (``RecipeError`` listing the differing keys), checkpoints or
    not; the same recipe resumes from its newest checkpoint, or, with none
    left, the old run's files move to ``previous/<n>/``. Without ``resume``,
    the old run's files are moved to ``previous/<n>/``. Every path the run
    writes is then checked for writability. Returns the step of the
    checkpoint a resume will start from (``None``: a fresh start).
    """
    directory = recipe["output_dir"]
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise RecipeError(f"recipe {name!r}: key 'output_dir' {directory!r} is a file, not a directory.")
    checkpoint_dir = os.path.join(directory, CHECKPOINT_FOLDER)
    if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
        raise RecipeError(f"recipe {name!r}: {checkpoint_dir!r} is a file; the run keeps its checkpoints there.")
    step = checkpoint_lib.saved_step(checkpoint_dir) if resume else None
    if resume:
        _refuse_changed(recipe, name, directory, step)
    if step is None:  # nothing to resume: the old run's files move aside, never mixed
        moved = archive(directory, name)
        if moved and resume:
            warnings.warn(
                f"recipe {name!r}: {directory!r} holds no checkpoint to resume from; the old run's files "
                f"were moved to {moved!r} and the run starts afresh.",
                stacklevel=3,
            )
    _check_writable(directory, name)
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):  # a probe of its own, removed on close
            pass
    except OSError as error:
        raise RecipeError(f"recipe {name!r}: key 'output_dir' {directory!r} is not writable: {error}") from error
    return step
