"""Adaptive-capacity training (MoNE paper Sec. 5, Fig. 5b).

Each training step draws the effective capacity uniformly from a small set
(default {0.15, 0.25, ..., 0.95}) and runs that step at the drawn capacity,
with the real compute savings of that capacity: the model keeps one compiled
train function per capacity, so after the first visit of each value no step
recompiles.
"""

import numpy as np
import keras

DEFAULT_CAPACITIES = tuple(round(0.15 + 0.1 * i, 2) for i in range(9))


class AdaptiveCapacity(keras.callbacks.Callback):
    """Draws the capacity of every training step from ``capacities``.

    Evaluation (validation during ``fit``, and after training) runs at
    ``eval_capacity``. The capacity drawn at each step is kept in
    ``self.history`` for inspection.

    Args:
        capacities: values to draw from, each in ``(0, 1]``.
        eval_capacity: capacity for validation and for the model after fit.
        seed: seed of the draw.
    """

    def __init__(self, capacities=DEFAULT_CAPACITIES, eval_capacity=0.5, seed=0):
        super().__init__()
        self.capacities = tuple(float(c) for c in capacities)
        self.eval_capacity = float(eval_capacity)
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self.history = []

    def on_train_batch_begin(self, batch, logs=None):
        capacity = float(self._rng.choice(self.capacities))
        self.model.set_capacity(capacity)
        self.model.make_train_function()
        self.history.append(capacity)

    def on_test_begin(self, logs=None):
        self.model.set_capacity(self.eval_capacity)
        self.model.make_test_function()

    def on_train_end(self, logs=None):
        self.model.set_capacity(self.eval_capacity)
