"""GELU in the form each backend trains fastest, the same function everywhere."""

import math

import keras
from keras import ops

_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def gelu(x, approximate=False, training=False):
    """GELU (Hendrycks & Gimpel): ``x Phi(x)``, or its tanh approximation.

    In training on jax, exact GELU is written as ``0.5 x (1 + erf(x / sqrt 2))``:
    ``jax.nn.gelu`` evaluates the same function through ``erfc``, whose two
    branches XLA computes for every element, and whose backward pass is
    slower (the digits ViT's training step 5% faster with the erf form). At
    inference XLA fuses ``jax.nn.gelu`` into the matmul before it and the
    erf form is the slower one (the digits ViT's forward 14% slower), so
    ``ops.gelu`` stays. The forms agree to float32 rounding
    (``tests/test_nested_layers.py``). TensorFlow's exact GELU is already the
    erf form and torch's a fused kernel: ``ops.gelu`` on those backends.
    """
    if approximate or not training or keras.backend.backend() != "jax":
        return ops.gelu(x, approximate=approximate)
    return 0.5 * x * (1.0 + ops.erf(x * ops.cast(_INV_SQRT2, x.dtype)))
