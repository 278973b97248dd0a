"""MoNE-ViT: a ViT whose tokens are routed to nested experts (MoNE paper, Sec. 4)."""

import warnings

import numpy as np

from keras_mone import arguments
from keras_mone.layers.config import register
from keras_mone.layers.router import ExpertPreferredRouting, RandomRouter, Router
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.routing import capacity as capacity_lib
from keras_mone.routing.parts import NestedExperts
from keras_mone.models.vivit_backbone import video_form

ROUTER_TYPES = ("learned", "random")


@register
class MoNEViTBackbone(ViTBackbone):
    """Mixture of Nested Experts ViT with real compute savings.

    A router (Sec. 4.1) at each of ``router_positions`` scores every token for
    the ``num_experts`` nested experts of widths ``D/2**(E-1), ..., D/2, D``;
    Expert Preferred Routing (Algorithm 1) assigns each example's tokens with
    exact static counts from the capacity distribution (Eq. 3). The tokens are
    then *grouped by expert once*, and every block runs each group on its own
    contiguous slice at its own width (``ViTBlock``): nothing is computed at
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
        capacity_method: how ``e_c`` is split over the experts (Table 2):
            "mone" (Eq. 3), "greedy" (full + smallest expert), "mod_greedy"
            (full expert, other tokens skip the blocks), or the static
            "uniform" / "proportionate", which run at their own e_c only
            (15/32 and 4/15 at E = 4; ``routing.capacity.method_capacity``).
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
        self.router_positions = positions
        self.router_type = router_type
        self.router_seed = router_seed
        self.class_token_to_full_expert = class_token_to_full_expert
        self.expert_widths = [hidden_dim // 2 ** (num_experts - 1 - j) for j in range(num_experts)]
        # The routing plan owns E, the capacity method and e_c; built at the requested capacity.
        self.routing = ExpertPreferredRouting(
            num_experts, capacity_lib.method_capacity(capacity_method, capacity, num_experts),
            capacity_method=capacity_method, name="routing",
        )
        self._warn_if_rounded(stacklevel=2)
        if router_type == "learned":
            self.routers = [
                Router(num_experts, dtype=self.dtype_policy, name=f"router_{p}") for p in positions
            ]
        else:
            self.routers = [
                RandomRouter(num_experts, seed=router_seed, name=f"router_{p}") for p in positions
            ]

    def _block_gates(self, depth):
        return {index: "mone" for index in range(self._first_router, depth)}

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
        self.routing.set_capacity(capacity_lib.method_capacity(self.capacity_method, capacity, self.num_experts))
        self._warn_if_rounded(stacklevel=3)

    def _warn_if_rounded(self, stacklevel):
        """Warns when whole tokens per expert move the realised capacity away from ``capacity``."""
        if not hasattr(self, "patch_embedding"):  # not yet built far enough to count tokens
            return
        capacity, realised = self.capacity, self.realised_capacity
        if abs(realised - capacity) > capacity_lib.REALISED_CAPACITY_TOLERANCE:
            warnings.warn(
                f"`capacity`={capacity} is realised as {realised:.3f} with "
                f"{self.num_tokens} tokens per example (experts take whole tokens); "
                "`realised_capacity` reports it and FLOP counts follow it.",
                stacklevel=stacklevel,
            )

    # The routing plan (``self.routing.plan``, keras_mone.routing.plan) is the one owner of these.
    num_experts = property(lambda self: self.routing.num_experts)
    capacity_method = property(lambda self: self.routing.capacity_method)
    capacity = property(lambda self: self.routing.effective_capacity, doc="The effective capacity e_c in use.")

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
    def token_routing(self):
        """``NestedExperts`` at the current capacity (``keras_mone.routing.parts``)."""
        return NestedExperts(
            self.depth, self.hidden_dim, self.routing, dict(zip(self.router_positions, self.routers)),
            self.expert_widths, gated=self.router_type == "learned",
            class_token_first=self.class_token_to_full_expert and self.use_class_token,
        )


MoNEViViTBackbone = video_form(MoNEViTBackbone)
MoNEViViTBackbone.__doc__ = """MoNE-ViViT-FE (MoNE paper, Sec. 4.4): nested experts in the spatial transformer.

    The spatial transformer is a ``MoNEViTBackbone`` encoder: since frame
    indices are sequences of their own, the router scores every frame
    independently and Expert Preferred Routing assigns tokens *per frame*, so
    every frame meets the capacity distribution exactly
    (``expert_token_counts()`` are per frame index). The temporal transformer
    runs at full capacity. ``set_capacity`` and everything else work as for
    images; arguments are those of ``ViViTBackbone`` and ``MoNEViTBackbone``.
    """
