"""Dense ViT backbone (Dosovitskiy et al. 2021), pre-LayerNorm, big_vision layout."""

import keras

from keras_mone import arguments
from keras_mone.layers.block import block_stack
from keras_mone.layers.config import register
from keras_mone.layers.patch_embedding import PatchEmbedding
from keras_mone.models.backbone import Backbone
from keras_mone.models.block_loop import run_blocks
from keras_mone.routing.parts import TokenRouting


@register
class ViTBackbone(Backbone):
    """Vision Transformer encoder: images to normalised token features.

    ``backbone(images)`` maps ``(batch, H, W, C)`` images to
    ``(batch, tokens, hidden_dim)`` features after the final LayerNorm. The
    class token, when used, is the first token. The weight layout is shared
    with ``MoNEViTBackbone``, so dense weights load into a MoNE model.

    Args:
        image_size: input size, an int or ``(height, width)``, divisible by
            ``patch_size``.
        patch_size: side of the square patches.
        hidden_dim, depth, num_heads, mlp_dim: transformer size (see
            ``keras_mone.models.decode_variant``).
        num_channels: input channels.
        use_class_token: prepend a learned class token (for token pooling).
        dropout_rate: dropout inside attention and MLP.
        drop_path_rate: stochastic depth, rising linearly to this rate at the
            last block.
        layer_norm_epsilon: LayerNorm epsilon.
        gelu_approximate: tanh-approximate GELU in the MLPs, as flax
            checkpoints (AugReg, big_vision) compute it; the default is the
            exact form (timm, keras-hub).
    """

    def __init__(
        self,
        image_size=224,
        patch_size=16,
        hidden_dim=768,
        depth=12,
        num_heads=12,
        mlp_dim=3072,
        num_channels=3,
        use_class_token=False,
        dropout_rate=0.0,
        drop_path_rate=0.0,
        layer_norm_epsilon=1e-6,
        gelu_approximate=False,
        **kwargs,
    ):
        hidden_dim, depth, num_heads, mlp_dim, num_channels = arguments.transformer_size(
            hidden_dim, depth, num_heads, mlp_dim, num_channels
        )
        dropout_rate, drop_path_rate, layer_norm_epsilon = arguments.regularisation(
            dropout_rate, drop_path_rate, layer_norm_epsilon
        )
        kwargs.setdefault("name", self.default_name)
        super().__init__(**kwargs)
        self.patch_embedding = self._make_embedding(
            image_size, patch_size, hidden_dim, num_channels, use_class_token
        )
        self.image_size = list(self.patch_embedding.image_size)
        self.patch_size = patch_size
        self.hidden_dim = hidden_dim
        self.depth = depth
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.num_channels = num_channels
        self.use_class_token = use_class_token
        self.dropout_rate = dropout_rate
        self.drop_path_rate = drop_path_rate
        self.layer_norm_epsilon = layer_norm_epsilon
        self.gelu_approximate = arguments.flag("gelu_approximate", gelu_approximate)
        self.blocks = block_stack(
            depth, hidden_dim, num_heads, mlp_dim,
            gates=self._block_gates(depth),
            dropout_rate=dropout_rate, drop_path_rate=drop_path_rate,
            layer_norm_epsilon=layer_norm_epsilon, dtype=self.dtype_policy,
            gelu_approximate=self.gelu_approximate, **self._block_options(),
        )
        self.norm = keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="norm"
        )

    default_name = "vit_backbone"

    @property
    def num_tokens(self):
        """Tokens per image, class token included."""
        return self.patch_embedding.num_tokens

    @property
    def input_shape_per_example(self):
        return (*self.image_size, self.num_channels)

    def check_inputs(self, inputs):
        """Raises a ``ValueError`` naming the argument if ``inputs`` do not fit the model."""
        self.patch_embedding.check_inputs(inputs)

    def _make_embedding(self, image_size, patch_size, hidden_dim, num_channels, use_class_token):
        """The input embedding (sub-classes for other inputs, e.g. video, override it)."""
        return PatchEmbedding(
            image_size, patch_size, hidden_dim, num_channels=num_channels,
            use_class_token=use_class_token, dtype=self.dtype_policy, name="patch_embedding",
        )

    def _block_gates(self, depth):
        """``{block index: gate}`` (``keras_mone.layers.gates``) of sub-classes whose
        router scores gate a block's update (MoNE, MoD); dense blocks have none."""
        return {}

    def _block_options(self):
        """Extra ``block_stack`` arguments of sub-classes (MoNE: ``alpha_init``)."""
        return {}

    def build(self, input_shape=None):
        self.patch_embedding.build((None, *self.input_shape_per_example))
        token_shape = (None, self.num_tokens, self.hidden_dim)
        for block in self.blocks:
            block.build(token_shape)
        self.norm.build(token_shape)
        self._build_extra(token_shape)
        self.built = True

    def _build_extra(self, token_shape):
        """Hook for sub-classes that add layers (routers)."""

    def call(self, images, training=None, return_intermediates=False):
        tokens = self.patch_embedding(images, training=training)
        tokens, intermediates = self.encode(
            tokens, training=training, return_intermediates=return_intermediates
        )
        tokens = self.output_tokens(tokens, training=training)
        return (tokens, intermediates) if return_intermediates else tokens

    def token_routing(self):
        """The routing part (``keras_mone.routing.parts``) that plans which tokens
        each block runs and at what width, at the current settings. Sub-classes
        that route tokens (MoNE, MoD) or change widths (MatViT) override this
        method only: the encoder loop, the FLOP count and the intermediates
        follow it."""
        return TokenRouting(self.depth, self.hidden_dim)

    def encode(self, tokens, training=None, return_intermediates=False):
        """Runs the blocks (as ``token_routing()`` plans) and the final LayerNorm
        on embedded ``tokens``; returns ``(tokens, intermediates)`` (see
        ``keras_mone.models.block_loop.BlockRecord``)."""
        tokens, intermediates = run_blocks(
            self.blocks, tokens, self.token_routing(), training=training,
            return_intermediates=return_intermediates,
        )
        return self.norm(tokens), intermediates

    def output_tokens(self, encoded, training=None):
        """The backbone's output from the encoder's tokens: the tokens themselves
        for images; sub-classes with a second stage (ViViT's temporal
        transformer) override it."""
        return encoded
