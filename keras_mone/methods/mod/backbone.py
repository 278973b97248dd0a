"""Token-skipping ViTs: Mixture-of-Depths (Raposo et al. 2024) and A-MoD (attention-routed MoD).

In a routed block each image keeps its ``k = floor(C N)`` highest-scoring
tokens; they alone run the block (attention among the selected tokens, then
the MLP), gathered into a static ``(batch, k, D)`` tensor so the savings are
real; the other tokens pass through unchanged. Routed blocks are every other
block by default (1, 3, 5, ...), the block before each one dense.

* MoD: the score is a learned linear router ``r_i = w . x_i``, and the block's
  update of a selected token is multiplied by ``r_i`` (what trains the
  router): ``x_i + r_i (block(X_sel)_i - x_i)``.
* A-MoD: the score is the mean attention token ``i`` received in the previous
  (dense) block, over heads and query rows (post-softmax); no router
  parameters and no multiplier (the A-MoD paper found it hurts). It works on
  a trained dense ViT without any training.

At ``capacity=1.0`` no block skips anything and the router is not used: the
model is the dense ViT it shares its weights with.
"""

import math
import warnings

import keras
from keras_mone import arguments
from keras_mone.layers.config import register
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.routing import capacity as capacity_lib
from keras_mone.routing.parts import TopKSkip
from keras_mone.models.vivit_backbone import video_form

SCORES = ("learned", "attention")


@register
class MoDViTBackbone(ViTBackbone):
    """Mixture-of-Depths ViT: learned top-k routing around every other block.

    Args:
        capacity: ``C``, the share of tokens a routed block processes, in
            (0, 1] (default 0.125, the MoNE paper's MoD setting).
        routed_blocks: block indices that route (default: every other block,
            1, 3, 5, ...); block 0 cannot route for attention scores.
        score: "learned" (MoD) or "attention" (A-MoD, ``AMoDViTBackbone``).
        **kwargs: ``ViTBackbone`` arguments.
    """

    default_name = "mod_vit_backbone"
    routed = True

    def __init__(self, capacity=0.125, routed_blocks=None, score="learned", **kwargs):
        depth = arguments.integer("depth", kwargs.get("depth", 12))
        if score not in SCORES:
            raise ValueError(f"`score` must be one of {SCORES}, got {score!r}.")
        if routed_blocks is None:
            routed_blocks = range(1, depth, 2)
        if isinstance(routed_blocks, (str, bytes)) or not hasattr(routed_blocks, "__iter__"):
            raise ValueError(f"`routed_blocks` must be a list of block indices, got {routed_blocks!r}.")
        first = 1 if score == "attention" else 0
        positions = sorted({arguments.integer("routed_blocks", p, low=first) for p in routed_blocks})
        if positions and positions[-1] >= depth:
            raise ValueError(f"`routed_blocks` must be block indices in [{first}, {depth - 1}], got {list(routed_blocks)}.")
        if score == "attention" and any(b - a == 1 for a, b in zip(positions, positions[1:])):
            raise ValueError(
                f"A-MoD scores a routed block by the attention of the block before it, which "
                f"must run every token: `routed_blocks` cannot hold neighbours, got {positions}."
            )
        self._gated_blocks = tuple(positions) if score == "learned" else ()  # read by _block_gates
        super().__init__(**kwargs)
        self.score = score
        self.routed_blocks = positions
        self.capacity = None
        self.set_capacity(capacity)
        self.routers = []
        if score == "learned":
            self.routers = [
                keras.layers.Dense(1, use_bias=False, kernel_initializer=keras.initializers.RandomNormal(stddev=0.02),
                                   dtype=self.dtype_policy, name=f"router_{p}")
                for p in positions
            ]

    def get_config(self):
        config = super().get_config()
        config["routed_blocks"] = list(self.routed_blocks)
        return config

    def _block_gates(self, depth):
        return {index: "score" for index in self._gated_blocks}

    def _build_extra(self, token_shape):
        for router in self.routers:
            router.build(token_shape)

    # -- capacity -----------------------------------------------------------
    def set_capacity(self, capacity):
        """Runs routed blocks on ``floor(capacity * tokens)`` tokens (at least 1) from now on;
        warns when whole tokens move the capacity (``realised_capacity`` reports it)."""
        self.capacity = capacity_lib.validate_effective_capacity(capacity, None, "capacity")
        clamped = math.floor(self.capacity * self.num_tokens + 1e-9) < 1
        if clamped or abs(self.realised_capacity - self.capacity) > capacity_lib.REALISED_CAPACITY_TOLERANCE:
            warnings.warn(
                f"`capacity`={capacity} is realised as {self.realised_capacity:.3f} with {self.num_tokens} "
                f"tokens per example: routed blocks run {self.selected_tokens()} whole token(s)"
                + (" (the minimum: at least one token runs)" if clamped else "")
                + "; `realised_capacity` reports it and FLOP counts follow it.",
                stacklevel=2,
            )

    def selected_tokens(self):
        """Static ``k``: tokens a routed block processes per image (at least 1)."""
        return max(1, math.floor(self.capacity * self.num_tokens + 1e-9))

    @property
    def realised_capacity(self):
        return self.selected_tokens() / self.num_tokens

    def routing_key(self):
        return ("mod", self.score, self.selected_tokens())

    def block_plan(self):
        """Tokens each block processes per image (the plan of ``token_routing()``)."""
        return [groups[0][0] for groups in self.token_routing().block_plan(self.num_tokens)]

    # -- forward --------------------------------------------------------------
    def token_routing(self):
        """``TopKSkip`` at the current capacity (``keras_mone.routing.parts``)."""
        routers = dict(zip(self.routed_blocks, self.routers)) if self.score == "learned" else None
        return TopKSkip(self.depth, self.hidden_dim, self.selected_tokens(), self.routed_blocks, routers)


@register
class AMoDViTBackbone(MoDViTBackbone):
    """A-MoD ViT: Mixture-of-Depths routed by the attention each token received
    in the previous block; no router parameters, so it converts from a trained
    dense ViT (same weights) and works without training. Arguments as
    ``MoDViTBackbone`` (without ``score``)."""

    default_name = "amod_vit_backbone"

    def __init__(self, capacity=0.125, routed_blocks=None, **kwargs):
        kwargs.pop("score", None)
        super().__init__(capacity=capacity, routed_blocks=routed_blocks, score="attention", **kwargs)

    def get_config(self):
        config = super().get_config()
        config.pop("score", None)
        return config


MoDViViTBackbone = video_form(MoDViTBackbone)
MoDViViTBackbone.__doc__ = """MoD-ViViT-FE: Mixture-of-Depths in the spatial transformer, routed per
    frame index (every frame keeps its ``floor(C N)`` top tokens in a routed
    block); the temporal transformer runs on every frame."""


AMoDViViTBackbone = video_form(AMoDViTBackbone)
AMoDViViTBackbone.__doc__ = """A-MoD-ViViT-FE: attention-routed MoD in the spatial transformer, per frame index."""
