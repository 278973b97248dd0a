"""Stochastic depth (Huang et al. 2016), as used by ViT training recipes."""

import keras
from keras import ops

from keras_mone.layers.config import ConfigMixin, register


@register
class DropPath(ConfigMixin, keras.layers.Layer):
    """Drops a residual branch per example with probability ``rate`` in training.

    Kept examples are scaled by ``1 / (1 - rate)``; at inference it is the
    identity. Given a list of token groups of the same examples (MoNE's
    per-expert groups), one draw per example applies to every group, so an
    example's branch is dropped for all of its tokens or for none.
    """

    def __init__(self, rate=0.0, seed=None, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"`rate` must be in [0, 1), got {rate}.")
        self.rate = rate
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if rate else None
        # No weights and nothing shaped by the input: built from the start.
        # Left unbuilt until its first call, it made Keras' `predict` and
        # `predict_on_batch` on jax run one eager, op-by-op forward pass of
        # the whole model to build it (MoNE-ViT-B/16: ~370 single-op
        # compilations, ~500 MB of RSS held in jax's caches afterwards).
        self.built = True

    def call(self, inputs, training=None):
        if not training or not self.rate:
            return inputs
        groups = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        first = groups[0]
        shape = (ops.shape(first)[0],) + (1,) * (len(first.shape) - 1)
        keep = keras.random.uniform(shape, seed=self.seed_generator) >= self.rate
        scale = ops.cast(keep, first.dtype) / (1.0 - self.rate)
        dropped = [g * scale for g in groups]
        return dropped if isinstance(inputs, (list, tuple)) else dropped[0]

    def compute_output_shape(self, input_shape):
        return input_shape
