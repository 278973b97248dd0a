"""MLP-Mixer blocks (Tolstikhin et al. 2021) and the Sparse-MLP block (Lou et al. 2021).

Sublayer names follow the vision_transformer Mixer ``.npz`` one to one:
``MixerBlock_i/LayerNorm_0`` -> ``layer_norm_0``, ``token_mixing/Dense_{0,1}``
-> ``token_mixing.dense_{0,1}``, ``LayerNorm_1`` -> ``layer_norm_1``,
``channel_mixing/Dense_{0,1}`` -> ``channel_mixing.dense_{0,1}``.
"""

import keras
from keras import ops

from keras_mone import arguments
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.methods.mixer.sparse_moe import SparseMoE, check_moe_arguments


@register
class MlpBlock(ConfigMixin, keras.layers.Layer):
    """``Dense(mlp_dim) -> GELU -> Dense(features)`` on the last axis (Mixer Eq. 1).

    Args:
        features: input and output width.
        mlp_dim: hidden width.
        gelu_approximate: tanh GELU (flax's ``nn.gelu``, the original Mixer
            weights) instead of the exact one (timm, the paper).
    """

    def __init__(self, features, mlp_dim, gelu_approximate=False, **kwargs):
        super().__init__(**kwargs)
        self.features = arguments.integer("features", features)
        self.mlp_dim = arguments.integer("mlp_dim", mlp_dim)
        self.gelu_approximate = bool(gelu_approximate)
        self.dense_0 = keras.layers.Dense(self.mlp_dim, dtype=self.dtype_policy, name="dense_0")
        self.dense_1 = keras.layers.Dense(self.features, dtype=self.dtype_policy, name="dense_1")

    def build(self, input_shape):
        self.dense_0.build(tuple(input_shape[:-1]) + (self.features,))
        self.dense_1.build(tuple(input_shape[:-1]) + (self.mlp_dim,))

    def call(self, inputs):
        hidden = ops.gelu(self.dense_0(inputs), approximate=self.gelu_approximate)
        return self.dense_1(hidden)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.features,)


def _transpose(x):
    return ops.transpose(x, (0, 2, 1))


def check_sequence(layer, input_shape):
    """Raises if ``input_shape`` is not ``(batch, layer.num_tokens, layer.hidden_dim)``."""
    expected = (layer.num_tokens, layer.hidden_dim)
    if len(input_shape) != 3 or tuple(input_shape[1:]) != expected:
        raise ValueError(
            f"{type(layer).__name__} `{layer.name}` takes inputs (batch, num_tokens={expected[0]}, "
            f"hidden_dim={expected[1]}), got shape {tuple(input_shape)}."
        )


def layer_norms(layer):
    """``layer``'s ``layer_norm_0`` and ``layer_norm_1`` at its ``layer_norm_epsilon`` and dtype policy."""
    return [
        keras.layers.LayerNormalization(
            epsilon=layer.layer_norm_epsilon, dtype=layer.dtype_policy, name=f"layer_norm_{i}"
        )
        for i in (0, 1)
    ]


class _TwoSublayers:
    """Builds a block of ``LN -> token mixing`` and ``LN -> channel mixing`` on ``(batch, S, C)``."""

    def build(self, input_shape):
        check_sequence(self, input_shape)
        self.layer_norm_0.build(input_shape)
        self.token_mixing.build((None, self.hidden_dim, self.num_tokens))
        self.layer_norm_1.build(input_shape)
        self.channel_mixing.build(input_shape)


@register
class MixerBlock(_TwoSublayers, ConfigMixin, keras.layers.Layer):
    """``y1 = x + (MLP_S((LN x)^T))^T; y = y1 + MLP_C(LN y1)`` on ``(batch, S, C)``.

    Args:
        num_tokens: ``S``, the number of tokens (patches).
        hidden_dim: ``C``, the channels per token.
        token_mlp_dim: ``D_S``, hidden width of the token-mixing MLP.
        channel_mlp_dim: ``D_C``, hidden width of the channel-mixing MLP.
        layer_norm_epsilon: 1e-6 as the vision_transformer Mixer.
        gelu_approximate: see ``MlpBlock``.
    """

    def __init__(
        self, num_tokens, hidden_dim, token_mlp_dim, channel_mlp_dim,
        layer_norm_epsilon=1e-6, gelu_approximate=False, **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_tokens = arguments.integer("num_tokens", num_tokens)
        self.hidden_dim = arguments.integer("hidden_dim", hidden_dim)
        self.token_mlp_dim = arguments.integer("token_mlp_dim", token_mlp_dim)
        self.channel_mlp_dim = arguments.integer("channel_mlp_dim", channel_mlp_dim)
        self.layer_norm_epsilon = arguments.number(
            "layer_norm_epsilon", layer_norm_epsilon, 0.0, low_open=True
        )
        self.gelu_approximate = bool(gelu_approximate)
        policy = self.dtype_policy
        self.layer_norm_0, self.layer_norm_1 = layer_norms(self)
        self.token_mixing = MlpBlock(
            self.num_tokens, self.token_mlp_dim, self.gelu_approximate, dtype=policy, name="token_mixing"
        )
        self.channel_mixing = MlpBlock(
            self.hidden_dim, self.channel_mlp_dim, self.gelu_approximate, dtype=policy,
            name="channel_mixing",
        )

    def call(self, inputs):
        mixed = _transpose(self.token_mixing(_transpose(self.layer_norm_0(inputs))))
        outputs = inputs + mixed
        return outputs + self.channel_mixing(self.layer_norm_1(outputs))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)


@register
class SparseMixerBlock(_TwoSublayers, ConfigMixin, keras.layers.Layer):
    """A Sparse-MLP block's two residual sublayers, MoE_S then MoE_C (Sec. 2.3).

    ``y1 = x + (MoE_S((LN x)^T))^T; y = y1 + MoE_C(LN y1)`` on ``(batch, S', C')``:
    MoE_S routes the ``C'`` channel columns (features: the ``S'`` tokens),
    MoE_C routes the ``S'`` tokens (features: the ``C'`` channels). An item
    whose choices all overflow adds zero and passes through the residual.
    The Re-represent layers around it are separate (``re_represent.py``).
    ``*_num_experts=0`` makes that sublayer a dense ``MlpBlock`` of width
    ``*_expert_dim`` (Sparse-S's channel mixing, Table 2).

    ``call(x, return_stats=True)`` returns ``(y, stats)``: ``stats["aux_loss"]``
    is the sum of both sublayers' auxiliary losses, ``stats["token_mixing"]``
    and ``stats["channel_mixing"]`` their ``SparseMoE`` statistics (absent for
    a dense sublayer). No loss is added to the layer: the caller decides.

    Args:
        num_tokens, hidden_dim: ``S'`` and ``C'``.
        token_num_experts, token_expert_dim, token_top_k: MoE_S (Table 2: K=1).
        channel_num_experts, channel_expert_dim, channel_top_k: MoE_C (K=2).
        capacity_factor, noise, aux_loss_weight: as ``SparseMoE``, both sublayers.
        layer_norm_epsilon, gelu_approximate: as ``MixerBlock``.
        seed: seed of the gate noise (MoE_C uses ``seed + 1``).
    """

    def __init__(
        self, num_tokens, hidden_dim, token_num_experts, token_expert_dim, channel_num_experts,
        channel_expert_dim, token_top_k=1, channel_top_k=2, capacity_factor=1.25, noise=True,
        aux_loss_weight=0.01, layer_norm_epsilon=1e-6, gelu_approximate=False, seed=None, **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_tokens = arguments.integer("num_tokens", num_tokens)
        self.hidden_dim = arguments.integer("hidden_dim", hidden_dim)
        self.token_num_experts = arguments.integer("token_num_experts", token_num_experts, low=0)
        self.token_expert_dim = arguments.integer("token_expert_dim", token_expert_dim)
        self.channel_num_experts = arguments.integer("channel_num_experts", channel_num_experts, low=0)
        self.channel_expert_dim = arguments.integer("channel_expert_dim", channel_expert_dim)
        self.token_top_k = token_top_k
        self.channel_top_k = channel_top_k
        self.capacity_factor = arguments.number("capacity_factor", capacity_factor, 0.0, low_open=True)
        self.noise = bool(noise)
        self.aux_loss_weight = arguments.number("aux_loss_weight", aux_loss_weight, 0.0)
        self.layer_norm_epsilon = arguments.number(
            "layer_norm_epsilon", layer_norm_epsilon, 0.0, low_open=True
        )
        self.gelu_approximate = bool(gelu_approximate)
        self.seed = seed
        self.layer_norm_0, self.layer_norm_1 = layer_norms(self)
        self.token_mixing = self._sublayer(
            "token", self.num_tokens, self.token_num_experts, self.token_expert_dim, token_top_k, seed
        )
        self.channel_mixing = self._sublayer(
            "channel", self.hidden_dim, self.channel_num_experts, self.channel_expert_dim,
            channel_top_k, None if seed is None else seed + 1,
        )

    def _sublayer(self, prefix, features, num_experts, expert_dim, top_k, seed):
        name = f"{prefix}_mixing"
        if num_experts == 0:
            return MlpBlock(features, expert_dim, self.gelu_approximate, dtype=self.dtype_policy, name=name)
        check_moe_arguments(
            num_experts, expert_dim, top_k, self.capacity_factor, self.aux_loss_weight,
            names=(f"{prefix}_num_experts", f"{prefix}_expert_dim", f"{prefix}_top_k"),
        )
        layer = SparseMoE(
            num_experts, expert_dim, top_k, capacity_factor=self.capacity_factor, noise=self.noise,
            aux_loss_weight=self.aux_loss_weight, gelu_approximate=self.gelu_approximate, seed=seed,
            dtype=self.dtype_policy, name=name,
        )
        # the items it routes are known now: MoE_S the C' channel columns, MoE_C the S' tokens
        layer.warn_if_starved(self.hidden_dim if prefix == "token" else self.num_tokens, stacklevel=4)
        return layer

    @staticmethod
    def _apply(sublayer, inputs, training):
        if isinstance(sublayer, SparseMoE):
            return sublayer(inputs, training=training, return_stats=True)
        return sublayer(inputs), None

    def call(self, inputs, training=None, return_stats=False):
        mixed, token_stats = self._apply(
            self.token_mixing, _transpose(self.layer_norm_0(inputs)), training
        )
        outputs = inputs + _transpose(mixed)
        mixed, channel_stats = self._apply(self.channel_mixing, self.layer_norm_1(outputs), training)
        outputs = outputs + mixed
        if not return_stats:
            return outputs
        stats = {"aux_loss": ops.zeros((), "float32")}
        for key, value in (("token_mixing", token_stats), ("channel_mixing", channel_stats)):
            if value is not None:
                stats[key] = value
                stats["aux_loss"] = stats["aux_loss"] + value["aux_loss"]
        return outputs, stats

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def compute_output_spec(self, inputs, training=None, return_stats=False):
        outputs = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        if not return_stats:
            return outputs
        stats = {"aux_loss": keras.KerasTensor((), dtype="float32")}
        batch = inputs.shape[0]
        for key, layer in (("token_mixing", self.token_mixing), ("channel_mixing", self.channel_mixing)):
            if isinstance(layer, SparseMoE):
                stats[key] = layer.stats_spec(batch)
        return outputs, stats
