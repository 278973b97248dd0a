"""Sparsely gated mixture of MLP experts with static expert capacity (Sparse-MLP Sec. 2.2).

Gate ``G(x) = TopK(softmax(W_g x + eps))``, ``eps ~ N(0, 1/N_E^2)`` in training
only, top-k weights not renormalised (Eq. 5). Auxiliary loss
``w * (CV^2(importance) + CV^2(load)) / 2`` (Eq. 6-11) with the smooth load
estimator of V-MoE (Riquelme et al. 2021, App. A).
"""

import math
import warnings

import keras
from keras import ops

from keras_mone import arguments
from keras_mone.layers.config import ConfigMixin, register

_MOE_NAMES = ("num_experts", "expert_hidden_dim", "top_k")


def check_moe_arguments(num_experts, expert_hidden_dim, top_k, capacity_factor, aux_loss_weight,
                        names=_MOE_NAMES):
    """Checked ``(num_experts, expert_hidden_dim, top_k, capacity_factor, aux_loss_weight)``."""
    num_experts = arguments.integer(names[0], num_experts)
    expert_hidden_dim = arguments.integer(names[1], expert_hidden_dim)
    top_k = arguments.integer(names[2], top_k)
    if top_k > num_experts:
        raise ValueError(
            f"`{names[2]}` ({top_k}) must not exceed `{names[0]}` ({num_experts}): "
            "an item chooses distinct experts."
        )
    capacity_factor = arguments.number("capacity_factor", capacity_factor, 0.0, low_open=True)
    aux_loss_weight = arguments.number("aux_loss_weight", aux_loss_weight, 0.0)
    return num_experts, expert_hidden_dim, top_k, capacity_factor, aux_loss_weight


def expert_capacity(num_items, num_experts, top_k, capacity_factor):
    """``min(items, ceil(capacity_factor * K * items / N_E))``: slots per expert and example."""
    # the tolerance keeps e.g. 1.25 * 2 * 8 / 4 = 5.000...01 at 5
    return max(1, min(num_items, math.ceil(capacity_factor * top_k * num_items / num_experts - 1e-9)))


def starved_capacity_message(num_items, num_experts, top_k, capacity_factor, where=""):
    """The warning for a ``capacity_factor`` too small to give an expert one item per example
    (``expert_capacity`` then keeps the minimum, 1), else ``None``."""
    asked = capacity_factor * top_k * num_items / num_experts
    if asked >= 1 - 1e-9:
        return None
    realised = num_experts / (top_k * num_items)
    return (
        f"`capacity_factor`={capacity_factor:g} is realised as {realised:.3f} with {num_items} items per "
        f"example{where}: each of the {num_experts} experts takes 1 item per example (the minimum: "
        f"{capacity_factor:g} * top_k {top_k} * {num_items} items / {num_experts} experts = {asked:.3g} slots), "
        f"so at most {num_experts} of the {top_k * num_items} top-{top_k} choices run; the others pass "
        "through the residual."
    )


def importance_and_load(logits, noisy_logits, top_k, noise_std):
    """Eq. 6 and V-MoE's smooth load, each summed over all but the last axis.

    ``importance_e = sum softmax(logits)_e``; ``load_e = sum P((W_g x)_e + eps'
    >= t_k)`` with ``t_k`` the k-th largest noisy logit and ``eps' ~ N(0,
    noise_std^2)``, i.e. ``1 - Phi((t_k - (W_g x)_e) / noise_std)``.
    """
    axes = tuple(range(len(logits.shape) - 1))
    importance = ops.sum(ops.softmax(logits, axis=-1), axis=axes)
    threshold = ops.top_k(noisy_logits, top_k)[0][..., -1:]
    z = (threshold - logits) / noise_std
    load = ops.sum(0.5 * (1.0 - ops.erf(z / math.sqrt(2.0))), axis=axes)
    return importance, load


def cv_squared(values):
    """Squared coefficient of variation ``var / mean^2`` (population variance)."""
    return ops.var(values) / (ops.square(ops.mean(values)) + 1e-12)


@register
class SparseMoE(ConfigMixin, keras.layers.Layer):
    """Routes each item of ``(batch, items, features)`` to its top-k of ``num_experts`` MLPs.

    Expert ``e`` is ``Linear(F -> H) -> GELU -> Linear(H -> F)``. The layer
    returns ``sum_k G(x)_k E_k(x)`` over the choices that found a slot: no
    residual, so a caller adding it to ``x`` passes overflow items through.

    Capacity is per example: each expert takes at most
    ``C = min(items, ceil(capacity_factor * K * items / N_E))`` items of each
    example (``expert_capacity``), at training and at inference. Per example
    because the batch size is not static, and so an example's output never
    depends on the other examples in its batch.

    Overflow (batch prioritised routing, V-MoE Sec. 3.2): every top-1 choice
    is served before any top-2 choice, and within a rank items are served by
    their top-1 gate value, highest first; a choice beyond its expert's
    capacity contributes nothing. Dispatch gathers each expert's items into a
    static ``(batch, N_E, C, F)`` tensor, runs the experts on it and gathers
    the outputs back, weighted by the gates: compute is ``N_E * C`` item
    passes per example, never every expert on every item.

    ``call(x, training, return_stats=True)`` returns ``(y, stats)`` with
    ``importance`` (N_E,) the sum of ``softmax(W_g x)`` over batch and items
    (Eq. 6, without noise); ``load`` (N_E,) the sum over batch and items of
    ``p_e(x) = 1 - Phi((t_k(x) - (W_g x)_e) / sigma)``, ``t_k`` the k-th
    largest noisy logit, ``sigma = 1 / N_E`` (V-MoE's estimator of Eq. 9;
    at inference ``t_k`` is taken from the clean logits); ``aux_loss`` =
    ``aux_loss_weight * (CV^2(importance) + CV^2(load)) / 2``; ``counts``
    (batch, N_E) int32, the items each expert took per example; ``overflow``,
    the share of choices that found no slot. The layer adds no loss itself.

    Args:
        num_experts: ``N_E`` >= 1.
        expert_hidden_dim: ``H``, hidden width of every expert.
        top_k: ``K`` in ``[1, num_experts]``.
        capacity_factor: > 0; ``num_experts / top_k`` or more never drops.
        noise: add the gate noise in training.
        aux_loss_weight: ``lambda`` of Eq. 11 (0.01 in the paper).
        gelu_approximate: tanh GELU instead of the exact one.
        seed: seed of the gate noise.
    """

    def __init__(
        self, num_experts, expert_hidden_dim, top_k, capacity_factor=1.25, noise=True,
        aux_loss_weight=0.01, gelu_approximate=False, seed=None, **kwargs,
    ):
        super().__init__(**kwargs)
        (
            self.num_experts, self.expert_hidden_dim, self.top_k, self.capacity_factor,
            self.aux_loss_weight,
        ) = check_moe_arguments(num_experts, expert_hidden_dim, top_k, capacity_factor, aux_loss_weight)
        self.noise = bool(noise)
        self.gelu_approximate = bool(gelu_approximate)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.noise_std = 1.0 / self.num_experts
        self._warned_items = None

    def warn_if_starved(self, num_items, stacklevel=2):
        """Warns (once per item count) when ``capacity_factor`` leaves every expert the minimum of
        one item per example: fewer slots than ``capacity_factor`` asks for cannot be made."""
        if num_items == self._warned_items:
            return
        self._warned_items = num_items
        message = starved_capacity_message(
            num_items, self.num_experts, self.top_k, self.capacity_factor, f" in `{self.name}`"
        )
        if message:
            warnings.warn(message, stacklevel=stacklevel + 1)

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[1] is None or input_shape[2] is None:
            raise ValueError(
                f"SparseMoE `{self.name}` takes inputs (batch, items, features) with static items "
                f"and features, got shape {tuple(input_shape)}."
            )
        self.warn_if_starved(input_shape[1])
        features, hidden, experts = input_shape[2], self.expert_hidden_dim, self.num_experts
        # glorot per expert: VarianceScaling counts the expert axis into both fans
        glorot = keras.initializers.VarianceScaling(experts, "fan_avg", "uniform")
        self.gate_kernel = self.add_weight(
            (features, experts), keras.initializers.RandomNormal(stddev=0.02), name="gate_kernel"
        )
        self.kernel_0 = self.add_weight((experts, features, hidden), glorot, name="kernel_0")
        self.bias_0 = self.add_weight((experts, hidden), "zeros", name="bias_0")
        self.kernel_1 = self.add_weight((experts, hidden, features), glorot, name="kernel_1")
        self.bias_1 = self.add_weight((experts, features), "zeros", name="bias_1")

    def capacity(self, num_items):
        """Slots per expert and example for ``num_items`` items."""
        return expert_capacity(num_items, self.num_experts, self.top_k, self.capacity_factor)

    def gate(self, inputs, training=None):
        """``(logits, noisy_logits, probs)``, float32, each (batch, items, N_E)."""
        logits = ops.matmul(ops.cast(inputs, "float32"), ops.cast(self.gate_kernel, "float32"))
        noisy = logits
        if training and self.noise:
            noisy = logits + self.noise_std * keras.random.normal(
                ops.shape(logits), seed=self.seed_generator, dtype="float32"
            )
        return logits, noisy, ops.softmax(noisy, axis=-1)

    def _slots(self, gates, experts, capacity):
        """Slot ``expert * C + position`` of every choice (batch, items, K) and whether it fits."""
        items, k, n = gates.shape[1], self.top_k, self.num_experts
        order = ops.argsort(-gates[..., 0], axis=-1)  # items by top-1 gate, highest first
        ranked = ops.take_along_axis(experts, order[..., None], axis=1)
        ranked = ops.reshape(ops.transpose(ranked, (0, 2, 1)), (-1, k * items))  # rank-major
        one_hot = ops.one_hot(ranked, n, dtype="int32")
        position = ops.sum((ops.cumsum(one_hot, axis=1) - 1) * one_hot, axis=-1)
        position = ops.transpose(ops.reshape(position, (-1, k, items)), (0, 2, 1))
        position = ops.take_along_axis(position, ops.argsort(order, axis=-1)[..., None], axis=1)
        fits = position < capacity
        return ops.where(fits, experts * capacity + position, 0), fits

    def _dispatch_index(self, slots, fits, experts, capacity):
        """Item index of each slot (batch, N_E * C) and whether the slot is filled."""
        items, k, n = slots.shape[1], self.top_k, self.num_experts
        flat = ops.reshape(ops.where(fits, slots, n * capacity), (-1, items * k))
        by_slot = ops.argsort(flat, axis=-1)  # kept choices, grouped by expert, in queue order
        counts = ops.sum(ops.one_hot(experts, n, dtype="int32") * ops.cast(fits, "int32")[..., None],
                         axis=(1, 2))
        starts = ops.cumsum(counts, axis=-1) - counts
        slot_rank = ops.arange(capacity, dtype="int32")
        index = ops.reshape(starts[..., None] + slot_rank, (-1, n * capacity))
        filled = ops.reshape(slot_rank < counts[..., None], (-1, n * capacity))
        choice = ops.take_along_axis(by_slot, ops.minimum(index, items * k - 1), axis=1)
        return choice // k, filled, counts

    def _experts(self, dispatched):
        hidden = ops.einsum("becf,efh->bech", dispatched, self.kernel_0) + self.bias_0[:, None, :]
        hidden = ops.gelu(hidden, approximate=self.gelu_approximate)
        return ops.einsum("bech,ehf->becf", hidden, self.kernel_1) + self.bias_1[:, None, :]

    def call(self, inputs, training=None, return_stats=False):
        items, features, n = inputs.shape[1], inputs.shape[2], self.num_experts
        capacity = self.capacity(items)
        logits, noisy, probs = self.gate(inputs, training)
        gates, experts = ops.top_k(probs, self.top_k)
        experts = ops.cast(experts, "int32")
        slots, fits = self._slots(gates, experts, capacity)
        item_of_slot, _, counts = self._dispatch_index(slots, fits, experts, capacity)
        dispatched = ops.take_along_axis(inputs, item_of_slot[..., None], axis=1)
        expert_out = self._experts(ops.reshape(dispatched, (-1, n, capacity, features)))
        expert_out = ops.reshape(expert_out, (-1, n * capacity, features))
        per_choice = ops.take_along_axis(
            expert_out, ops.reshape(slots, (-1, items * self.top_k))[..., None], axis=1
        )
        weights = ops.cast(ops.where(fits, gates, 0.0), self.compute_dtype)
        per_choice = ops.reshape(per_choice, (-1, items, self.top_k, features)) * weights[..., None]
        outputs = ops.sum(per_choice, axis=2)
        if not return_stats:
            return outputs
        return outputs, self._stats(logits, noisy, fits, counts)

    def _stats(self, logits, noisy, fits, counts):
        importance, load = importance_and_load(logits, noisy, self.top_k, self.noise_std)
        aux = self.aux_loss_weight * (cv_squared(importance) + cv_squared(load)) / 2.0
        return {
            "importance": importance,
            "load": load,
            "aux_loss": aux,
            "counts": counts,
            "overflow": 1.0 - ops.mean(ops.cast(fits, "float32")),
        }

    def stats_spec(self, batch):
        """KerasTensors of the ``stats`` dict for a batch of size ``batch``."""
        n = self.num_experts
        return {
            "importance": keras.KerasTensor((n,), dtype="float32"),
            "load": keras.KerasTensor((n,), dtype="float32"),
            "aux_loss": keras.KerasTensor((), dtype="float32"),
            "counts": keras.KerasTensor((batch, n), dtype="int32"),
            "overflow": keras.KerasTensor((), dtype="float32"),
        }

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def compute_output_spec(self, inputs, training=None, return_stats=False):
        outputs = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        return (outputs, self.stats_spec(inputs.shape[0])) if return_stats else outputs
