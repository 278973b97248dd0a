"""Stochastic depth (Huang et al. 2016), as used by ViT training recipes."""

import keras
from keras import ops

from keras_mone.layers.config import ConfigMixin, register


@register
class DropPath(ConfigMixin, keras.layers.Layer):
    """Drops a residual branch per example with probability ``rate`` in training.

    Kept examples are scaled by ``1 / (1 - rate)``; at inference it is the identity.
    """

    def __init__(self, rate=0.0, seed=None, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"`rate` must be in [0, 1), got {rate}.")
        self.rate = rate
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if rate else None

    def call(self, inputs, training=None):
        if not training or not self.rate:
            return inputs
        batch = ops.shape(inputs)[0]
        shape = (batch,) + (1,) * (len(inputs.shape) - 1)
        keep = keras.random.uniform(shape, seed=self.seed_generator) >= self.rate
        return inputs * ops.cast(keep, inputs.dtype) / (1.0 - self.rate)

    def compute_output_shape(self, input_shape):
        return input_shape
