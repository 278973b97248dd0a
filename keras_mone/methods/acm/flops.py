"""MAC counts of ACM-ViT (same convention as ``keras_mone.analysis.flops``).

Counted from the per-block plan (``acm_block_plan``): for every ACM module,
the MACs of one learner on one token and the number of tokens each learner
runs on, exactly what the forward pass executes.

* Grouped execution runs learner ``n`` on its static quota ``caps[n-1]`` of
  tokens (``LearnerStack.caps``, from ``beta``); exact execution computes
  every learner on every token and masks.
* An MLP learner costs ``2 D M / N`` (``D -> M/N -> D``); a projection
  learner ``2 D r`` (``D -> r -> D``, ``r`` the paper's
  ``round((D^2 + D) / (N (2D + 1)))``, ``acm_linear.default_rank``).
* Each gate (``D -> 16 -> 16 -> choices``, ``N + 1`` choices for an MLP,
  ``N`` for a projection) costs ``D*16 + 16*16 + 16*choices`` per token.

Patch embedding, the attention itself (``QK^T``, ``AV``) and the head are
the dense ViT's; without ``acm_projections`` the projections are dense too.

ViT-B/16 at 224 (197 tokens) with ACM on the MLPs and projections, N = 4,
r = 96, grouped: ``0.98 + 16.73 beta`` GMACs (tests/methods/acm/test_acm_projections.py
recounts it): 16.73 = the dense MLPs (11.15) and projections (5.58, since
``N * 2 D r = D^2`` for ViT-B), scaled by beta through the quotas (learner 1
of a projection runs on every token; the others share ``(beta N - 1) / (N - 1)``,
so each module runs ``beta N T`` learner-tokens, the quotas' rounding up adding
0.035 at beta 0.5); 0.98 = patch embedding 0.116 + attention 0.715 + five
gates per block on every token, 0.149 (0.85% of the dense model: the paper's
"around 1%" of gating cost) (+ 0.0008 for a 1000-class head).
The issue's "about 0.84 + 16.7 beta" is the same count without the gates.
"""

from keras_mone.analysis.flops import FlopCount, flops, register_flop_counter
from keras_mone.methods.acm.attention import PROJECTIONS
from keras_mone.methods.acm.backbone import ACMViTBackbone
from keras_mone.models.vivit_backbone import dense_counterpart

COMPONENT = {"query": "qkv", "key": "qkv", "value": "qkv", "out": "attention_output", "mlp": "mlp"}


def acm_block_plan(backbone):
    """Per block, ``[(module, learner MACs per token, tokens per learner 1..N, gate choices)]``.

    ``module`` is ``"mlp"`` or a projection (``"query"``, ``"key"``, ``"value"``,
    ``"out"``); tokens per learner are the grouped quotas, or every token in
    exact execution. Built from the configuration only (nothing is built).
    """
    tokens, n = backbone.num_tokens, backbone.num_learners
    plan = []
    for block in backbone.blocks:
        modules = [("mlp", block.mlp, n + 1)]
        if backbone.acm_projections:
            modules += [(name, block.attention.projections[name], n) for name in PROJECTIONS]
        plan.append([
            (name, module.learner_macs, module.caps(tokens) if backbone.execution == "grouped" else (tokens,) * n,
             choices)
            for name, module, choices in modules
        ])
    return plan


def acm_mlp_macs(backbone):
    """MLP MACs per example of all blocks at the backbone's execution mode and ``beta``."""
    return sum(cost * sum(caps) for block in acm_block_plan(backbone) for name, cost, caps, _ in block if name == "mlp")


@register_flop_counter(ACMViTBackbone)
def _acm_vit_flops(backbone):
    dense = flops(dense_counterpart(backbone))
    counts = dict(dense.breakdown)
    hidden = backbone.acm_gates[0].hidden_units
    gate = backbone.hidden_dim * hidden + hidden * hidden
    learners = {"mlp": 0}
    if backbone.acm_projections:
        learners.update(qkv=0, attention_output=0)
    counts["acm_gate"] = 0
    for block in acm_block_plan(backbone):
        for name, cost, caps, choices in block:
            learners[COMPONENT[name]] += cost * sum(caps)
            counts["acm_gate"] += backbone.num_tokens * (gate + hidden * choices)
    counts.update(learners)
    parts = ", MLP + projections" if backbone.acm_projections else ""
    label = f"ACMViTBackbone({dense.label}{parts}, N={backbone.num_learners}, {backbone.execution}, beta={backbone.beta})"
    return FlopCount(counts, label=label)
