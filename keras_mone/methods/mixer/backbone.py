"""MLP-Mixer (Tolstikhin et al. 2021) and Sparse-MLP (Lou et al. 2021) backbones.

Both honour the backbone contract (``keras_mone.models.backbone``): images in,
``(batch, tokens, hidden_dim)`` features out after the final LayerNorm,
``ImageClassifier`` pools them (GAP, as both papers). Neither has a compute
budget: ``capacity`` is 1.0 (Sparse-MLP's expert capacity factor is a layer
setting of ``SparseMoE``, not a budget).
"""

import keras

from keras_mone import arguments
from keras_mone.layers.config import register
from keras_mone.methods.mixer.blocks import MixerBlock, SparseMixerBlock
from keras_mone.layers.patch_embedding import PatchEmbedding
from keras_mone.methods.mixer.re_represent import ReRepresent1, ReRepresent2
from keras_mone.models.backbone import Backbone
from keras_mone.models.variants import size_decoder

#: Mixer sizes (Tolstikhin et al. 2021, Table 1), and the CPU size of the digits tasks.
MIXER_SIZES = {
    "S": dict(hidden_dim=512, depth=8, token_mlp_dim=256, channel_mlp_dim=2048),
    "B": dict(hidden_dim=768, depth=12, token_mlp_dim=384, channel_mlp_dim=3072),
    "L": dict(hidden_dim=1024, depth=24, token_mlp_dim=512, channel_mlp_dim=4096),
    "Digits": dict(hidden_dim=64, depth=4, token_mlp_dim=32, channel_mlp_dim=256),
}

#: Sparse-MLP sizes (Lou et al. 2021, Table 2; S = 196 patches of 16x16 at 224), and the CPU size.
SPARSE_MLP_SIZES = {
    "S": dict(hidden_dim=512, depth=6, token_mlp_dim=256, channel_mlp_dim=2048, sparse_depth=2,
              sparse_tokens=392, sparse_hidden_dim=512, token_num_experts=4, token_expert_dim=512,
              channel_num_experts=0, channel_expert_dim=2048),
    "B": dict(hidden_dim=768, depth=10, token_mlp_dim=384, channel_mlp_dim=3072, sparse_depth=2,
              sparse_tokens=392, sparse_hidden_dim=384, token_num_experts=8, token_expert_dim=768,
              channel_num_experts=4, channel_expert_dim=1536),
    "L": dict(hidden_dim=768, depth=8, token_mlp_dim=384, channel_mlp_dim=3072, sparse_depth=6,
              sparse_tokens=392, sparse_hidden_dim=384, token_num_experts=16, token_expert_dim=768,
              channel_num_experts=4, channel_expert_dim=1536),
    "Digits": dict(hidden_dim=64, depth=3, token_mlp_dim=32, channel_mlp_dim=256, sparse_depth=1,
                   sparse_tokens=128, sparse_hidden_dim=32, token_num_experts=4, token_expert_dim=64,
                   channel_num_experts=4, channel_expert_dim=64),
}


decode_mixer_variant = size_decoder(MIXER_SIZES, "Mixer")
decode_sparse_mlp_variant = size_decoder(SPARSE_MLP_SIZES, "Sparse-MLP")


@register
class MixerBackbone(Backbone):
    """MLP-Mixer: patches (no position embeddings, no class token), Mixer blocks, LayerNorm.

    Args:
        image_size, patch_size, num_channels: input geometry (as ``ViTBackbone``).
        hidden_dim: ``C``, channels per token.
        depth: number of Mixer blocks.
        token_mlp_dim, channel_mlp_dim: ``D_S`` and ``D_C``.
        layer_norm_epsilon: 1e-6 (the vision_transformer Mixer).
        gelu_approximate: tanh GELU, as flax's ``nn.gelu`` in the published checkpoints.
    """

    default_name = "mixer_backbone"

    def __init__(
        self, image_size=224, patch_size=16, hidden_dim=768, depth=12, token_mlp_dim=384,
        channel_mlp_dim=3072, num_channels=3, layer_norm_epsilon=1e-6, gelu_approximate=False, **kwargs,
    ):
        kwargs.setdefault("name", self.default_name)
        super().__init__(**kwargs)
        self.patch_embedding = PatchEmbedding(
            image_size, patch_size, hidden_dim, num_channels=num_channels, use_class_token=False,
            use_position_embedding=False, dtype=self.dtype_policy, name="patch_embedding",
        )
        self.image_size = list(self.patch_embedding.image_size)
        self.patch_size = patch_size
        self.hidden_dim = arguments.integer("hidden_dim", hidden_dim)
        self.depth = arguments.integer("depth", depth)
        self.token_mlp_dim = token_mlp_dim
        self.channel_mlp_dim = channel_mlp_dim
        self.num_channels = num_channels
        self.layer_norm_epsilon = layer_norm_epsilon
        self.gelu_approximate = bool(gelu_approximate)
        self.blocks = [
            MixerBlock(
                self.patch_embedding.num_tokens, hidden_dim, token_mlp_dim, channel_mlp_dim,
                layer_norm_epsilon=layer_norm_epsilon, gelu_approximate=self.gelu_approximate,
                dtype=self.dtype_policy, name=f"block_{i}",
            )
            for i in range(self.depth)
        ]
        self.norm = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="norm")

    @property
    def input_shape_per_example(self):
        return (*self.image_size, self.num_channels)

    @property
    def num_tokens(self):
        return self.patch_embedding.num_tokens

    def check_inputs(self, inputs):
        self.patch_embedding.check_inputs(inputs)

    def build(self, input_shape=None):
        self.patch_embedding.build((None, *self.input_shape_per_example))
        shape = (None, self.patch_embedding.num_tokens, self.hidden_dim)
        for block in self.blocks:
            block.build(shape)
        self._build_tail(shape)
        self.built = True

    def _build_tail(self, shape):
        self.norm.build((None, self.num_tokens, self.hidden_dim))

    def call(self, images, training=None, return_intermediates=False):
        tokens = self.patch_embedding(images, training=training)
        for block in self.blocks:
            tokens = block(tokens)
        tokens, record = self._tail(tokens, training)
        tokens = self.norm(tokens)
        return (tokens, record) if return_intermediates else tokens

    def _tail(self, tokens, training):
        """Blocks after the dense ones (Sparse-MLP); ``(tokens, record)``."""
        return tokens, {}


@register
class SparseMLPBackbone(MixerBackbone):
    """Sparse-MLP: ``depth`` Mixer blocks, then ``sparse_depth`` sparse blocks, LayerNorm.

    Sparse blocks (``SparseMixerBlock``) mix tokens with MoE_S (the ``C'``
    channel columns routed top-``token_top_k`` over ``token_num_experts``
    experts) and channels with MoE_C (the ``S'`` tokens, top-``channel_top_k``;
    ``channel_num_experts=0`` is a dense MLP, Sparse-S). Re-represent layers
    (Sec. 2.4, Algorithm 1, no residual) map ``(S, C)`` to ``(S', C')`` and
    back: ``re_represent="per_block"`` (the paper: "at the beginning and the
    end of each Sparse block"; with Table 2's sizes this gives 22.9 / 70.7 /
    131.2M parameters, 1000-class head, against the table's 22 / 69 / 130M),
    ``"shared"`` (one RR1 before the first sparse block and one RR2 after the
    last; identical to ``per_block`` when ``sparse_depth`` is 1) or ``"none"``
    (Table 7's "w/o r_layers": the sparse blocks run on ``(S, C)``). The
    forward record (``return_intermediates=True``) holds ``"aux_loss"``: the
    sum over sparse blocks of the load-balancing loss
    ``aux_loss_weight * (CV^2(importance) + CV^2(load)) / 2`` per MoE layer
    (Eq. 11), and ``"moe"``: each block's ``SparseMoE`` statistics.

    Args (beyond ``MixerBackbone``'s):
        sparse_depth: ``L_2``, the sparse blocks (last, as Table 2).
        sparse_tokens, sparse_hidden_dim: ``S'`` and ``C'``; ``None`` is the
            paper's ``2S`` and ``C / 2`` (Sec. 2.4), or ``S`` and ``C``
            without Re-represent layers (other values are then an error).
        re_represent: ``"per_block"`` (default), ``"shared"`` or ``"none"``.
        token_num_experts, token_expert_dim, token_top_k: MoE_S.
        channel_num_experts, channel_expert_dim, channel_top_k: MoE_C.
        capacity_factor: each expert takes at most
            ``ceil(capacity_factor * K * items / N_E)`` items per example.
        aux_loss_weight: 0.01 (the paper).
        noise: the gates' training noise ``N(0, 1/N_E^2)`` (inference never has it).
        seed: seed of the gate noise.

    The first sparse block's Re-represent layers are ``re_represent_1`` and
    ``re_represent_2`` (the weight paths of the ``shared`` layout); those of
    the later blocks, with ``per_block``, are ``later_re_represents``
    (RR1, RR2 of block 1, then of block 2, ...).
    """

    default_name = "sparse_mlp_backbone"
    RE_REPRESENT = ("per_block", "shared", "none")

    def __init__(
        self, image_size=224, patch_size=16, hidden_dim=768, depth=10, token_mlp_dim=384,
        channel_mlp_dim=3072, sparse_depth=2, sparse_tokens=None, sparse_hidden_dim=None,
        token_num_experts=8, token_expert_dim=768, channel_num_experts=4, channel_expert_dim=1536,
        token_top_k=1, channel_top_k=2, capacity_factor=1.25, aux_loss_weight=0.01, noise=True, seed=None,
        re_represent="per_block", **kwargs,
    ):
        super().__init__(
            image_size=image_size, patch_size=patch_size, hidden_dim=hidden_dim, depth=depth,
            token_mlp_dim=token_mlp_dim, channel_mlp_dim=channel_mlp_dim, **kwargs,
        )
        if re_represent not in self.RE_REPRESENT:
            raise ValueError(f"re_represent must be one of {self.RE_REPRESENT}, got {re_represent!r}.")
        self.re_represent = re_represent
        tokens = self.patch_embedding.num_tokens
        self.sparse_depth = arguments.integer("sparse_depth", sparse_depth)
        self.sparse_tokens, self.sparse_hidden_dim = self._sparse_shape(
            tokens, hidden_dim, sparse_tokens, sparse_hidden_dim
        )
        self.token_num_experts, self.token_expert_dim = token_num_experts, token_expert_dim
        self.channel_num_experts, self.channel_expert_dim = channel_num_experts, channel_expert_dim
        self.token_top_k, self.channel_top_k = token_top_k, channel_top_k
        self.capacity_factor, self.aux_loss_weight, self.seed = capacity_factor, aux_loss_weight, seed
        self.noise = bool(noise)
        common = dict(
            layer_norm_epsilon=self.layer_norm_epsilon, gelu_approximate=self.gelu_approximate,
            dtype=self.dtype_policy,
        )
        self.sparse_blocks = [
            SparseMixerBlock(
                self.sparse_tokens, self.sparse_hidden_dim, token_num_experts, token_expert_dim,
                channel_num_experts, channel_expert_dim, token_top_k=token_top_k, channel_top_k=channel_top_k,
                capacity_factor=capacity_factor, aux_loss_weight=aux_loss_weight, noise=self.noise,
                seed=None if seed is None else seed + 2 * i, name=f"sparse_block_{i}", **common,
            )
            for i in range(self.sparse_depth)
        ]
        pairs = {"per_block": self.sparse_depth, "shared": 1, "none": 0}[re_represent]
        rr = [
            (
                ReRepresent1(tokens, hidden_dim, self.sparse_tokens, self.sparse_hidden_dim,
                             name=f"re_represent_1{suffix}", **common),
                ReRepresent2(self.sparse_tokens, self.sparse_hidden_dim, tokens, hidden_dim,
                             name=f"re_represent_2{suffix}", **common),
            )
            for suffix in [""] + [f"_block_{i}" for i in range(1, pairs)]
        ][:pairs]
        if rr:
            self.re_represent_1, self.re_represent_2 = rr[0]
        self.later_re_represents = [layer for pair in rr[1:] for layer in pair]

    def _sparse_shape(self, tokens, hidden_dim, sparse_tokens, sparse_hidden_dim):
        """``(S', C')``: given, the paper's ``(2S, C/2)`` by default, ``(S, C)`` without RR layers."""
        if self.re_represent == "none":
            for name, value, size in (("sparse_tokens", sparse_tokens, tokens),
                                      ("sparse_hidden_dim", sparse_hidden_dim, hidden_dim)):
                if value is not None and value != size:
                    raise ValueError(
                        f"{name}={value}: without Re-represent layers (re_represent='none') the sparse "
                        f"blocks run on the Mixer's shape, so {name} must be None or {size}."
                    )
            return tokens, hidden_dim
        s2 = 2 * tokens if sparse_tokens is None else arguments.integer("sparse_tokens", sparse_tokens)
        if sparse_hidden_dim is None:
            if hidden_dim % 2:
                raise ValueError(f"sparse_hidden_dim=None means C / 2, but hidden_dim={hidden_dim} is odd.")
            sparse_hidden_dim = hidden_dim // 2
        return s2, arguments.integer("sparse_hidden_dim", sparse_hidden_dim)

    def re_represent_pairs(self):
        """``[(RR1, RR2), ...]``: one per sparse block (``per_block``), one (``shared``) or none."""
        if self.re_represent == "none":
            return []
        later = self.later_re_represents
        return [(self.re_represent_1, self.re_represent_2)] + list(zip(later[0::2], later[1::2]))

    def _build_tail(self, shape):
        sparse_shape = (None, self.sparse_tokens, self.sparse_hidden_dim)
        for rr1, rr2 in self.re_represent_pairs():
            rr1.build(shape)
            rr2.build(sparse_shape)
        for block in self.sparse_blocks:
            block.build(sparse_shape)
        super()._build_tail(shape)

    def _tail(self, tokens, training):
        pairs = self.re_represent_pairs()
        if self.re_represent == "per_block":
            schedule = [(rr1, block, rr2) for (rr1, rr2), block in zip(pairs, self.sparse_blocks)]
        else:
            schedule = [(None, block, None) for block in self.sparse_blocks]
            if pairs:
                schedule[0] = (pairs[0][0], schedule[0][1], None)
                schedule[-1] = (schedule[-1][0], schedule[-1][1], pairs[0][1])
        aux_loss, stats = 0.0, []
        for rr1, block, rr2 in schedule:
            tokens = rr1(tokens) if rr1 is not None else tokens
            tokens, block_stats = block(tokens, training=training, return_stats=True)
            tokens = rr2(tokens) if rr2 is not None else tokens
            aux_loss = aux_loss + block_stats["aux_loss"]
            stats.append(block_stats)
        return tokens, {"aux_loss": aux_loss, "moe": stats}
