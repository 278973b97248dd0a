"""MLP-Mixer (Tolstikhin et al. 2021) and Sparse-MLP (Lou et al. 2021) backbones.

Both honour the backbone contract (``keras_mone.models.backbone``): images in,
``(batch, tokens, hidden_dim)`` features out after the final LayerNorm,
``ImageClassifier`` pools them (GAP, as both papers). Neither has a compute
budget: ``capacity`` is 1.0 (Sparse-MLP's expert capacity factor is a layer
setting of ``SparseMoE``, not a budget).
"""

import keras

from keras_mone.layers import arguments
from keras_mone.layers.config import register
from keras_mone.layers.mixer import MixerBlock, SparseMixerBlock
from keras_mone.layers.patch_embedding import PatchEmbedding
from keras_mone.layers.re_represent import ReRepresent1, ReRepresent2
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
        tokens = self.patch_embedding(images)
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
    """Sparse-MLP: ``depth`` Mixer blocks, RR1, ``sparse_depth`` sparse blocks, RR2, LayerNorm.

    Sparse blocks (``SparseMixerBlock``) mix tokens with MoE_S (the ``C'``
    channel columns routed top-``token_top_k`` over ``token_num_experts``
    experts) and channels with MoE_C (the ``S'`` tokens, top-``channel_top_k``;
    ``channel_num_experts=0`` is a dense MLP, Sparse-S). RR1 maps ``(S, C)``
    to ``(S', C')`` before them and RR2 back (Sec. 2.4), no residual. The
    forward record (``return_intermediates=True``) holds ``"aux_loss"``: the
    sum over sparse blocks of the load-balancing loss
    ``aux_loss_weight * (CV^2(importance) + CV^2(load)) / 2`` per MoE layer
    (Eq. 11), and ``"moe"``: each block's ``SparseMoE`` statistics.

    Args (beyond ``MixerBackbone``'s):
        sparse_depth: ``L_2``, the sparse blocks (last, as Table 2).
        sparse_tokens, sparse_hidden_dim: ``S'`` and ``C'``.
        token_num_experts, token_expert_dim, token_top_k: MoE_S.
        channel_num_experts, channel_expert_dim, channel_top_k: MoE_C.
        capacity_factor: each expert takes at most
            ``ceil(capacity_factor * K * items / N_E)`` items per example.
        aux_loss_weight: 0.01 (the paper).
        noise: the gates' training noise ``N(0, 1/N_E^2)`` (inference never has it).
        seed: seed of the gate noise.
    """

    default_name = "sparse_mlp_backbone"

    def __init__(
        self, image_size=224, patch_size=16, hidden_dim=768, depth=10, token_mlp_dim=384,
        channel_mlp_dim=3072, sparse_depth=2, sparse_tokens=392, sparse_hidden_dim=384,
        token_num_experts=8, token_expert_dim=768, channel_num_experts=4, channel_expert_dim=1536,
        token_top_k=1, channel_top_k=2, capacity_factor=1.25, aux_loss_weight=0.01, noise=True, seed=None,
        **kwargs,
    ):
        super().__init__(
            image_size=image_size, patch_size=patch_size, hidden_dim=hidden_dim, depth=depth,
            token_mlp_dim=token_mlp_dim, channel_mlp_dim=channel_mlp_dim, **kwargs,
        )
        self.sparse_depth = arguments.integer("sparse_depth", sparse_depth)
        self.sparse_tokens = arguments.integer("sparse_tokens", sparse_tokens)
        self.sparse_hidden_dim = arguments.integer("sparse_hidden_dim", sparse_hidden_dim)
        self.token_num_experts, self.token_expert_dim = token_num_experts, token_expert_dim
        self.channel_num_experts, self.channel_expert_dim = channel_num_experts, channel_expert_dim
        self.token_top_k, self.channel_top_k = token_top_k, channel_top_k
        self.capacity_factor, self.aux_loss_weight, self.seed = capacity_factor, aux_loss_weight, seed
        self.noise = bool(noise)
        common = dict(
            layer_norm_epsilon=self.layer_norm_epsilon, gelu_approximate=self.gelu_approximate,
            dtype=self.dtype_policy,
        )
        tokens = self.patch_embedding.num_tokens
        self.re_represent_1 = ReRepresent1(
            tokens, hidden_dim, self.sparse_tokens, self.sparse_hidden_dim, name="re_represent_1", **common
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
        self.re_represent_2 = ReRepresent2(
            self.sparse_tokens, self.sparse_hidden_dim, tokens, hidden_dim, name="re_represent_2", **common
        )

    def _build_tail(self, shape):
        self.re_represent_1.build(shape)
        sparse_shape = (None, self.sparse_tokens, self.sparse_hidden_dim)
        for block in self.sparse_blocks:
            block.build(sparse_shape)
        self.re_represent_2.build(sparse_shape)
        super()._build_tail(shape)

    def _tail(self, tokens, training):
        tokens = self.re_represent_1(tokens)
        aux_loss, stats = 0.0, []
        for block in self.sparse_blocks:
            tokens, block_stats = block(tokens, training=training, return_stats=True)
            aux_loss = aux_loss + block_stats["aux_loss"]
            stats.append(block_stats)
        return self.re_represent_2(tokens), {"aux_loss": aux_loss, "moe": stats}
