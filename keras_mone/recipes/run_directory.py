"""A run directory belongs to one resolved recipe.

``recipe.toml`` in the run directory records the resolved recipe the
checkpoints were trained with. Resuming with a recipe that differs in any key
that changes the model, the data or the optimisation is refused, listing the
keys; ``restart`` moves the old run's files (checkpoints, history, model,
results, recipe) into ``previous/<n>/`` instead of deleting or mixing them, so
no work is ever lost.
"""

import json
import os
import shutil
import tomllib

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
    with open(path, "rb") as f:
        recorded = tomllib.load(f)
    requested = tomllib.loads(to_toml(recipe, name))
    return {
        key: (recorded.get(key), requested.get(key))
        for key in sorted(set(recorded) | set(requested))
        if key not in SAFE_TO_CHANGE and recorded.get(key) != requested.get(key)
    }


def _archive(directory):
    """Moves the run files of ``directory`` into a new ``previous/<n>/``; returns it."""
    present = [f for f in RUN_FILES if os.path.exists(os.path.join(directory, f))]
    if not present:
        return None
    previous = os.path.join(directory, "previous")
    os.makedirs(previous, exist_ok=True)
    number = 1 + max((int(n) for n in os.listdir(previous) if n.isdigit()), default=0)
    target = os.path.join(previous, str(number))
    os.makedirs(target)
    for name in present:
        shutil.move(os.path.join(directory, name), os.path.join(target, name))
    return target


def claim(recipe, name, resume=True):
    """Prepares ``recipe["output_dir"]`` for a run of ``recipe``, before anything is built.

    With ``resume``, a directory holding checkpoints of another recipe is
    refused (``RecipeError`` listing the differing keys). Without it, the old
    run's files are moved to ``previous/<n>/``. Returns the step of the
    checkpoint a resume will start from (``None``: a fresh start).
    """
    directory = recipe["output_dir"]
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise RecipeError(f"recipe {name!r}: key 'output_dir' {directory!r} is a file, not a directory.")
    checkpoint_dir = os.path.join(directory, CHECKPOINT_FOLDER)
    if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
        raise RecipeError(f"recipe {name!r}: {checkpoint_dir!r} is a file; the run keeps its checkpoints there.")
    step = checkpoint_lib.saved_step(checkpoint_dir)
    recorded = os.path.join(directory, RECIPE_FILE)
    if resume and step is not None:
        changed = differing_keys(recipe, name, recorded) if os.path.exists(recorded) else {}
        if changed:
            listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise RecipeError(
                f"recipe {name!r}: {directory!r} holds a run (checkpoint at step {step}) of a different "
                f"recipe ({listed}). Resume it with the same keys, choose another output_dir, or pass "
                "--restart (keras-mone train) / resume=False to move the old run to previous/ and start over."
            )
    else:
        if not resume:
            _archive(directory)
        step = None
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, ".write_test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise RecipeError(f"recipe {name!r}: key 'output_dir' {directory!r} is not writable: {error}") from error
    return step
