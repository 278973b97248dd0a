"""MoNE-ViT: a ViT whose tokens are routed to nested experts (MoNE paper, Sec. 4)."""

import warnings

import numpy as np
from keras import ops

from keras_mone.layers import arguments
from keras_mone.layers.config import register
from keras_mone.layers.router import ExpertPreferredRouting, RandomRouter, Router
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.routing import capacity as capacity_lib
from keras_mone.routing.epr import DROPPED, gather_tokens, inverse_permutation

ROUTER_TYPES = ("learned", "random")
REALISED_CAPACITY_TOLERANCE = 0.02
"""Warn when whole-token rounding moves the effective capacity further than this."""


@register
class MoNEViTBackbone(ViTBackbone):
    """Mixture of Nested Experts ViT with real compute savings.

    A router (Sec. 4.1) at each of ``router_positions`` scores every token for
    the ``num_experts`` nested experts of widths ``D/2**(E-1), ..., D/2, D``;
    Expert Preferred Routing (Algorithm 1) assigns each example's tokens with
    exact static counts from the capacity distribution (Eq. 3). The tokens are
    then *grouped by expert once*, and every block runs each group on its own
    contiguous slice at its own width (``MoNEBlock``): nothing is computed at
    full width and masked. A routing decision holds until the next router
    (Sec. 6); blocks before the first router run at full width. Outputs come
    back in the original token order.

    Everything about the capacity is static, so changing it retraces:
    ``set_capacity(e_c)`` switches an existing model to another budget without
    touching its weights, and ``predict`` / ``evaluate`` / ``fit`` follow it.
    At ``capacity=1.0`` every token goes to the full expert; with ``alpha=0``
    (its initial value) the model is then exactly the dense ViT.

    Args (beyond ``ViTBackbone``'s):
        num_experts: ``E``, number of nested experts (4 in the paper).
        capacity: effective capacity ``e_c`` in ``(0, 1]`` (at least
            ``2**-(E-1)`` unless ``capacity_method="mod_greedy"``).
        capacity_method: "mone" (Eq. 3), "greedy" or "mod_greedy" (Table 2).
        router_positions: indices of blocks that get a router (default: the
            first block, as in the paper).
        router_type: "learned" (Eq. 1 gates with the router probability) or
            "random" (Sec. 6 / Fig. 7c: random assignment, same capacities,
            no gate).
        router_seed: seed of the random router.
        class_token_to_full_expert: route the class token (when
            ``use_class_token``) to the largest expert that has capacity,
            whatever the router says, so the token that the head (or, in
            ViViT, the temporal transformer) reads is never squeezed into a
            small expert. The token still counts against that expert's
            capacity and is still gated by its router probability. Off by
            default: the paper routes every token alike.
    """

    default_name = "mone_vit_backbone"

    def __init__(
        self,
        num_experts=4,
        capacity=0.5,
        capacity_method="mone",
        router_positions=(0,),
        router_type="learned",
        router_seed=None,
        class_token_to_full_expert=False,
        alpha_init=0.0,
        **kwargs,
    ):
        depth = arguments.integer("depth", kwargs.get("depth", 12))
        if isinstance(router_positions, (str, bytes)) or not hasattr(router_positions, "__iter__"):
            raise ValueError(f"`router_positions` must be a list of block indices, got {router_positions!r}.")
        positions = sorted({arguments.integer("router_positions", p, low=0) for p in router_positions})
        if not positions or positions[-1] >= depth:
            raise ValueError(
                f"`router_positions` must be block indices in [0, {depth - 1}], got {router_positions!r}."
            )
        if router_type not in ROUTER_TYPES:
            raise ValueError(f"`router_type` must be one of {ROUTER_TYPES}, got {router_type!r}.")
        hidden_dim = arguments.integer("hidden_dim", kwargs.get("hidden_dim", 768))
        num_experts = arguments.integer("num_experts", num_experts)
        if hidden_dim % 2 ** (num_experts - 1):
            raise ValueError(
                f"`num_experts`={num_experts!r} needs `hidden_dim` ({hidden_dim}) divisible by "
                f"2**(num_experts - 1) so that every nested width D/2**k is an integer."
            )
        self._first_router = positions[0]
        self.alpha_init = alpha_init  # read by _block_options during super().__init__
        super().__init__(**kwargs)
        self.num_experts = num_experts
        self.capacity_method = capacity_method
        self.router_positions = positions
        self.router_type = router_type
        self.router_seed = router_seed
        self.class_token_to_full_expert = class_token_to_full_expert
        self.expert_widths = [hidden_dim // 2 ** (num_experts - 1 - j) for j in range(num_experts)]
        self.routing = ExpertPreferredRouting(
            num_experts, 1.0, capacity_method=capacity_method, name="routing"
        )
        self.capacity = None
        self.set_capacity(capacity)
        if router_type == "learned":
            self.routers = [
                Router(num_experts, dtype=self.dtype_policy, name=f"router_{p}") for p in positions
            ]
        else:
            self.routers = [
                RandomRouter(num_experts, seed=router_seed, name=f"router_{p}") for p in positions
            ]

    def _is_routed_block(self, index):
        return index >= self._first_router

    def _block_options(self):
        return {"alpha_init": self.alpha_init}

    def _build_extra(self, token_shape):
        for router in self.routers:
            router.build(token_shape)

    # -- capacity ---------------------------------------------------------
    routed = True

    def set_capacity(self, capacity):
        """Runs the model at effective capacity ``capacity`` from now on.

        Weights are untouched; compiled ``predict`` / ``evaluate`` / ``fit``
        functions are rebuilt on their next use.
        """
        minimum = None if self.capacity_method == "mod_greedy" else self.num_experts
        capacity = capacity_lib.validate_effective_capacity(capacity, minimum, "capacity")
        self.routing.set_capacity(capacity)
        self.capacity = capacity
        if hasattr(self, "patch_embedding"):
            realised = self.realised_capacity
            if abs(realised - capacity) > REALISED_CAPACITY_TOLERANCE:
                warnings.warn(
                    f"`capacity`={capacity} is realised as {realised:.3f} with "
                    f"{self.num_tokens} tokens per example (experts take whole tokens); "
                    "`realised_capacity` reports it and FLOP counts follow it.",
                    stacklevel=2,
                )

    @property
    def realised_capacity(self):
        """Effective capacity the static token counts give: ``sum_j k_j d_j / (N D)``.

        Equals ``capacity`` up to whole-token rounding, which matters only for
        very few tokens (4 tokens at 0.9 run at 0.78).
        """
        counts, dropped = self.expert_token_counts()
        widths = capacity_lib.expert_width_fractions(len(counts))
        return float(np.dot(counts, widths) / (sum(counts) + dropped))

    @property
    def expert_capacities(self):
        """Capacity distribution ``c`` in use, smallest expert first."""
        return self.routing.capacities

    def expert_token_counts(self):
        """Static tokens per expert (smallest first) and dropped tokens, per example."""
        return self.routing.token_counts(self.num_tokens)

    def routing_key(self):
        return (self.capacity_method, self.routing.capacities)

    # -- forward ------------------------------------------------------------
    def encode(self, tokens, training=None, return_intermediates=False):
        state = _TokenGroups(tokens, self.hidden_dim)
        intermediates = {"router_probs": [], "expert_index": []}
        routers = dict(zip(self.router_positions, self.routers))
        for index, block in enumerate(self.blocks):
            if index in routers:
                probs = routers[index](state.merged())
                state = self._regroup(state, probs)
                if return_intermediates:  # probs are laid out in the previous order
                    intermediates["router_probs"].append(_to_original(probs, state.previous_order))
                    intermediates["expert_index"].append(_to_original(state.labels(probs), state.order))
            state.groups = block(
                state.groups, widths=state.widths, gates=state.gates, training=training
            )
        return self.norm(state.restored()), intermediates

    def _regroup(self, state, probs):
        """Assigns the current tokens to experts (EPR) and groups them.

        When one expert takes every token (e.g. ``capacity=1.0``), EPR's
        assignment is the same for any order of the tokens, and a block is
        equivariant to token order (positions are already embedded), so the
        tokens stay where they are: no gather now, no restoring permutation
        at the end.
        """
        current = state.merged()
        counts, dropped_count = self.routing.token_counts(probs.shape[1])
        if dropped_count == 0 and max(counts) == probs.shape[1]:
            expert = counts.index(probs.shape[1])
            new = _TokenGroups(current, self.hidden_dim)
            new.widths, new.experts = [self.expert_widths[expert]], [expert]
            new.gates = [probs[..., expert]] if self.router_type == "learned" else None
            new.order = new.previous_order = state.order
            return new
        index_groups, dropped = self.routing.group(self._routing_scores(probs, state.order))
        new = _TokenGroups(None, self.hidden_dim)
        positions = []
        for expert, indices in enumerate(index_groups):
            if indices.shape[1] == 0:
                continue
            new.groups.append(gather_tokens(current, indices))
            new.widths.append(self.expert_widths[expert])
            new.experts.append(expert)
            if self.router_type == "learned":
                new.gates.append(gather_tokens(probs[..., expert], indices))
            positions.append(indices)
        if dropped.shape[1]:
            new.dropped = gather_tokens(current, dropped)
            positions.append(dropped)
        if self.router_type != "learned":
            new.gates = None
        order = ops.concatenate(positions, axis=1) if len(positions) > 1 else positions[0]
        new.previous_order = state.order
        new.order = order if state.order is None else gather_tokens(state.order, order)
        return new

    def _routing_scores(self, probs, order):
        """Router probabilities, with the class token lifted above every other
        token for every expert when ``class_token_to_full_expert`` is set; EPR
        serves the largest expert first, so that expert takes it."""
        if not (self.class_token_to_full_expert and self.use_class_token):
            return probs
        num_tokens = probs.shape[1]
        if order is None:
            is_class = ops.arange(num_tokens) == 0
            is_class = ops.broadcast_to(is_class, ops.shape(probs)[:2])
        else:
            is_class = order == 0
        return probs + 2.0 * ops.expand_dims(ops.cast(is_class, probs.dtype), -1)


class _TokenGroups:
    """Token features grouped by expert, with the permutation that undoes it.

    ``order[b, p]`` is the original index of the token now at position ``p`` of
    the concatenation ``groups + [dropped]``.
    """

    def __init__(self, tokens, hidden_dim):
        self.groups = [] if tokens is None else [tokens]
        self.widths = [] if tokens is None else [hidden_dim]
        self.experts = [] if tokens is None else [None]
        self.gates = [] if tokens is None else None
        self.dropped = None
        self.order = None
        self.previous_order = None

    def merged(self):
        parts = self.groups + ([self.dropped] if self.dropped is not None else [])
        return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1)

    def restored(self):
        return _to_original(self.merged(), self.order)

    def labels(self, probs):
        """Expert index of each position of ``merged()`` (``DROPPED`` = -1)."""
        labels = []
        for expert, group in zip(self.experts, self.groups):
            labels.append(ops.full((group.shape[1],), expert, dtype="int32"))
        if self.dropped is not None:
            labels.append(ops.full((self.dropped.shape[1],), DROPPED, dtype="int32"))
        labels = ops.concatenate(labels) if len(labels) > 1 else labels[0]
        return ops.broadcast_to(labels, ops.shape(probs)[:2])


def _to_original(x, order):
    """``x`` (batch, tokens, ...) laid out in ``order`` (``order[b, p]`` = original index of
    position ``p``; ``None`` = original order already), back in the original order."""
    return x if order is None else gather_tokens(x, inverse_permutation(order))
