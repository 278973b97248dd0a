"""MAC counts of MLP-Mixer and Sparse-MLP (same convention as ``keras_mone.analysis.flops``).

For ``S`` tokens of ``C`` channels, token-MLP width ``D_S`` and channel-MLP
width ``D_C``::

    patch_embedding   G * P*P*ch * C
    token_mixing      2 * C * S * D_S      per Mixer block (C columns of length S)
    channel_mixing    2 * S * C * D_C      per Mixer block

Sparse-MLP adds, around its ``L_2`` sparse blocks on ``(S', C')``:
``re_represent`` = RR1 ``S*S'*C + S'*C*C'`` plus RR2 ``S'*S*C' + S*C'*C``
per Re-represent pair (one per sparse block by default, one for all with
``re_represent="shared"``, none with ``"none"``, when the blocks run on ``(S, C)``);
per sparse block, ``moe_gates`` (MoE_S: ``C' * S' * N_S``, MoE_C: ``S' * C' * N_C``)
and the dispatched expert compute at the configured capacity, the work the
static shapes do: ``N_E * capacity * 2 * F * H`` per MoE layer, ``capacity =
ceil(capacity_factor * K * items / N_E)`` (MoE_S: items = C' columns, F = S',
H = D_S'; MoE_C: items = S' tokens, F = C', H = D_C'; a dense MoE_C is
``2 * S' * C' * D_C'``). Mixer-B/16 counts 12.60 GMACs at 224 with a
1000-class head, L/16 44.55 (the Mixer paper's 12.61 and 44.57 GFLOPs, which
count MACs).
"""

from keras_mone.analysis.flops import FlopCount, patch_embedding_macs, register_flop_counter
from keras_mone.methods.mixer.sparse_moe import expert_capacity
from keras_mone.methods.mixer.backbone import MixerBackbone, SparseMLPBackbone


def _mixer_body(backbone):
    s, c = backbone.num_tokens, backbone.hidden_dim
    return {
        "patch_embedding": patch_embedding_macs(
            backbone.image_size, backbone.patch_size, backbone.num_channels, backbone.hidden_dim
        ),
        "token_mixing": backbone.depth * 2 * c * s * backbone.token_mlp_dim,
        "channel_mixing": backbone.depth * 2 * s * c * backbone.channel_mlp_dim,
    }


@register_flop_counter(MixerBackbone)
def _mixer_flops(backbone):
    label = f"MixerBackbone(C={backbone.hidden_dim}, depth={backbone.depth}, {backbone.num_tokens} tokens)"
    return FlopCount(_mixer_body(backbone), label=label)


def _moe_macs(items, features, num_experts, hidden, top_k, capacity_factor):
    """``(gate MACs, expert MACs)`` of one MoE layer on one example; a dense MLP when ``num_experts`` is 0."""
    if num_experts == 0:
        return 0, 2 * items * features * hidden
    capacity = expert_capacity(items, num_experts, top_k, capacity_factor)
    return items * features * num_experts, num_experts * capacity * 2 * features * hidden


@register_flop_counter(SparseMLPBackbone)
def _sparse_mlp_flops(backbone):
    counts = _mixer_body(backbone)
    s, c = backbone.num_tokens, backbone.hidden_dim
    s2, c2 = backbone.sparse_tokens, backbone.sparse_hidden_dim
    pairs = len(backbone.re_represent_pairs())
    counts["re_represent"] = pairs * ((s * s2 * c + s2 * c * c2) + (s2 * s * c2 + s * c2 * c))
    token_gate, token_experts = _moe_macs(
        c2, s2, backbone.token_num_experts, backbone.token_expert_dim, backbone.token_top_k, backbone.capacity_factor
    )
    channel_gate, channel_experts = _moe_macs(
        s2, c2, backbone.channel_num_experts, backbone.channel_expert_dim, backbone.channel_top_k,
        backbone.capacity_factor,
    )
    counts["moe_gates"] = backbone.sparse_depth * (token_gate + channel_gate)
    counts["token_moe"] = backbone.sparse_depth * token_experts
    counts["channel_moe"] = backbone.sparse_depth * channel_experts
    label = (
        f"SparseMLPBackbone(C={c}, {backbone.depth} dense + {backbone.sparse_depth} sparse blocks, "
        f"S'={s2}, C'={c2}, Re-represent {backbone.re_represent}, capacity factor {backbone.capacity_factor})"
    )
    return FlopCount(counts, label=label)
