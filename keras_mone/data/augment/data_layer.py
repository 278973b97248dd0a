"""The base class of keras_mone's data-augmentation layers, on public APIs only.

An augmentation layer runs in two places: on backend tensors (eager, jit, a
Keras model) and inside a ``tf.data`` pipeline whatever the Keras backend. Its
math is written once against ``self.ops``, a small namespace with
``numpy`` (array functions), ``cast``, ``shape`` and ``random`` (``uniform``,
``beta`` drawn from the layer's own stream):

* outside ``tf.data`` (or with the tensorflow backend) it is ``keras.ops`` and
  ``keras.random`` with a ``keras.random.SeedGenerator``;
* inside a ``tf.data`` graph with the jax or torch backend it is TensorFlow
  (``tf.experimental.numpy`` and a ``tf.random.Generator``), and the layer is
  called directly, since Keras would convert the graph tensors to the backend.

Keras' own ``DataLayer`` does the same but is not exported under a public name.
"""

import sys

import keras


class _KerasRandom:
    def __init__(self, generator):
        self.generator = generator

    def uniform(self, shape, minval=0.0, maxval=1.0):
        return keras.random.uniform(shape, minval, maxval, seed=self.generator)

    def beta(self, shape, alpha, beta):
        return keras.random.beta(shape, alpha, beta, seed=self.generator)


class _TensorFlowRandom:
    def __init__(self, tf, generator):
        self.tf, self.generator = tf, generator

    def uniform(self, shape, minval=0.0, maxval=1.0):
        return self.generator.uniform(shape, minval, maxval, dtype="float32")

    def beta(self, shape, alpha, beta):
        # Beta(a, b) = X / (X + Y), X ~ Gamma(a), Y ~ Gamma(b).
        seeds = self.generator.make_seeds(2)
        x = self.tf.random.stateless_gamma(shape, seeds[:, 0], alpha, dtype="float32")
        y = self.tf.random.stateless_gamma(shape, seeds[:, 1], beta, dtype="float32")
        return x / (x + y)


class _TensorFlowNumpy:
    """``tf.experimental.numpy``, with an ``arange`` that takes a graph tensor."""

    def __init__(self, tf):
        self.tf = tf

    def __getattr__(self, name):
        return getattr(self.tf.experimental.numpy, name)

    def arange(self, *args, dtype=None):
        return self.tf.range(*args, dtype=dtype)


class _Ops:
    """The namespace an augmentation layer computes with."""

    def __init__(self, numpy, cast, shape, random):
        self.numpy, self.cast, self.shape, self.random = numpy, cast, shape, random


def _tensorflow_if_in_graph(inputs):
    """The ``tensorflow`` module when ``inputs`` are being traced by ``tf.data``
    (or any ``tf.function``) under a non-TensorFlow Keras backend, else None."""
    if keras.backend.backend() == "tensorflow" or "tensorflow" not in sys.modules:
        return None
    tf = sys.modules["tensorflow"]
    first = keras.tree.flatten(inputs)[0]
    if isinstance(first, keras.KerasTensor) or not tf.inside_function():
        return None
    return tf


class DataLayer(keras.layers.Layer):
    """A layer whose ``call`` computes with ``self.ops`` (see the module docstring).

    Args:
        seed: seed of the layer's random stream (``ops.random``); the
            TensorFlow stream used inside ``tf.data`` is made from it on first use.
    """

    def __init__(self, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.seed = seed
        self.generator = keras.random.SeedGenerator(seed)
        self._tf_generator = None
        self._graph_ops = None

    @property
    def ops(self):
        if self._graph_ops is not None:
            return self._graph_ops
        return _Ops(keras.ops, keras.ops.cast, keras.ops.shape, _KerasRandom(self.generator))

    def _tensorflow_ops(self, tf):
        if self._tf_generator is None:
            with tf.init_scope():  # a variable made outside the traced function
                if self.seed is None:
                    self._tf_generator = tf.random.Generator.from_non_deterministic_state()
                else:
                    self._tf_generator = tf.random.Generator.from_seed(self.seed)
        return _Ops(_TensorFlowNumpy(tf), tf.cast, tf.shape, _TensorFlowRandom(tf, self._tf_generator))

    def __call__(self, inputs, *args, **kwargs):
        tf = _tensorflow_if_in_graph(inputs)
        if tf is None:
            return super().__call__(inputs, *args, **kwargs)
        inputs = keras.tree.map_structure(lambda x: tf.convert_to_tensor(x), inputs)
        self._graph_ops = self._tensorflow_ops(tf)
        try:
            return self.call(inputs, *args, **kwargs)
        finally:
            self._graph_ops = None

    def compute_output_shape(self, input_shape):
        return input_shape


__all__ = ["DataLayer"]
