"""MAC counts of ACM-ViT (same convention as ``keras_mone.analysis.flops``).

Attention, patch embedding and head are the dense ViT's. Per block, the gate
costs ``N_tok * (D*16 + 16*16 + 16*(N+1))`` and the MLP what the execution
mode runs: grouped execution runs learner ``n`` (``2 * D * M/N`` MACs per
token) on its static quota ``caps[n-1]`` of tokens (``ACMMLP.caps``), so the
MLP costs ``sum_n caps[n-1] * 2 * D * M / N``; exact execution computes every
learner and masks, so it costs the dense MLP. For ViT-B/16 at beta = 0.5 the
MLP half of a block drops to about half (the paper's ACM on the MLPs only).
"""

from keras_mone.analysis.flops import FlopCount, flops, register_flop_counter
from keras_mone.models.acm_vit_backbone import ACMViTBackbone
from keras_mone.models.vivit_backbone import dense_counterpart


def acm_mlp_macs(backbone):
    """MLP MACs per example of all blocks at the backbone's execution mode and ``beta``."""
    tokens, d, m, n = backbone.num_tokens, backbone.hidden_dim, backbone.mlp_dim, backbone.num_learners
    if backbone.execution == "exact":
        return backbone.depth * 2 * tokens * d * m
    caps = backbone.blocks[0].mlp.caps(tokens)
    return backbone.depth * sum(caps) * 2 * d * (m // n)


@register_flop_counter(ACMViTBackbone)
def _acm_vit_flops(backbone):
    dense = flops(dense_counterpart(backbone))
    counts = dict(dense.breakdown)
    hidden = backbone.acm_gates[0].hidden_units
    counts["mlp"] = acm_mlp_macs(backbone)
    counts["acm_gate"] = backbone.depth * backbone.num_tokens * (
        backbone.hidden_dim * hidden + hidden * hidden + hidden * (backbone.num_learners + 1)
    )
    label = f"ACMViTBackbone({dense.label}, N={backbone.num_learners}, {backbone.execution}, beta={backbone.beta})"
    return FlopCount(counts, label=label)

