"""Resumable training: checkpoints of model + optimizer every few steps.

``StepCheckpoint`` writes ``<directory>/state.weights.h5`` (model and optimizer
variables, so the optimizer's ``iterations`` is the global step) and
``<directory>/state.json`` (``{"step": ...}``), atomically (write then
rename), every ``every_steps`` steps and at every epoch end. ``restore``
loads them into a compiled model; the step tells the caller which epoch and
which batch of it to resume from (``keras_mone.recipes.TrainingSetup.fit``).
Keras' ``BackupAndRestore`` restarts an interrupted epoch from its first batch
(so a run killed mid-epoch would take extra steps); this does not.
"""

import json
import os

import keras

WEIGHTS = "state.weights.h5"
STATE = "state.json"


class StepCheckpoint(keras.callbacks.Callback):
    """Saves model and optimizer state every ``every_steps`` steps and each epoch end.

    Args:
        directory: where the checkpoint lives (created on first save).
        every_steps: steps between saves (0: epoch ends only).
    """

    def __init__(self, directory, every_steps=0):
        super().__init__()
        self.directory = directory
        self.every_steps = int(every_steps)
        self._step = 0

    def on_train_begin(self, logs=None):
        self._step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_batch_end(self, batch, logs=None):
        # Counted here: reading the model every step would sync jax state each step.
        self._step += 1
        if self.every_steps and self._step % self.every_steps == 0:
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        self.save()

    def save(self):
        model = self.model
        os.makedirs(self.directory, exist_ok=True)
        step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        weights = os.path.join(self.directory, WEIGHTS)
        model.save_weights(weights + ".tmp.weights.h5", overwrite=True)
        os.replace(weights + ".tmp.weights.h5", weights)
        state = os.path.join(self.directory, STATE)
        with open(state + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(state + ".tmp", state)


def saved_step(directory):
    """Global step of the checkpoint in ``directory``, or ``None`` if there is none."""
    path = os.path.join(directory, STATE)
    if not (os.path.exists(path) and os.path.exists(os.path.join(directory, WEIGHTS))):
        return None
    with open(path) as f:
        return int(json.load(f)["step"])


def restore(model, directory):
    """Loads the checkpoint in ``directory`` into compiled ``model`` (and its
    optimizer); returns the restored global step, 0 if there is no checkpoint."""
    step = saved_step(directory)
    if step is None:
        return 0
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    model.load_weights(os.path.join(directory, WEIGHTS))
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))
