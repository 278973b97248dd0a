"""The transformer block of every ViT in keras_mone: attention, MLP and gate as parts."""

import keras
import numpy as np
from keras import ops

from keras_mone.layers.attention import MoNEAttention, as_groups, same_structure
from keras_mone.layers.config import ConfigMixin, register, register_old_name
from keras_mone.layers.gates import get_gate
from keras_mone.layers.grouped_block import kernel_block, kernel_block_applies
from keras_mone.layers.layer_norm import normalize
from keras_mone.layers.mlp import NestedMLP
from keras_mone.layers.nested_dense import after, materialized, pad_features
from keras_mone.layers.packed_block import packable, packed_block, shared_gate_form
from keras_mone.layers.platform_forms import mlp_form, norms_form, residuals_form
from keras_mone.layers.regularization import DropPath
from keras_mone.layers.torch_eager import direct_cast, eager_torch_tensors, eager_without_grad, torch_hooks


@register
class ViTBlock(ConfigMixin, keras.layers.Layer):
    """Pre-LayerNorm ViT block over token groups of nested widths, built from parts.

    The parts are its attention (``MoNEAttention`` unless given), its MLP
    (``NestedMLP`` unless given) and its residual gate (``layers.gates``).
    For a token ``x`` in a group of width ``d`` with gate value ``g``::

        z  = x + Pad(SA_d(LN1(x)))
        x' = z + Pad(FFN_d(LN2(z)))            gate None (dense, MatViT, A-MoD)
        x' = z + (alpha g + 1) Pad(FFN_d(..))  gate "mone" (MoNE Eq. 1)
        x' = x + g (x'_ungated - x)            gate "score" (Mixture-of-Depths)

    LayerNorms and residuals act on the full width ``D``; the projections are
    nested. MoNE's ``alpha`` is learnable, kept in ``[0, 1)`` and starts at
    ``alpha_init`` (0 in the paper, Sec. 4.1).

    Call with a tensor ``(batch, tokens, D)`` (a dense block), or with a list
    of token groups, their ``widths`` and ``gates``: one ``(batch, k_j)``
    tensor of gate values per group (``None`` for an ungated group).

    Args:
        hidden_dim, num_heads, mlp_dim: ViT dimensions.
        gate: ``None``, ``"mone"`` or ``"score"`` (see ``layers.gates``).
        routed: legacy spelling of ``gate="mone"``.
        alpha_init: initial ``alpha`` in ``[0, 1)`` (gate "mone"). The
            paper's 0 suits fine-tuning; from scratch it leaves the router
            without gradient until alpha moves (``RouterMonitor``).
        attention, mlp: optional layers replacing the default parts; they
            take the same call arguments (token groups and widths).
        dropout_rate: dropout in attention output and MLP.
        drop_path_rate: stochastic depth rate of both residual branches.
        layer_norm_epsilon: LayerNorm epsilon (1e-6 as in ViT).
        gelu_approximate: tanh-approximate GELU in the default MLP (``NestedMLP``).
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
        gate=None,
        attention=None,
        mlp=None,
        gelu_approximate=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not 0.0 <= alpha_init < 1.0:
            raise ValueError(f"`alpha_init` must lie in [0, 1), got {alpha_init!r}.")
        if routed and gate not in (None, "mone"):
            raise ValueError(f"`routed=True` means gate 'mone'; got `gate`={gate!r} as well.")
        self.gate = "mone" if routed else gate
        self._gate = get_gate(self.gate)
        self.routed = self.gate == "mone"
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.alpha_init = alpha_init
        self.dropout_rate = dropout_rate
        self.drop_path_rate = drop_path_rate
        self.layer_norm_epsilon = layer_norm_epsilon
        self.gelu_approximate = bool(gelu_approximate)
        policy = self.dtype_policy
        self.norm1 = keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=policy, name="norm1"
        )
        self.attention = _part(attention) or MoNEAttention(
            hidden_dim, num_heads, dropout_rate=dropout_rate, dtype=policy, name="attention"
        )
        self.norm2 = keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=policy, name="norm2"
        )
        self.mlp = _part(mlp) or NestedMLP(
            hidden_dim, mlp_dim, dropout_rate=dropout_rate, gelu_approximate=gelu_approximate, dtype=policy, name="mlp"
        )
        self.drop_path = DropPath(drop_path_rate, dtype=policy)
        self._custom_parts = {"attention": attention is not None, "mlp": mlp is not None}

    def build(self, input_shape):
        shape = (None, None, self.hidden_dim)
        for layer in (self.norm1, self.attention, self.norm2, self.mlp):
            if not layer.built:  # a part given as a layer may come built
                layer.build(shape)
        self.alpha = self._gate.create_variables(self, self.alpha_init)

    def get_config(self):
        config = super().get_config()
        config.pop("routed")
        for part, custom in self._custom_parts.items():
            config[part] = keras.saving.serialize_keras_object(getattr(self, part)) if custom else None
        return config

    def call(self, inputs, widths=None, gates=None, training=None, return_received_attention=False):
        """With ``return_received_attention``, returns ``(outputs, received)``:
        the attention each token receives in this block (A-MoD's score)."""
        groups, widths, single = as_groups(inputs, widths, self.hidden_dim)
        if not groups:  # every token dropped (mod_greedy): the block is skipped
            return []
        if gates is not None and self.gate is None and any(g is not None for g in gates):
            raise ValueError(f"ViTBlock '{self.name}' got `gates` but was built without a gate (gate=None, routed=False).")
        if kernel_block_applies(self, groups, widths, gates, training, return_received_attention):
            outputs = kernel_block(self, groups, widths, gates, training)  # jax: one kernel per nested projection
            return outputs[0] if single else outputs
        if packable(self, groups, gates, training, return_received_attention):
            outputs = packed_block(self, groups, widths, gates, training)  # torch: fewer ops and layer calls
            return outputs[0] if single else outputs
        gates = [None] * len(groups) if gates is None else gates
        attended = self.attention(
            _joined_norms(self.norm1, groups) or [normalize(self.norm1, g) for g in groups], widths=widths,
            training=training,
            return_received_attention=return_received_attention,
        )
        if return_received_attention:
            attended, received = attended
        attended = self.drop_path(attended, training=training)
        mids = [g + a for g, a in zip(groups, attended)]
        if len(mids) > 1 and residuals_form() == "half_block":
            mids = materialized(mids)  # (jax on a GPU only; see residuals_form)
        fused = self._fused_mlp_halves(mids, widths, gates, training)
        updates, last = [], None
        # grouped: each group's LayerNorm right before its MLP, in the program's order (the CPU's HLO)
        joint = _joined_norms(self.norm2, [z for z, done in zip(mids, fused) if done is None])
        for z, width, gate, done in zip(mids, widths, gates, fused):
            if done is not None:
                updates.append(None)
                continue
            normed = normalize(self.norm2, z) if joint is None else joint.pop(0)
            if last is not None:  # one group's MLP after the other: XLA would hold all their slices at once (issue 27)
                normed = after(normed, last)  # (tied after the norm: no copy of the residual z)
            update = self.mlp(normed, width=width, pad_output=False, training=training)
            update = self._gate.scale_mlp(update, gate, self.alpha)
            last = pad_features(update, self.hidden_dim)
            updates.append(last)
        if not any(done is not None for done in fused):
            updates = self.drop_path(updates, training=training)
        outputs = [
            done if done is not None else self._gate.scale_block(x, z + u, gate)
            for x, z, u, gate, done in zip(groups, mids, updates, gates, fused)
        ]
        if len(outputs) > 1 and residuals_form() != "fused":
            # jax on a GPU: each group's residual written once per block; XLA would otherwise
            # keep it as its input plus pending updates, buffers that last blocks (issue 40)
            outputs = materialized(outputs)
        outputs = outputs[0] if single else outputs
        return (outputs, received) if return_received_attention else outputs

    def direct_call(self, groups, widths, gates=None, training=None, gate_forms=None):
        """``self(groups, widths=widths, gates=gates, training=training)`` without Keras'
        ``Layer.__call__``, where the packed torch block runs eagerly; ``None`` elsewhere.

        ``run_blocks`` calls it first: on eager torch ``Layer.__call__`` flattens every
        argument with torch's pytree, builds its call spec and scopes, about 0.4 ms of host
        time per MoNE block call (its groups, widths and gates) against the block's own
        ops (``bench/torch_host_time.py``, BENCHMARKS.md). Exact where it runs: the block
        is built, its inputs are concrete torch tensors in its input dtype (``gates`` cast
        to it, as ``Layer.__call__`` casts floating arguments), ``training`` arrives resolved
        from the encoder's call, and the packed block reads its weights with explicit casts;
        the block's dtype policy is its encoder's, as every keras_mone backbone builds it.
        ``Layer.__call__`` still serves quantized blocks, ``keras.RematScope``, activity
        regularizers, torch module hooks (on the block or its parts, or global ones),
        blocks with ``autocast`` off, and subclasses that override ``call``. ``gate_forms``: a
        dict shared by the blocks that take these same ``gates`` (``TokenGroups.gate_forms``),
        where their cast and token-major rows are kept, made by the first block only (under
        mixed precision 4 casts and a join per block otherwise: 60 ops per MoNE-ViT-B/16 forward);
        not while autograd records the gates, whose gradients each block's own cast sums in float32."""
        groups, widths, single = as_groups(groups, widths, self.hidden_dim)
        if not groups or not self.built or not eager_torch_tensors(groups, self.input_dtype):
            return None
        served_by_layer_call = (  # what ``Layer.__call__`` adds, or casts by its own rules
            self.quantization_mode is not None
            or getattr(self, "_remat_mode", None) is not None
            or self.activity_regularizer is not None
            or torch_hooks(self)
            or not self.autocast
            or not getattr(self, "_convert_input_args", True)
            or type(self).call is not ViTBlock.call  # a subclass's own call
        )
        if served_by_layer_call:
            return None
        if gates is not None:
            if self.gate is None and any(g is not None for g in gates):
                return None  # ``call`` raises
            if not eager_without_grad(*gates):
                gate_forms = None  # each block its own cast: the gates' gradients summed in float32, not bf16
            gates = shared_gate_form(gate_forms, ("cast", self.input_dtype), lambda: [
                None if g is None else direct_cast(g, self.input_dtype) for g in gates], gates)
        if not packable(self, groups, gates, training):
            return None
        outputs = packed_block(self, groups, widths, gates, training, gate_forms)
        return outputs[0] if single else outputs

    def _fused_mlp_halves(self, mids, widths, gates, training):
        """Per group, ``z + (alpha g + 1) Pad(FFN_d(LN2(z)))`` from one Pallas kernel
        (``NestedMLP.fused_residual``; jax with ``$KERAS_MONE_MLP=fused``), or ``None``
        where the generic path runs it: the full-width group, custom parts, the "score"
        gate, active dropout or stochastic depth."""
        none = [None] * len(mids)
        if keras.backend.backend() != "jax" or self.gate not in (None, "mone") or mlp_form() != "fused":
            return none
        if type(self.mlp) is not NestedMLP or (training and (self.mlp.dropout.rate or self.drop_path_rate)):
            return none  # (the MLP's own rate: a block given its MLP may hold one its dropout_rate does not say)
        return [
            self.mlp.fused_residual(z, self.norm2, width, self._gate.mlp_scale(gate, self.alpha))
            for z, width, gate in zip(mids, widths, gates)
        ]

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, inputs, widths=None, gates=None, training=None, return_received_attention=False):
        outputs = same_structure(inputs, self.compute_dtype)
        if not return_received_attention:
            return outputs
        first = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
        return outputs, keras.KerasTensor(tuple(first.shape[:2]), dtype="float32")


# Keras keys the weights of a layer held in a list (a backbone's ``blocks``,
# a functional model's layers) by its class ``__name__`` in snake case, and
# names an unnamed layer after it: "mo_ne_block" in every file saved before
# the rename. The class keeps that ``__name__`` so those files load and no
# weight path or default layer name changes (summaries and Keras' messages
# show "MoNEBlock"); it is registered as "keras_mone>ViTBlock".
ViTBlock.__name__ = "MoNEBlock"
register_old_name(ViTBlock, "MoNEBlock")  # configs of .keras files saved before the rename

MoNEBlock = ViTBlock
"""Deprecated alias of ``ViTBlock``, kept for one release."""


def _joined_norms(norm, groups):
    """With ``$KERAS_MONE_NORMS=joint`` (``platform_forms.norms_form``) and several groups,
    ``[norm(g) for g in groups]`` as one call over the groups joined along the tokens, cut
    again: the same per-token statistics, one LayerNorm in the program instead of one per
    group. ``None`` where the groups are normalised one by one (the caller's loop)."""
    if len(groups) < 2 or norms_form() == "grouped":
        return None
    joint = normalize(norm, ops.concatenate(groups, axis=1))
    ends = [int(end) for end in np.cumsum([g.shape[1] for g in groups])]
    return [joint[:, start:stop] for start, stop in zip([0, *ends[:-1]], ends)]


def _part(layer):
    """A layer given as a part, or its serialized config (``from_config``)."""
    if layer is None or isinstance(layer, keras.layers.Layer):
        return layer
    return keras.saving.deserialize_keras_object(layer)


def block_stack(
    depth, hidden_dim, num_heads, mlp_dim, gates=None, dropout_rate=0.0, drop_path_rate=0.0,
    layer_norm_epsilon=1e-6, dtype=None, alpha_init=0.0, gelu_approximate=False, mlp_factory=None,
    attention_factory=None,
):
    """``depth`` blocks named ``block_{i}``, stochastic depth rising linearly from 0
    at the first block to ``drop_path_rate`` at the last (ViT / DeiT schedule);
    ``gates`` maps block indices to their gate (``layers.gates``; others get
    none); MoNE's ``alpha`` starts at ``alpha_init``; ``gelu_approximate``
    picks the MLP's GELU (see ``NestedMLP``); ``mlp_factory(hidden_dim, mlp_dim,
    dropout_rate, gelu_approximate, dtype)``, if given, makes each block's MLP
    part (ACM's ``ACMMLP``); ``attention_factory(hidden_dim, num_heads,
    dropout_rate, dtype)`` likewise the attention part (ACM's ``ACMAttention``)."""
    gates = gates or {}
    return [
        ViTBlock(
            hidden_dim, num_heads, mlp_dim,
            gate=gates.get(index),
            alpha_init=alpha_init if gates.get(index) == "mone" else 0.0,
            dropout_rate=dropout_rate,
            drop_path_rate=drop_path_rate * index / max(depth - 1, 1),
            layer_norm_epsilon=layer_norm_epsilon,
            gelu_approximate=gelu_approximate,
            mlp=None if mlp_factory is None else mlp_factory(hidden_dim, mlp_dim, dropout_rate, gelu_approximate, dtype),
            attention=None if attention_factory is None else attention_factory(hidden_dim, num_heads, dropout_rate, dtype),
            dtype=dtype,
            name=f"block_{index}",
        )
        for index in range(depth)
    ]
