"""MixUp as in the AugReg recipes (big_vision), a batch-level data layer."""

from keras_mone.layers.config import ConfigMixin, register
from keras_mone.data.augment.data_layer import DataLayer


@register
class RolledMixUp(ConfigMixin, DataLayer):
    """MixUp with big_vision's semantics (Zhang et al. 2018; Steiner et al. 2021).

    One ``lambda ~ Beta(alpha, alpha)`` per batch, folded to
    ``max(lambda, 1 - lambda)`` so the original image dominates; every image
    and label is mixed with the batch rolled by one:
    ``x' = lambda * x + (1 - lambda) * roll(x, 1)``.

    ``keras.layers.MixUp`` differs: it draws one lambda per example, does not
    fold it, and mixes with a random permutation of the batch. Hence this
    layer.

    Call on ``{"images": (B, H, W, C), "labels": (B, K)}`` (one-hot or soft
    labels); returns the same structure. ``alpha = 0`` or ``training=False``
    returns the inputs unchanged. It runs on every backend and in ``tf.data``.

    Args:
        alpha: Beta concentration (AugReg: 0.2, 0.5 or 0.8).
        seed: seed of the draw.
    """

    def __init__(self, alpha=0.2, seed=None, **kwargs):
        super().__init__(seed=seed, **kwargs)
        if alpha < 0:
            raise ValueError(f"`alpha` must be >= 0, got {alpha}.")
        self.alpha = float(alpha)

    def sample_weight(self):
        """The folded mixing weight ``max(lambda, 1 - lambda)`` of one batch."""
        b = self.ops
        weight = b.random.beta((), self.alpha, self.alpha)
        return b.numpy.maximum(weight, 1.0 - weight)

    def call(self, data, training=True):
        if not training or self.alpha == 0:
            return data
        b = self.ops
        weight = self.sample_weight()
        mixed = {}
        for key, value in data.items():
            value = b.cast(value, self.compute_dtype)
            w = b.cast(weight, value.dtype)
            mixed[key] = w * value + (1.0 - w) * b.numpy.roll(value, 1, axis=0)
        return mixed

    def compute_output_shape(self, input_shape):
        return input_shape
