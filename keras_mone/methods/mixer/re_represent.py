"""Re-represent layers around Sparse-MLP's sparse blocks (Lou et al. 2021, Sec. 2.4, Algorithm 1).

RR1 maps ``(batch, S, C)`` to ``(batch, S', C')`` (the paper: ``S' = 2S``,
``C' = C / 2``) so MoE_S routes fewer, longer channel columns; RR2 maps back.
No residual around either.
"""

import keras
from keras import ops

from keras_mone import arguments
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.methods.mixer.blocks import check_sequence, layer_norms


class _ReRepresent(ConfigMixin, keras.layers.Layer):
    """Shared body: a token projection and a channel projection, each LN -> Linear -> GELU.

    Args:
        num_tokens, hidden_dim: ``S`` and ``C`` of the input.
        output_tokens, output_dim: ``S_out`` and ``C_out`` of the output.
        layer_norm_epsilon: of both LayerNorms (over channels).
        gelu_approximate: tanh GELU instead of the exact one.
    """

    tokens_first = True

    def __init__(
        self, num_tokens, hidden_dim, output_tokens, output_dim, layer_norm_epsilon=1e-6,
        gelu_approximate=False, **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_tokens = arguments.integer("num_tokens", num_tokens)
        self.hidden_dim = arguments.integer("hidden_dim", hidden_dim)
        self.output_tokens = arguments.integer("output_tokens", output_tokens)
        self.output_dim = arguments.integer("output_dim", output_dim)
        self.layer_norm_epsilon = arguments.number(
            "layer_norm_epsilon", layer_norm_epsilon, 0.0, low_open=True
        )
        self.gelu_approximate = bool(gelu_approximate)
        policy = self.dtype_policy
        self.layer_norm_0, self.layer_norm_1 = layer_norms(self)
        self.token_projection = keras.layers.Dense(
            self.output_tokens, dtype=policy, name="token_projection"
        )
        self.channel_projection = keras.layers.Dense(
            self.output_dim, dtype=policy, name="channel_projection"
        )

    def build(self, input_shape):
        check_sequence(self, input_shape)
        s, c, c_out = self.num_tokens, self.hidden_dim, self.output_dim
        # the second LayerNorm sees the channels after the first projection
        mid_channels = c if self.tokens_first else c_out
        self.layer_norm_0.build((None, None, c))
        self.layer_norm_1.build((None, None, mid_channels))
        self.token_projection.build((None, None, s))
        self.channel_projection.build((None, None, c))

    def _tokens(self, x):
        x = ops.transpose(x, (0, 2, 1))
        x = ops.gelu(self.token_projection(x), approximate=self.gelu_approximate)
        return ops.transpose(x, (0, 2, 1))

    def _channels(self, x):
        return ops.gelu(self.channel_projection(x), approximate=self.gelu_approximate)

    def call(self, inputs):
        x = self.layer_norm_0(inputs)
        if self.tokens_first:
            return self._channels(self.layer_norm_1(self._tokens(x)))
        return self._tokens(self.layer_norm_1(self._channels(x)))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.output_tokens, self.output_dim)


@register
class ReRepresent1(_ReRepresent):
    """RR1: LN -> transpose -> Linear(S -> S') -> GELU -> transpose -> LN -> Linear(C -> C') -> GELU."""


@register
class ReRepresent2(_ReRepresent):
    """RR2: LN -> Linear(C' -> C) -> GELU -> LN -> transpose -> Linear(S' -> S) -> GELU -> transpose.

    Algorithm 1's order: channels first, so ``num_tokens, hidden_dim`` are
    ``S', C'`` and ``output_tokens, output_dim`` are ``S, C``.
    """

    tokens_first = False
