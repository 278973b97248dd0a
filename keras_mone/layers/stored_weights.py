"""A weight as it is stored, for the kernels that cast it tile by tile themselves.

Under a mixed precision policy a layer's call reads each float32 variable cast to the compute
dtype (Keras' autocast): one cast copy of every weight per call. The grouped projection
kernels (``kernels.grouped_projection`` on jax, ``kernels.triton_grouped_projection`` on
torch) cast each weight tile as they load it, to the same values, so the copy is work for
nothing: 96 launches of MoNE-ViT-B/16's forward compiled for an H200, and 96 ops of torch's
eager forward (BENCHMARKS.md).
"""

from keras import ops


def stored(variable):
    """``variable``'s value in its own dtype, where a layer call under a mixed precision policy
    would cast it to the compute dtype. Keras has no public switch for this: the variable's own
    autocast flag is turned off for the read (so a thread reading the same variable at that
    moment would see it uncast: the zoo's calls do not share a model across threads); a Keras
    without that flag, or a value that is not a variable, gives what ``ops.convert_to_tensor``
    gives."""
    if not isinstance(getattr(variable, "_autocast", None), bool):
        return ops.convert_to_tensor(variable)
    autocast, variable._autocast = variable._autocast, False
    try:
        return ops.convert_to_tensor(variable)
    finally:
        variable._autocast = autocast
