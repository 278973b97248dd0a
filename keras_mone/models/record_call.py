"""A backbone's forward record, computed by a compiled function.

``backbone(x, return_intermediates=True)`` called eagerly runs op by op; on
jax every op is compiled for its shapes on first use, and each capacity has
its own token-group shapes: the digits MoNE took 9 s for its first eager call
at a new capacity (0.4 s after), against 1.6 s to compile the whole forward
pass once and 35 ms to run it (batch 256, 2 CPU cores). Analyses, the
quickstart's routing table and ``RouterMonitor`` read records through
:func:`forward_with_record`, which compiles once per routing key
(``backbone.routing_key()``, the trace-relevant state of the backbone
contract, as for Keras' own compiled functions in ``capacity_control``).
"""

import keras
from keras import ops

_CACHE = "_record_functions"


def forward_with_record(backbone, inputs):
    """``(tokens, record)`` of ``backbone(inputs, training=False, return_intermediates=True)``
    as numpy arrays (the record's structure kept), computed by a function
    compiled for the backbone's current routing (jax: ``jax.jit`` over the
    weights; tensorflow: ``tf.function``; torch runs eagerly, without
    gradients). The weights are read at every call, so a function compiled
    before more training sees the new weights."""
    key = backbone.routing_key()
    cache = backbone.__dict__.setdefault(_CACHE, {})  # __dict__: kept out of Keras' tracking
    if key not in cache:
        cache[key] = _compile(backbone)
    outputs = cache[key](inputs)
    return keras.tree.map_structure(lambda value: ops.convert_to_numpy(value), outputs)


def _compile(backbone):
    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_function(backbone)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(lambda inputs: backbone(inputs, training=False, return_intermediates=True))
    return _torch_function(backbone)


def _jax_function(backbone):
    import jax

    def run(trainable, non_trainable, inputs):
        outputs, _ = backbone.stateless_call(trainable, non_trainable, inputs, training=False, return_intermediates=True)
        return outputs

    compiled = jax.jit(run)  # a new function per routing key: jax caches traces by function

    def call(inputs):
        trainable = [v.value for v in backbone.trainable_variables]
        non_trainable = [v.value for v in backbone.non_trainable_variables]
        return compiled(trainable, non_trainable, ops.convert_to_tensor(inputs))

    return call


def _torch_function(backbone):
    import torch

    def call(inputs):
        with torch.no_grad():
            return backbone(inputs, training=False, return_intermediates=True)

    return call
