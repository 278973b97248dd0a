"""Several training modes in one run: a recipe's ``phases`` (e.g. ACM's conversion, ``acm.txt`` Sec. 3.2).

``phases = ["distill", "gates", "end_to_end"]`` runs the three modes in order
with ``keras-mone train <recipe>``: phase ``i`` is the recipe with
``mode = phases[i]``, ``epochs = phase_epochs[i]`` and ``learning_rate =
phase_learning_rates[i]`` (else the recipe's ``epochs`` / ``learning_rate``),
trained in ``<output_dir>/phases/<i>_<mode>/`` (a run directory of its own:
``recipe.toml``, checkpoints, ``history.csv``, ``model.keras``,
``results.json``). Phase 1 starts from ``init_from``; phase ``i > 1`` starts
from phase ``i - 1``'s ``model.keras``, with ``teacher_from`` (else the
original ``init_from``) as the dense teacher. Run directory::

    recipe.toml      the resolved recipe with its phases (a resume with other keys is refused)
    phases/<i>_<mode>/   each phase's run (see keras_mone.recipes.loader)
    history.csv      every phase's rows, column ``phase`` first (rewritten after each phase)
    model.keras      the last phase's model; results.json: its results plus ``phases`` (each phase's)

Resuming (the same command again): a phase whose ``model.keras`` exists is
finished and never rerun; the first unfinished one resumes from its newest
checkpoint at the exact batch, as a single run does. ``resume=False``
(``--restart``) moves the old run, phases included, to ``previous/<n>/``.
Every phase's keys are checked, and every phase's backbone is constructed
(no weights) so that its argument checks run, before the run directory is
written.
"""

import csv
import json
import os
import shutil

import keras

from keras_mone.methods.registry import architectures, method_of
from keras_mone.recipes import schema
from keras_mone.recipes.run_directory import RUN_FILES, archive, differing_keys, to_toml

PHASES_FOLDER = "phases"


def preflight(recipe, name):
    """Constructs the recipe's backbone without weights, so that its argument checks
    (learner counts, budgets, sizes) raise ``RecipeError`` before anything is written."""
    architecture = architectures()[recipe["architecture"]]
    method = method_of(recipe["architecture"])
    backbone_keys, _ = schema.allowed_args(recipe["architecture"])
    config = {
        "image_size": recipe["image_size"],
        **architecture.decode_variant(recipe["variant"]),
        **method.recipe_arguments(recipe),
        **method.mode(recipe["mode"]).model_arguments(recipe),
        **recipe["model_args"],
    }
    try:
        architecture.build_backbone(**{k: v for k, v in config.items() if k in backbone_keys})
    except (ValueError, TypeError) as error:
        raise schema.RecipeError(f"recipe {name!r}: {error}") from error


def phase_recipes(recipe, name):
    """The resolved recipe of every phase, in order (each validated)."""
    phases, folder = [], os.path.join(recipe["output_dir"], PHASES_FOLDER)
    for index, mode in enumerate(recipe["phases"]):
        raw = dict(recipe, mode=mode, phases=[], phase_epochs=[], phase_learning_rates=[])
        raw["output_dir"] = os.path.join(folder, f"{index + 1}_{mode}")
        if recipe["phase_epochs"]:
            raw["epochs"] = recipe["phase_epochs"][index]
        if recipe["phase_learning_rates"]:
            raw["learning_rate"] = float(recipe["phase_learning_rates"][index])
        if index:
            raw.update(method_of(recipe["architecture"]).later_phase(recipe))  # e.g. ACM's dense teacher
            raw["init_from"] = os.path.join(phases[-1]["output_dir"], "model.keras")
        phase_name = f"recipe {name!r}, phase {index + 1} ({mode})"
        if index:  # its init_from is written by the phase before
            saved, raw["init_from"] = raw["init_from"], ""
            phases.append({**schema.validate(raw, phase_name), "init_from": saved})
        else:
            phases.append(schema.validate(raw, phase_name))
    return phases


def _finished(phase):
    return os.path.isfile(os.path.join(phase["output_dir"], "model.keras"))


def _claim(recipe, name, resume):
    """The run directory for a phased run: refuses another recipe's run, moves an old one aside on restart."""
    directory = recipe["output_dir"]
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise schema.RecipeError(f"recipe {name!r}: key 'output_dir' {directory!r} is a file, not a directory.")
    recorded = os.path.join(directory, "recipe.toml")
    if resume and os.path.exists(recorded):
        changed = differing_keys(recipe, name, recorded)
        if changed:
            listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise schema.RecipeError(
                f"recipe {name!r}: {directory!r} holds a run of a different recipe ({listed}). Resume it with "
                "the same keys, choose another output_dir, or pass --restart (keras-mone train) / resume=False "
                "to move the old run to previous/ and start over."
            )
    else:
        archive(directory, name, RUN_FILES + (PHASES_FOLDER,))
    try:
        os.makedirs(directory, exist_ok=True)
        with open(recorded, "w") as f:
            f.write(to_toml(recipe, name))
    except OSError as error:
        raise schema.RecipeError(f"recipe {name!r}: key 'output_dir' {directory!r} is not writable: {error}") from error


class PhasedSetup:
    """A recipe with ``phases``, built: ``fit()`` trains the phases left, in order.

    Holds the ``TrainingSetup`` of the first unfinished phase (``setup``);
    ``initial_step`` / ``total_steps`` count the steps of every phase.
    ``load_one(recipe, name, resume)`` builds one phase (``recipes.loader``).
    """

    def __init__(self, recipe, name, resume, load_one):
        self.name, self.recipe, self._load_one = name, recipe, load_one
        self.phases = phase_recipes(recipe, name)
        for phase in self.phases:
            preflight(phase, name)
        _claim(recipe, name, resume)
        self.current = next((i for i, phase in enumerate(self.phases) if not _finished(phase)), len(self.phases))
        self.setup = self._load(self.current) if self.current < len(self.phases) else None

    def _load(self, index):
        return self._load_one(self.phases[index], f"{self.name}:{index + 1}_{self.phases[index]['mode']}", True)

    @property
    def output_dir(self):
        return self.recipe["output_dir"]

    @property
    def epochs(self):
        return sum(phase["epochs"] for phase in self.phases)

    @property
    def steps_per_epoch(self):
        return self.setup.steps_per_epoch if self.setup else self._results(-1)["steps"] // self.phases[-1]["epochs"]

    @property
    def total_steps(self):
        return self.epochs * self.steps_per_epoch

    @property
    def initial_step(self):
        done = sum(phase["epochs"] for phase in self.phases[: self.current]) * self.steps_per_epoch
        return done + (self.setup.initial_step if self.setup else 0)

    def _results(self, index):
        with open(os.path.join(self.phases[index]["output_dir"], "results.json")) as f:
            return json.load(f)

    def fit(self, extra_callbacks=(), verbose="auto", save=True, until=None):
        """Trains the unfinished phases (up to phase number ``until``, 1-based; ``None``: all).

        Each phase saves its ``model.keras`` (the next phase starts from it);
        ``save`` applies to the run's own ``model.keras`` and ``results.json``.
        Returns the last trained phase's results; after the last phase, the
        run's: the final model's, ``steps`` summed over the phases (``results.json``
        also lists each phase's under ``phases``)."""
        stop = len(self.phases) if until is None else min(int(until), len(self.phases))
        results = None
        while self.current < stop:
            if self.setup is None:
                keras.backend.clear_session()  # each phase as in a fresh process (names, memory)
                self.setup = self._load(self.current)
            results = self.setup.fit(extra_callbacks, verbose=verbose, save=True)
            self.setup, self.current = None, self.current + 1
            self._write_history()
        if self.current < len(self.phases):
            return results
        phases = [dict(self._results(i), phase=p["mode"]) for i, p in enumerate(self.phases)]
        results = dict(self._results(-1), recipe=self.name, steps=sum(p["steps"] for p in phases))
        if save:
            shutil.copyfile(
                os.path.join(self.phases[-1]["output_dir"], "model.keras"), os.path.join(self.output_dir, "model.keras")
            )
            with open(os.path.join(self.output_dir, "results.json"), "w") as f:
                json.dump({**results, "phases": phases}, f, indent=2)
        return results

    def _write_history(self):
        """``history.csv``: the finished phases' rows, ``phase`` (the mode) first."""
        rows, columns = [], ["phase"]
        for phase in self.phases:
            path = os.path.join(phase["output_dir"], "history.csv")
            if not os.path.isfile(path):
                continue
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    columns += [c for c in row if c not in columns]
                    rows.append({"phase": phase["mode"], **row})
        with open(os.path.join(self.output_dir, "history.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
