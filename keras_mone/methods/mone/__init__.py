"""Mixture of Nested Experts (Jain et al., ``mone.txt``) on ViTs and ViViTs, and its random-router ablation.

The family's folder: ``backbone`` (``MoNEViTBackbone`` and its ViViT-FE
form), ``merging_sweep`` (the token-merging analysis, App. A.2) and
``method`` (the registry entries and recipe keys). Its shared parts (nested
dense, nested attention and MLP, the router, Expert Preferred Routing and the
capacity solver) live in ``keras_mone.layers`` and ``keras_mone.routing``,
since other methods build on them. Also ``keras_mone.models.MoNEViTBackbone``
and ``keras_mone.analysis.token_merging_sweep``.
"""

from keras_mone.exports import export
from keras_mone.methods.mone.backbone import MoNEViTBackbone, MoNEViViTBackbone
from keras_mone.methods.mone.merging_sweep import merged_gmacs, merging_tokens, token_merging_sweep
from keras_mone.methods.mone.method import MONE, RANDOM_ROUTER

for _model in (MoNEViTBackbone, MoNEViViTBackbone):
    export("keras_mone.models")(_model)
for _analysis in (merged_gmacs, merging_tokens, token_merging_sweep):
    export("keras_mone.analysis")(_analysis)

__all__ = [
    "MONE", "MoNEViTBackbone", "MoNEViViTBackbone", "RANDOM_ROUTER", "merged_gmacs", "merging_tokens",
    "token_merging_sweep",
]
