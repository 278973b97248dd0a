"""Torch ops run eagerly, without Keras' dispatch: the checks and casts ``layers.packed_block``
and its Triton form (``layers.packed_kernels``) share.

On eager torch every Keras op and layer call costs host time (its dispatch, torch's pytree
flattening, scopes) that a packed MoNE block repeats per token group; the functions here run
what Keras would run there, and say where that is exact (BENCHMARKS.md, "torch eager: the
host's share of a forward halved").
"""

import keras
from keras import ops

from keras_mone.layers.layer_norm import normalize


def _torch():
    return keras.backend.backend() == "torch"


def torch_hooks(*layers):
    """Whether a torch module hook would see one of ``layers`` called: one of its own forward
    or backward hooks, or a global one (``torch.nn.modules.module``). Only
    ``torch.nn.Module.__call__`` runs hooks, so a layer with one must be called as a layer."""
    from torch.nn.modules import module

    if (module._global_forward_hooks or module._global_forward_pre_hooks or module._global_backward_hooks
            or module._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in layers)


def eager_torch_tensors(tensors, dtype):
    """Whether ``tensors`` are concrete torch tensors of ``dtype`` (Keras' name) on which
    ops run eagerly (``eager``): no KerasTensors, nothing on the meta device (Keras'
    shape inference), nothing traced."""
    if not _torch() or not eager():
        return False
    import torch

    return all(
        isinstance(t, torch.Tensor) and t.device.type != "meta" and keras.backend.standardize_dtype(t.dtype) == dtype
        for t in tensors
    )


def plain_layer_norm(layer, ndim):
    """Whether ``layer`` is a built Keras ``LayerNormalization`` over the last of ``ndim`` axes,
    without RMS scaling, activity regularizer, rematerialisation or torch hooks: one whose call
    is ``F.layer_norm`` in at least float32, cast back (what ``direct_layer_norm`` runs, and
    what the grouped kernels' prologue applies, ``layers.packed_kernels``)."""
    return (type(layer) is keras.layers.LayerNormalization and layer.built and not layer.rms_scaling
            and list(layer.axis) in ([-1], [ndim - 1]) and layer.activity_regularizer is None
            and getattr(layer, "_remat_mode", None) is None and not torch_hooks(layer))


def direct_layer_norm(layer, x):
    """``layer(x)``: on jax in the platform's statistics form (``layer_norm.normalize``); a
    built Keras ``LayerNormalization`` on eager torch as the ops its ``call`` runs there
    (``F.layer_norm`` in at least float32, cast back), without Keras' ``Layer.__call__`` and
    op dispatch, which cost more host time than the LayerNorm and change nothing here (the
    layer neither casts its input nor autocasts its weights; ``tests/test_torch_direct_calls.py``)."""
    if not (type(layer) is keras.layers.LayerNormalization and layer.built and _torch() and eager()):
        return normalize(layer, x)
    if not plain_layer_norm(layer, len(x.shape)):
        if torch_hooks(layer) or layer.activity_regularizer is not None or getattr(layer, "_remat_mode", None):
            return layer(x)  # what ``Layer.__call__`` serves: hooks, activity losses, rematerialisation
        return layer.call(x)  # RMS scaling, other axes
    import torch

    wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # Keras: "at least float32"
    gamma, beta = (None if v is None else direct_cast(v, wide) for v in (layer.gamma, layer.beta))
    outputs = torch.nn.functional.layer_norm(direct_cast(x, wide), x.shape[-1:], gamma, beta, layer.epsilon)
    return direct_cast(direct_cast(outputs, x.dtype), layer.compute_dtype)


def direct_cast(x, dtype):
    """``ops.cast(x, dtype)`` for a tensor or variable and a floating ``dtype`` (a Keras name or
    a torch dtype); on torch what Keras' torch ``cast`` runs (a variable read as Keras reads
    it, autocast and stateless scopes included, then ``Tensor.to`` if the dtype differs),
    without its dispatch. Other dtypes and backends: ``ops.cast``."""
    target = _TORCH_FLOATS.get(dtype) if _torch() else None
    if target is None:
        return ops.cast(x, dtype)
    tensor = x.value if isinstance(x, keras.Variable) else x
    return tensor if tensor.dtype == target else tensor.to(target)


def _torch_floats():
    """Keras' floating dtype names and torch's floating dtypes, to the torch dtype."""
    import torch

    names = ("float16", "bfloat16", "float32", "float64")
    return {**{name: getattr(torch, name) for name in names}, **{getattr(torch, n): getattr(torch, n) for n in names}}


_TORCH_FLOATS = _torch_floats() if keras.backend.backend() == "torch" else {}


def eager_without_grad(*tensors):
    """Whether ops on ``tensors`` (``None`` entries ignored) run eagerly (``eager``),
    with no autograd recording them and no autocast: where ``out=`` writes may be used
    (``out=`` records no gradient, and autocast casts no ``out=`` call's inputs)."""
    if not _torch():
        return False
    import torch

    if not eager() or torch.is_autocast_enabled(_device_type(tensors)):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def eager():
    """Whether torch runs ops eagerly on plain tensors: not under ``torch.compile`` (its
    exporters included), TorchScript tracing or ``torch.func`` transforms, which take
    neither data pointers nor writes into strided views (``out=``): dynamo breaks its
    graph on them (inductor fuses the copies there anyway), functorch's wrapper tensors
    have no storage."""
    import torch

    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return not torch._C._are_functorch_transforms_active()


def _device_type(tensors):
    return next((t.device.type for t in tensors if t is not None), "cpu")
