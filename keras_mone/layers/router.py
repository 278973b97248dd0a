"""Routers and the Expert Preferred Routing layer (MoNE Sec. 4.1-4.3, Algorithm 1)."""

import keras
from keras import ops

from keras_mone.layers.config import ConfigMixin, register
from keras_mone.routing.plan import ExpertPreferredPlan


@register
class Router(ConfigMixin, keras.layers.Layer):
    """``r = softmax(W x + b)`` over the ``num_experts`` nested experts (Sec. 4.1).

    Returns float32 probabilities of shape ``(batch, tokens, num_experts)``
    whatever the compute dtype, so routing decisions do not depend on it.
    """

    def __init__(self, num_experts=4, kernel_initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.num_experts = num_experts
        self.kernel_initializer = keras.initializers.get(
            kernel_initializer or keras.initializers.RandomNormal(stddev=0.02)
        )
        self.dense = keras.layers.Dense(
            num_experts, kernel_initializer=self.kernel_initializer,
            dtype=self.dtype_policy, name="dense",
        )

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, inputs):
        return ops.softmax(ops.cast(self.dense(inputs), "float32"), axis=-1)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.num_experts,)

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype="float32")


@register
class RandomRouter(ConfigMixin, keras.layers.Layer):
    """Uniform random "probabilities": the random router of Sec. 6 / Fig. 7c.

    With EPR on top, tokens reach experts at random while every expert still
    gets exactly its capacity. It has no weights, so models using it apply no
    router gate in Eq. 1.
    """

    def __init__(self, num_experts=4, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.num_experts = num_experts
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, inputs):
        shape = (ops.shape(inputs)[0], inputs.shape[1], self.num_experts)
        return keras.random.uniform(shape, seed=self.seed_generator, dtype="float32")

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.num_experts,)


@register
class ExpertPreferredRouting(ConfigMixin, keras.layers.Layer):
    """The EPR layer: Algorithm 1 of the MoNE paper, per example, static counts
    (a Keras face of ``keras_mone.routing.plan.ExpertPreferredPlan``, which holds
    the capacity and does the work).

    From the largest expert to the smallest, expert ``j`` takes the top
    ``floor(c_j N)`` still-unassigned tokens by its router probability;
    leftovers go to the smallest expert. ``c`` comes from ``capacity_method``
    at ``effective_capacity`` (Eq. 3 by default).

    ``layer(router_probs)`` returns the int32 expert index of every token
    (0 = smallest, -1 = dropped); ``layer.group(router_probs)`` returns the
    per-expert token indices used to run each expert on contiguous slices.

    Args:
        num_experts: number of nested experts ``E``.
        effective_capacity: ``e_c`` in ``(0, 1]``; change it with ``set_capacity``.
        capacity_method: "mone" (Eq. 3), "greedy" or "mod_greedy" (Table 2).
        beta, delta: parameters of Eq. 3.
    """

    def __init__(
        self,
        num_experts=4,
        effective_capacity=1.0,
        capacity_method="mone",
        beta=10.0,
        delta=2.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.plan = ExpertPreferredPlan(num_experts, effective_capacity, capacity_method, beta, delta)
        # No weights: built from the start. Models call ``group`` rather than
        # ``__call__``, and Keras' predict_on_batch re-runs an eager forward
        # pass whenever any layer reports itself unbuilt.
        self.built = True

    num_experts = property(lambda self: self.plan.num_experts)
    capacity_method = property(lambda self: self.plan.capacity_method)
    beta = property(lambda self: self.plan.beta)
    delta = property(lambda self: self.plan.delta)
    effective_capacity = property(lambda self: self.plan.effective_capacity)
    capacities = property(lambda self: self.plan.capacities)

    def set_capacity(self, effective_capacity):
        """Sets ``e_c`` (validated) and recomputes the expert capacities."""
        self.plan.set_capacity(effective_capacity)

    def token_counts(self, num_tokens):
        """``(counts per expert, num_dropped)`` for ``num_tokens`` tokens (cached per
        capacities and token count: every forward pass asks twice per router)."""
        return self.plan.token_counts(num_tokens)

    def group(self, router_probs):
        """``(groups, dropped)`` index tensors, see ``routing.epr.route_tokens``."""
        return self.plan.group(router_probs)

    def call(self, router_probs):
        return self.plan.assignment(router_probs)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1])

    def compute_output_spec(self, router_probs):
        return keras.KerasTensor(router_probs.shape[:-1], dtype="int32")
