"""The transformer block of every ViT in keras_mone, dense or MoNE (Eq. 1)."""

import keras
from keras import ops

from keras_mone.layers.attention import MoNEAttention, as_groups, same_structure
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.layers.mlp import NestedMLP
from keras_mone.layers.nested_dense import pad_features
from keras_mone.layers.regularization import DropPath

# Largest value below 1 in each float type (1 - 1e-6 would round to 1 in 16 bits).
_BELOW_ONE = {"float16": 1.0 - 2.0**-11, "bfloat16": 1.0 - 2.0**-8}


@register
class HalfOpenUnitInterval(keras.constraints.Constraint):
    """Clips a weight into ``[0, 1)`` (MoNE's alpha, Sec. 4.1), in its own dtype."""

    def __call__(self, w):
        upper = _BELOW_ONE.get(keras.backend.standardize_dtype(w.dtype), 1.0 - 2.0**-24)
        return ops.clip(w, 0.0, upper)


@register
class MoNEBlock(ConfigMixin, keras.layers.Layer):
    """Pre-LayerNorm ViT block over token groups of nested widths (Eq. 1).

    For a token ``x`` routed to the expert of width ``d`` with router
    probability ``r``::

        z  = x + Pad(SA_d(LN1(x)))
        x' = z + (alpha * r + 1) * Pad(FFN_d(LN2(z)))

    LayerNorms and residuals act on the full width ``D``; the projections are
    nested (``MoNEAttention``, ``NestedMLP``). ``alpha`` is learnable, kept in
    ``[0, 1)`` and starts at 0 (Sec. 4.1); it exists only when ``routed=True``.

    Call with a tensor ``(batch, tokens, D)`` (dense ViT block), or with a list
    of token groups, their ``widths`` and, for routed blocks, ``gates``: one
    ``(batch, k_j)`` tensor of router probabilities per group (``None`` for a
    group with gate factor 1).

    Args:
        hidden_dim, num_heads, mlp_dim: ViT dimensions.
        routed: create ``alpha`` and apply the router gate of Eq. 1.
        alpha_init: initial ``alpha`` in ``[0, 1)``. The paper's 0 (Sec. 4.1)
            suits fine-tuning a pretrained model; from scratch it leaves the
            router without gradient until alpha moves (``RouterMonitor``).
        dropout_rate: dropout in attention output and MLP.
        drop_path_rate: stochastic depth rate of both residual branches.
        layer_norm_epsilon: LayerNorm epsilon (1e-6 as in ViT).
    """

    def __init__(
        self,
        hidden_dim,
        num_heads,
        mlp_dim,
        routed=False,
        dropout_rate=0.0,
        drop_path_rate=0.0,
        layer_norm_epsilon=1e-6,
        alpha_init=0.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not 0.0 <= alpha_init < 1.0:
            raise ValueError(f"`alpha_init` must lie in [0, 1), got {alpha_init!r}.")
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.routed = routed
        self.alpha_init = alpha_init
        self.dropout_rate = dropout_rate
        self.drop_path_rate = drop_path_rate
        self.layer_norm_epsilon = layer_norm_epsilon
        policy = self.dtype_policy
        self.norm1 = keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=policy, name="norm1"
        )
        self.attention = MoNEAttention(
            hidden_dim, num_heads, dropout_rate=dropout_rate, dtype=policy, name="attention"
        )
        self.norm2 = keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=policy, name="norm2"
        )
        self.mlp = NestedMLP(hidden_dim, mlp_dim, dropout_rate=dropout_rate, dtype=policy, name="mlp")
        self.drop_path = DropPath(drop_path_rate, dtype=policy)

    def build(self, input_shape):
        shape = (None, None, self.hidden_dim)
        for layer in (self.norm1, self.attention, self.norm2, self.mlp):
            layer.build(shape)
        self.alpha = None
        if self.routed:
            self.alpha = self.add_weight(
                name="alpha", shape=(), initializer=keras.initializers.Constant(self.alpha_init),
                constraint=HalfOpenUnitInterval(),
            )

    def call(self, inputs, widths=None, gates=None, training=None, return_received_attention=False):
        """With ``return_received_attention``, returns ``(outputs, received)``:
        the attention each token receives in this block (A-MoD's score)."""
        groups, widths, single = as_groups(inputs, widths, self.hidden_dim)
        if not groups:  # every token dropped (mod_greedy): the block is skipped
            return []
        attended = self.attention(
            [self.norm1(g) for g in groups], widths=widths, training=training,
            return_received_attention=return_received_attention,
        )
        if return_received_attention:
            attended, received = attended
        attended = self.drop_path(attended, training=training)
        mids = [g + a for g, a in zip(groups, attended)]
        updates = []
        for j, (z, width) in enumerate(zip(mids, widths)):
            update = self.mlp(self.norm2(z), width=width, pad_output=False, training=training)
            gate = None if gates is None else gates[j]
            if gate is not None:
                if self.alpha is None:
                    raise ValueError(f"MoNEBlock '{self.name}' got `gates` but was built with routed=False.")
                scale = ops.cast(self.alpha, gate.dtype) * gate + 1.0
                update = update * ops.cast(ops.expand_dims(scale, -1), update.dtype)
            updates.append(pad_features(update, self.hidden_dim))
        updates = self.drop_path(updates, training=training)
        outputs = [z + u for z, u in zip(mids, updates)]
        outputs = outputs[0] if single else outputs
        return (outputs, received) if return_received_attention else outputs

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, inputs, widths=None, gates=None, training=None, return_received_attention=False):
        outputs = same_structure(inputs, self.compute_dtype)
        if not return_received_attention:
            return outputs
        first = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
        return outputs, keras.KerasTensor(tuple(first.shape[:2]), dtype="float32")


def block_stack(
    depth, hidden_dim, num_heads, mlp_dim, routed=(), dropout_rate=0.0, drop_path_rate=0.0,
    layer_norm_epsilon=1e-6, dtype=None, alpha_init=0.0,
):
    """``depth`` blocks named ``block_{i}``, stochastic depth rising linearly from 0
    at the first block to ``drop_path_rate`` at the last (ViT / DeiT schedule);
    blocks whose index is in ``routed`` get MoNE's ``alpha``, starting at ``alpha_init``."""
    return [
        MoNEBlock(
            hidden_dim, num_heads, mlp_dim,
            routed=index in routed,
            alpha_init=alpha_init if index in routed else 0.0,
            dropout_rate=dropout_rate,
            drop_path_rate=drop_path_rate * index / max(depth - 1, 1),
            layer_norm_epsilon=layer_norm_epsilon,
            dtype=dtype,
            name=f"block_{index}",
        )
        for index in range(depth)
    ]
