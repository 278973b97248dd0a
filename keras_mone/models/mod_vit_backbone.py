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

import keras
from keras import ops

from keras_mone.layers import arguments
from keras_mone.layers.config import register
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.routing import capacity as capacity_lib
from keras_mone.routing.epr import gather_tokens, inverse_permutation, select_top_k

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

    def _build_extra(self, token_shape):
        for router in self.routers:
            router.build(token_shape)

    # -- capacity -----------------------------------------------------------
    def set_capacity(self, capacity):
        """Runs routed blocks on ``floor(capacity * tokens)`` tokens from now on."""
        self.capacity = capacity_lib.validate_effective_capacity(capacity, None, "capacity")

    def selected_tokens(self):
        """Static ``k``: tokens a routed block processes per image (at least 1)."""
        return max(1, math.floor(self.capacity * self.num_tokens + 1e-9))

    @property
    def realised_capacity(self):
        return self.selected_tokens() / self.num_tokens

    def routing_key(self):
        return ("mod", self.score, self.selected_tokens())

    def block_plan(self):
        """Tokens each block processes per image (the FLOP counter reads this plan)."""
        k = self.selected_tokens()
        return [k if i in self.routed_blocks else self.num_tokens for i in range(self.depth)]

    # -- forward --------------------------------------------------------------
    def encode(self, tokens, training=None, return_intermediates=False):
        intermediates = {"scores": [], "selected": []}
        k, routed = self.selected_tokens(), set(self.routed_blocks)
        routers = dict(zip(self.routed_blocks, self.routers))
        skipping = k < self.num_tokens
        received = None
        for index, block in enumerate(self.blocks):
            if skipping and index in routed:
                scores = received if self.score == "attention" else routers[index](tokens)[..., 0]
                tokens, selected = self._skip_block(block, tokens, scores, k, training)
                if return_intermediates:
                    intermediates["scores"].append(ops.cast(scores, "float32"))
                    intermediates["selected"].append(selected)
            elif skipping and self.score == "attention" and index + 1 in routed:
                tokens, received = block(tokens, training=training, return_received_attention=True)
            else:
                tokens = block(tokens, training=training)
        return self.norm(tokens), intermediates

    def _skip_block(self, block, tokens, scores, k, training):
        """Runs ``block`` on the top-``k`` tokens by ``scores``; the others pass unchanged."""
        selected, skipped = select_top_k(scores, k)
        chosen = gather_tokens(tokens, selected)
        update = block(chosen, training=training) - chosen
        if self.score == "learned":
            weight = gather_tokens(ops.expand_dims(ops.cast(scores, update.dtype), -1), selected)
            update = update * weight
        merged = ops.concatenate([chosen + update, gather_tokens(tokens, skipped)], axis=1)
        order = ops.concatenate([selected, skipped], axis=1)
        return gather_tokens(merged, inverse_permutation(order)), selected


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
