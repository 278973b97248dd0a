"""ACMGate: the per-token gate choosing how many learners an ACM runs."""

import keras
from keras import ops

from keras_mone.arguments import integer, number
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.routing.epr import one_hot


@register
class ACMGate(ConfigMixin, keras.layers.Layer):
    """``D -> 16 -> 16 -> choices`` linear layers (no activations, as the official code).

    ``gate(z, training)`` returns ``(choice, probs)``, both float32
    ``(..., num_choices)``: ``probs = softmax(logits)`` (for the phase-2
    cross-entropy and the confidence of grouped execution) and ``choice``, a
    one-hot. In training the choice is a Gumbel-softmax sample at
    ``temperature`` (noise from a seeded ``keras.random.SeedGenerator``),
    hard in the forward pass with straight-through gradients,
    ``y_hard + (y_soft - stop_gradient(y_soft))``, so the task loss reaches the
    gate. The official code drops this gradient (its gated forward uses argmax
    indices). At inference the choice is the argmax of the logits.

    Args:
        num_choices: number of choices (``N + 1`` for an MLP ACM, counts ``0..N``).
        hidden_units: width of the two hidden linear layers.
        temperature: Gumbel-softmax temperature ``T`` (> 0).
        seed: seed of the Gumbel noise.
    """

    def __init__(self, num_choices, hidden_units=16, temperature=0.8, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.num_choices = integer("num_choices", num_choices, low=2)
        self.hidden_units = integer("hidden_units", hidden_units)
        self.temperature = number("temperature", temperature, 0.0, low_open=True)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.fc1 = keras.layers.Dense(self.hidden_units, dtype=self.dtype_policy, name="fc1")
        self.fc2 = keras.layers.Dense(self.hidden_units, dtype=self.dtype_policy, name="fc2")
        self.fc3 = keras.layers.Dense(self.num_choices, dtype=self.dtype_policy, name="fc3")

    def build(self, input_shape):
        self.fc1.build(input_shape)
        self.fc2.build(tuple(input_shape[:-1]) + (self.hidden_units,))
        self.fc3.build(tuple(input_shape[:-1]) + (self.hidden_units,))

    def logits(self, inputs):
        """float32 ``(..., num_choices)`` gate logits."""
        return ops.cast(self.fc3(self.fc2(self.fc1(inputs))), "float32")

    def call(self, inputs, training=None):
        logits = self.logits(inputs)
        probs = ops.softmax(logits, axis=-1)
        if not training:
            return one_hot(ops.argmax(logits, axis=-1), self.num_choices, "float32"), probs
        return self.straight_through(logits), probs

    def straight_through(self, logits):
        """Hard Gumbel-softmax sample of ``logits`` with straight-through gradients."""
        uniform = keras.random.uniform(ops.shape(logits), seed=self.seed_generator, dtype="float32")
        uniform = ops.clip(uniform, 1e-7, 1.0 - 1e-7)
        soft = ops.softmax((logits - ops.log(-ops.log(uniform))) / self.temperature, axis=-1)
        hard = one_hot(ops.argmax(soft, axis=-1), self.num_choices, "float32")
        # exactly one-hot forward (soft - soft == 0); the gradient is the soft sample's
        return hard + (soft - ops.stop_gradient(soft))

    def compute_output_spec(self, inputs, training=None):
        spec = keras.KerasTensor(tuple(inputs.shape[:-1]) + (self.num_choices,), dtype="float32")
        return spec, spec
