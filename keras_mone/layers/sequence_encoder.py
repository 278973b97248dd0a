"""A plain transformer over a short token sequence: ViViT's temporal encoder."""

import keras

from keras_mone import arguments
from keras_mone.layers.block import block_stack
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.layers.token_sequence import (
    add_sequence_weights,
    prepend_class_token_and_add_positions,
)


@register
class SequenceEncoder(ConfigMixin, keras.layers.Layer):
    """``(batch, sequence_length, D)`` to ``(batch, sequence_length [+1], D)``.

    Prepends a learned class token (``use_class_token``), adds learned
    position embeddings, then runs ``depth`` dense pre-LN blocks and a final
    LayerNorm. In the ViViT factorised encoder (Model 3) this is the temporal
    transformer over the per-frame-index outputs of the spatial transformer;
    it always runs at full width (MoNE paper, Sec. 4.4).

    Args:
        sequence_length: tokens per input sequence (without the class token).
        hidden_dim, depth, num_heads, mlp_dim: transformer size.
        use_class_token: prepend a class token (its output is the first token).
        dropout_rate, drop_path_rate, layer_norm_epsilon: as in ``ViTBlock``;
            the drop-path rate rises linearly to ``drop_path_rate``.
        gelu_approximate: the tanh GELU in the MLPs (flax's ``nn.gelu``, as
            the spatial blocks of the backbone around it; ``NestedMLP``).
    """

    def __init__(
        self,
        sequence_length,
        hidden_dim,
        depth,
        num_heads,
        mlp_dim,
        use_class_token=True,
        dropout_rate=0.0,
        drop_path_rate=0.0,
        layer_norm_epsilon=1e-6,
        gelu_approximate=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"`depth` must be a positive int, got {depth!r}.")
        self.sequence_length = sequence_length
        self.hidden_dim = hidden_dim
        self.depth = depth
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.use_class_token = use_class_token
        self.dropout_rate = dropout_rate
        self.drop_path_rate = drop_path_rate
        self.layer_norm_epsilon = layer_norm_epsilon
        self.gelu_approximate = arguments.flag("gelu_approximate", gelu_approximate)
        self.blocks = block_stack(
            depth, hidden_dim, num_heads, mlp_dim, dropout_rate=dropout_rate,
            drop_path_rate=drop_path_rate, layer_norm_epsilon=layer_norm_epsilon,
            dtype=self.dtype_policy, gelu_approximate=self.gelu_approximate,
        )
        self.norm = keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="norm"
        )

    @property
    def num_tokens(self):
        return self.sequence_length + int(self.use_class_token)

    def build(self, input_shape):
        add_sequence_weights(self, self.num_tokens, self.hidden_dim, self.use_class_token)
        token_shape = (None, self.num_tokens, self.hidden_dim)
        for block in self.blocks:
            block.build(token_shape)
        self.norm.build(token_shape)

    def call(self, tokens, training=None):
        if tokens.shape[1] is not None and tokens.shape[1] != self.sequence_length:
            raise ValueError(
                f"{self.name} expects sequences of `sequence_length`={self.sequence_length} "
                f"tokens, got shape {tuple(tokens.shape)}."
            )
        tokens = prepend_class_token_and_add_positions(tokens, self.class_token, self.position_embedding)
        for block in self.blocks:
            tokens = block(tokens, training=training)
        return self.norm(tokens)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_tokens, self.hidden_dim)
