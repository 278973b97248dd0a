"""GELU in the form each backend trains fastest, the same function everywhere."""

import math

import keras
from keras import ops

from keras_mone.layers.platform_forms import gelu_form

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
    slower), so ``ops.gelu`` stays, unless ``$KERAS_MONE_GELU=rational``
    (``layers.platform_forms.gelu_form``): on a GPU, where cuBLAS takes no GELU
    epilogue, the erfc form is a separate, arithmetic-bound pass. The forms agree to float32 rounding
    (``tests/test_nested_layers.py``). TensorFlow's exact GELU is already the
    erf form and torch's a fused kernel: ``ops.gelu`` on those backends.
    """
    if approximate or keras.backend.backend() != "jax" or not (training or nested or gelu_form() == "rational"):
        return ops.gelu(x, approximate=approximate)
    if training:
        scaled = x * ops.cast(_INV_SQRT2, x.dtype)
        return 0.5 * x * (1.0 + ops.erf(scaled))
    # at inference erf is spelled out: jax lowers ops.erf to a StableHLO composite that
    # TensorFlow's XLA cannot load, and exported models (keras.export, jax2tf) must run there.
    # Its polynomials need float32: in bf16 they gave erf(4) = 0.992 and gelu(-1e4) = -39.
    # The cast fuses into the elementwise pass (the same bytes move).
    dtype = keras.backend.standardize_dtype(x.dtype)
    wide = x if dtype in ("float32", "float64") else ops.cast(x, "float32")
    scaled = wide * ops.cast(_INV_SQRT2, wide.dtype)
    result = 0.5 * wide * (1.0 + rational_erf(scaled))
    return result if wide is x else ops.cast(result, dtype)


#: x P(x^2) / Q(x^2) on [-4, 4] (constant beyond): the float32 rational approximation of
#: erf that XLA and Eigen evaluate, coefficients highest power first; |error| < 4e-7.
_ERF_NUMERATOR = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
                  -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_DENOMINATOR = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
                    -1.42647390514189e-02)


def rational_erf(x):
    """erf(x) as elementwise arithmetic (``_ERF_NUMERATOR`` / ``_ERF_DENOMINATOR``, Horner's rule)."""
    x = ops.clip(x, -4.0, 4.0)
    square = x * x

    def polynomial(coefficients):
        value = ops.cast(coefficients[0], x.dtype)
        for coefficient in coefficients[1:]:
            value = value * square + ops.cast(coefficient, x.dtype)
        return value

    return x * polynomial(_ERF_NUMERATOR) / polynomial(_ERF_DENOMINATOR)
