"""GELU in the form each backend trains fastest, the same function everywhere."""

import math

import keras
from keras import ops

_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def gelu(x, approximate=False, training=False, nested=False):
    """GELU (Hendrycks & Gimpel): ``x Phi(x)``, or its tanh approximation.

    On jax, exact GELU is written as ``0.5 x (1 + erf(x / sqrt 2))`` wherever
    XLA does not fuse ``jax.nn.gelu`` (the ``erfc`` form, both of whose
    branches are computed for every element) into the matmul before it:

    * in training (``training=True``): the erfc form's backward pass is slower
      (the digits ViT's training step 5% faster with the erf form);
    * after a nested in-projection (``nested=True``: ``x[:, :d] @ W[:d]`` of
      one MoNE token group): XLA splits the erfc form into four loop fusions,
      each writing the group's full ``(tokens, 4D)`` hidden activations; the
      erf form is one fusion (MoNE-ViT-B/16 at e_c 0.3: forward temporaries
      45.3 -> 34.4 MiB against dense 41.6, forward 7% faster, issue 27).

    Otherwise (a dense MLP at inference) XLA fuses ``jax.nn.gelu`` into the
    matmul and the erf form is the slower one (the digits ViT's forward 14%
    slower), so ``ops.gelu`` stays. The forms agree to float32 rounding
    (``tests/test_nested_layers.py``). TensorFlow's exact GELU is already the
    erf form and torch's a fused kernel: ``ops.gelu`` on those backends.
    """
    if approximate or not (training or nested) or keras.backend.backend() != "jax":
        return ops.gelu(x, approximate=approximate)
    return 0.5 * x * (1.0 + ops.erf(x * ops.cast(_INV_SQRT2, x.dtype)))
