"""What one torch call runs, counted exactly: every aten op (torch's dispatcher) and every Keras layer call.

Eager torch pays host time per op and per layer call, so these counts bound
a forward pass on a GPU (issue 40 item 3). Read by ``bench/torch_op_count.py``
and ``tests/test_torch_routing_sync.py``; torch is imported only when used.
"""

import collections
import functools

import keras

#: Views allocate nothing and launch no kernel; ``kernel_ops`` leaves them out.
VIEW_OPS = {
    "view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "permute", "transpose", "t",
    "expand", "alias", "detach", "as_strided", "_reshape_alias", "lift_fresh",
}


@functools.lru_cache(maxsize=None)
def _recorder_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def has_boolean(indices):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)

    class OpRecorder(TorchDispatchMode):
        """Counts the aten ops run under it by name, boolean-mask indexing, and the
        shapes of matmuls and attention (``products``)."""

        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()
            self.boolean_indexing = 0
            self.products = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name == "repeat_interleave" and "Tensor" in func._overloadname:
                name = "repeat_interleave.Tensor"  # repeats given as a tensor: a value-dependent length
            self.counts[name] += 1
            if name in ("index", "index_put", "index_put_") and has_boolean(args[1]):
                self.boolean_indexing += 1
            if name in ("mm", "bmm", "addmm") or name.startswith("_scaled_dot_product"):
                self.products.append((name, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **kwargs)

    return OpRecorder


def record(fn):
    """The recorder (``counts``, ``boolean_indexing``, ``products``) of the aten ops ``fn()`` runs."""
    with _recorder_class()() as recorder:
        fn()
    return recorder


def kernel_ops(recorder):
    """The ops of ``recorder`` that launch work (views left out)."""
    return sum(n for name, n in recorder.counts.items() if name not in VIEW_OPS)


def layer_calls(fn):
    """How many Keras layer calls ``fn()`` makes (``keras.layers.Layer.__call__``, nested ones included)."""
    calls = []
    original = keras.layers.Layer.__call__

    def counting(layer, *args, **kwargs):
        calls.append(layer)
        return original(layer, *args, **kwargs)

    keras.layers.Layer.__call__ = counting
    try:
        fn()
    finally:
        keras.layers.Layer.__call__ = original
    return len(calls)
