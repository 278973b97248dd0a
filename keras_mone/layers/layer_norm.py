"""A block's LayerNorm in the statistics form of the platform (``platform_forms.statistics_form``).

``normalize(layer, x)`` is ``layer(x)`` for a Keras ``LayerNormalization``, computed as
Keras computes it (in at least float32, the result cast to the input's dtype, then to the
layer's compute dtype), with the mean and variance over the last axis written in one of
the forms XLA compiles differently on a GPU:

* ``"keras"``: ``layer(x)`` itself (``ops.layer_normalization``: ``jnp.mean`` and
  ``jnp.var``, two reductions and an rsqrt pass, the normalisation fused into consumers);
* ``"one_pass"``: ``E[x]`` and ``E[x^2]`` in one reduction, ``var = E[x^2] - E[x]^2``
  (clamped at 0: rounding can make it negative), flax's ``LayerNorm`` default. Its error
  grows with ``mean^2 / var`` of a token's features: at D = 768 in float32, 4096 rows of
  std 1 with ``mean^2 / var`` of 1e2 / 1e4 / 1e6 are off by up to 6e-5 / 8e-3 / 0.7 (the
  two-pass form: 2e-6 / 2e-5 / 3e-4; XLA on the CPU). The shipped digits presets' token
  rows have at most 0.12 (``bench/layer_norm_rows.py``);
* ``"fused"``: ``var = E[(x - E[x])^2]`` as Keras, the result written ``(x - mean) *
  rsqrt(var + eps)``, the pattern XLA's GPU compiler fuses into one Triton kernel per
  LayerNorm (statistics and normalised output);
* ``"kernel"``: Keras' two-pass statistics, mean and rstd, by one Pallas kernel
  (``kernels.row_statistics``; interpreted off GPUs), the normalisation XLA's.

Only a plain ``LayerNormalization`` over the last axis, built, on jax, with nothing that
``Layer.__call__`` would add (RMS scaling, a subclass's ``call``, an activity regularizer,
rematerialisation, a distribution's layouts, a mask, symbolic inputs) takes a form; every
other call is ``layer(x)``.
"""

import keras
from keras import ops

from keras_mone.layers.platform_forms import accelerator, statistics_form


def normalize(layer, x):
    """``layer(x)`` (a ``keras.layers.LayerNormalization``) in the form of ``statistics_form()``."""
    form = statistics_form()
    if form == "keras" or not _plain(layer, x):
        return layer(x)
    dtype = keras.backend.standardize_dtype(x.dtype)
    wide, mean, scale = _statistics(x, layer.epsilon, form)
    if layer.gamma is not None:
        scale = scale * ops.cast(layer.gamma, wide.dtype)
    outputs = (wide - mean) * scale
    if layer.beta is not None:
        outputs = outputs + ops.cast(layer.beta, wide.dtype)
    return ops.cast(ops.cast(outputs, dtype), layer.compute_dtype)  # as Keras casts


def prologue_applies(layer, x):
    """Whether a kernel may apply ``layer`` to ``x`` as its prologue from row statistics
    (``row_statistics``, or the statistics a kernel's epilogue gives): a plain LayerNorm (module
    docstring) with both weights."""
    return _plain(layer, x) and layer.gamma is not None and layer.beta is not None


def _plain(layer, x):
    """Whether ``normalize`` may compute ``layer(x)`` itself (module docstring)."""
    return (
        keras.backend.backend() == "jax"
        and type(layer) is keras.layers.LayerNormalization  # (a subclass may have its own call)
        and layer.built
        and not layer.rms_scaling
        and list(layer.axis) in ([-1], [len(x.shape) - 1])
        and layer.activity_regularizer is None
        and getattr(layer, "_remat_mode", None) is None
        and keras.distribution.distribution() is None
        and getattr(x, "_keras_mask", None) is None
        and not isinstance(x, keras.KerasTensor)
    )


def row_statistics(layer, x):
    """``(mean, rstd)`` of ``layer``'s normalisation of ``x``, each ``x.shape[:-1]``, in at least
    float32 and in the form of ``statistics_form()`` (``"keras"``: two passes), for a kernel that
    applies the LayerNorm itself (``kernels.grouped_projection``'s prologue); ``None`` where
    ``normalize`` would call the layer (see the module docstring)."""
    if not _plain(layer, x):
        return None
    _, mean, rstd = _statistics(x, layer.epsilon, statistics_form())
    return mean[..., 0], rstd[..., 0]


def _statistics(x, epsilon, form):
    """``(wide x, mean, rsqrt(variance + epsilon))`` over the last axis (kept), at least float32."""
    dtype = keras.backend.standardize_dtype(x.dtype)
    wide = x if dtype in ("float32", "float64") else ops.cast(x, "float32")  # Keras: at least float32
    if form == "kernel" and dtype in ("float16", "bfloat16", "float32"):
        from keras_mone.kernels.row_statistics import row_statistics

        mean, rstd = row_statistics(x, float(epsilon), interpret=accelerator() != "gpu")
        return wide, mean[..., None], rstd[..., None]
    mean = ops.mean(wide, axis=-1, keepdims=True)
    if form == "one_pass":
        variance = ops.maximum(ops.mean(ops.square(wide), axis=-1, keepdims=True) - ops.square(mean), 0.0)
    else:
        variance = ops.mean(ops.square(wide - mean), axis=-1, keepdims=True)
    return wide, mean, ops.rsqrt(variance + ops.cast(epsilon, wide.dtype))
