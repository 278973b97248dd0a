"""Resumable training that never loses work: checkpoints that only move forward.

``StepCheckpoint`` writes ``<directory>/step_<N>.weights.h5`` (model and
optimizer variables, so the optimizer's ``iterations`` is the global step) and
then ``<directory>/step_<N>.json`` (step, sha256 of the weights file, the
state of every random-number generator: Keras' weights files leave out the
``SeedGenerator`` states that draw dropout, DropPath or ACM's Gumbel noise,
and a resume without them would draw other noise) every
``every_steps`` steps and at every epoch end. A checkpoint counts once its
``.json`` exists, so a crash while writing leaves the previous one in charge.
Before writing, every variable is checked to be finite: a diverged model is
never saved, training stops, and :class:`TrainingDiverged` names the step and
the last good checkpoint. The newest :data:`KEEP` checkpoints are kept.

``restore`` loads the newest checkpoint whose file matches its sha256 and
whose values are finite, falling back to the one before (a truncated or
corrupt file is reported, never loaded). Keras' ``BackupAndRestore`` restarts
an interrupted epoch from its first batch; with
``keras_mone.recipes.TrainingSetup.fit`` a run resumes at the exact batch.
"""

import json
import os
import re
import warnings

import keras
import numpy as np

from keras_mone.file_io import sha256_of

KEEP = 2
_NAME = re.compile(r"^step_(\d+)\.json$")
# The single-file layout of earlier versions, still restored.
_LEGACY_WEIGHTS, _LEGACY_STATE = "state.weights.h5", "state.json"


class TrainingDiverged(RuntimeError):
    """Training produced non-finite values; nothing non-finite was saved."""


def seed_states(model):
    """The model's ``SeedGenerator`` state variables (in its non-trainable state, not in its weights)."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.non_trainable_variables if id(v) not in weights and "seed_generator" in v.path]


def _restore_seeds(model, weights):
    """Assigns the seed states recorded beside checkpoint ``weights`` (none recorded: left as they are)."""
    record = weights[: -len(".weights.h5")] + ".json"
    try:
        with open(record) as f:
            recorded = json.load(f).get("seeds")
    except (OSError, ValueError):
        return
    if recorded is None:  # written before the seeds were recorded
        return
    variables = seed_states(model)
    if len(recorded) != len(variables):
        warnings.warn(
            f"checkpoint {weights!r} records {len(recorded)} random-number generator states, the model has "
            f"{len(variables)}; their noise is not resumed exactly.", stacklevel=3,
        )
        return
    for variable, value in zip(variables, recorded):
        variable.assign(np.asarray(value, dtype=keras.backend.standardize_dtype(variable.dtype)))


def non_finite_variables(model):
    """Paths of the model's and its optimizer's float variables holding NaN or infinity."""
    variables = list(model.variables)
    if getattr(model, "optimizer", None) is not None and model.optimizer.built:
        variables += list(model.optimizer.variables)
    bad = []
    for variable in variables:
        if "float" not in str(variable.dtype):
            continue
        if not np.isfinite(keras.ops.convert_to_numpy(variable)).all():
            bad.append(variable.path)
    return bad


def checkpoints(directory):
    """``[(step, weights path)]`` of the complete checkpoints in ``directory``, newest first."""
    found = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = _NAME.match(name)
            if match:
                found.append((int(match.group(1)), os.path.join(directory, f"step_{match.group(1)}.weights.h5")))
        legacy = os.path.join(directory, _LEGACY_STATE)
        if not found and os.path.exists(legacy) and os.path.exists(os.path.join(directory, _LEGACY_WEIGHTS)):
            with open(legacy) as f:
                found.append((int(json.load(f)["step"]), os.path.join(directory, _LEGACY_WEIGHTS)))
    return sorted(found, reverse=True)


def saved_step(directory):
    """Global step of the newest checkpoint in ``directory``, or ``None`` if there is none."""
    found = checkpoints(directory)
    return found[0][0] if found else None


class StepCheckpoint(keras.callbacks.Callback):
    """Saves model and optimizer state every ``every_steps`` steps and each epoch end;
    stops training, saving nothing, at the first non-finite loss or variable.

    After ``fit``, ``diverged_step`` is the step at which training diverged
    (``None`` if it did not); ``keras_mone.recipes.TrainingSetup.fit`` turns it
    into :class:`TrainingDiverged`.

    Args:
        directory: where the checkpoints live (created on first save).
        every_steps: steps between saves (0: epoch ends only).
    """

    def __init__(self, directory, every_steps=0):
        super().__init__()
        self.directory = directory
        self.every_steps = int(every_steps)
        self.diverged_step = None
        self._step = 0
        self._pending_metrics = None

    def on_train_begin(self, logs=None):
        self._step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self.diverged_step = None
        self._pending_metrics = recorded_metrics(self.directory, self._step)

    def on_epoch_begin(self, epoch, logs=None):
        self._carry_on_metrics()

    def _carry_on_metrics(self):
        # A run resumed mid-epoch carries on the epoch's running metrics, so
        # its history.csv row covers the whole epoch, as without the break.
        # Metric states are sums (totals, counts), so the recorded values are
        # added: at the epoch's start where the metrics exist already (jax,
        # torch), else after its first step (tensorflow builds them there).
        variables = self.model.metrics_variables
        if self._pending_metrics is None or len(self._pending_metrics) != len(variables):
            return
        for variable, value in zip(variables, self._pending_metrics):
            variable.assign(variable + np.asarray(value, dtype=keras.backend.standardize_dtype(variable.dtype)))
        self._pending_metrics = None

    def on_train_batch_end(self, batch, logs=None):
        # Counted here: reading the model every step would sync jax state each step.
        self._step += 1
        if self._pending_metrics is not None:
            self._carry_on_metrics()
            self._pending_metrics = None  # metrics of another shape: nothing to carry on
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(float(loss)):
            self._diverged()
            return
        last_of_epoch = batch + 1 == (self.params or {}).get("steps")
        if self.every_steps and self._step % self.every_steps == 0 and not last_of_epoch:
            # (the epoch's last step is saved by on_epoch_end, after its
            # validation and history row, so a resume never skips those)
            self.save(mid_epoch=True)

    def on_epoch_end(self, epoch, logs=None):
        if self.diverged_step is None:
            self.save()

    def _diverged(self):
        self.diverged_step = self._step
        self.model.stop_training = True

    def save(self, mid_epoch=False):
        """Writes a checkpoint of the current step if every variable is finite.

        A mid-epoch checkpoint also records the epoch's running metrics
        (``model.metrics_variables``), which a resumed run picks up.
        """
        model = self.model
        if non_finite_variables(model):
            self._diverged()
            return None
        os.makedirs(self.directory, exist_ok=True)
        step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        weights = os.path.join(self.directory, f"step_{step}.weights.h5")
        partial = os.path.join(self.directory, f"step_{step}.partial.weights.h5")
        model.save_weights(partial, overwrite=True)
        os.replace(partial, weights)
        state = os.path.join(self.directory, f"step_{step}.json")
        record = {"step": step, "sha256": sha256_of(weights)}
        record["seeds"] = [keras.ops.convert_to_numpy(v).tolist() for v in seed_states(model)]
        if mid_epoch:
            record["metrics"] = [keras.ops.convert_to_numpy(v).tolist() for v in model.metrics_variables]
        with open(state + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(state + ".tmp", state)
        self._prune(keep_step=step)
        return weights

    def _prune(self, keep_step):
        for step, weights in checkpoints(self.directory)[KEEP:]:
            if step == keep_step:
                continue
            for path in (weights, weights[: -len(".weights.h5")] + ".json"):
                if os.path.exists(path):
                    os.remove(path)


def recorded_metrics(directory, step):
    """Running metric values recorded with the mid-epoch checkpoint of ``step``, else ``None``."""
    record = os.path.join(directory, f"step_{step}.json")
    try:
        with open(record) as f:
            return json.load(f).get("metrics")
    except (OSError, ValueError):
        return None


def _verified(weights):
    """Raises ``ValueError`` if ``weights`` does not match the sha256 of its record."""
    record = weights[: -len(".weights.h5")] + ".json"
    if not os.path.exists(record) or weights.endswith(_LEGACY_WEIGHTS):
        return
    with open(record) as f:
        expected = json.load(f).get("sha256")
    if expected and sha256_of(weights) != expected:
        raise ValueError(f"checkpoint {weights!r} is corrupt: its sha256 is not the recorded {expected}.")


def restore(model, directory):
    """Loads the newest good checkpoint in ``directory`` into compiled ``model``
    (and its optimizer); returns the restored global step, 0 if there is none.

    A checkpoint that is corrupt, truncated, of another model or not finite is
    skipped with a warning for the one before it; if none loads, ``ValueError``
    lists them, and ``model`` keeps its initial weights.
    """
    found = checkpoints(directory)
    if not found:
        return 0
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    state = model.variables + model.optimizer.variables  # seed states included
    initial = [keras.ops.convert_to_numpy(v) for v in state]
    problems = []
    for step, weights in found:
        try:
            _verified(weights)
            model.load_weights(weights)
            _restore_seeds(model, weights)
            bad = non_finite_variables(model)
            if bad:
                raise ValueError(f"checkpoint {weights!r} holds non-finite values in {bad[:3]}.")
        except Exception as error:  # corrupt, truncated or foreign file
            for variable, value in zip(state, initial):
                variable.assign(value)
            problems.append(f"{weights}: {error}")
            warnings.warn(f"Skipping checkpoint at step {step}: {error}", stacklevel=2)
            continue
        return int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    raise ValueError("No checkpoint in " + repr(directory) + " could be restored:\n  " + "\n  ".join(problems))
