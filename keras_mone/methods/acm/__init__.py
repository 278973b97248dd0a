"""ACM, adaptive computation modules (Wojcik et al., ``acm.txt``): a dense ViT converted into
blocks whose MLPs (and, optionally, projections) run 0..N learners per token, chosen by a gate.

The family's folder: ``mlp`` / ``linear`` / ``attention`` (the ACM modules),
``gate``, ``quotas`` (the grouped execution's per-count quotas), ``teacher``
(the frozen dense stream), ``backbone``, ``transfer`` (from a dense ViT),
``losses`` and ``phases`` (the three-phase conversion), ``flops`` (its FLOP
counter) and ``method`` (its registry entry, recipe keys and modes). Its
public classes are also ``keras_mone.layers.ACMMLP`` / ``ACMGate`` /
``ACMLinear`` and ``keras_mone.models.ACMViTBackbone`` / ``acm_from_dense``.
"""

from keras_mone.exports import export
from keras_mone.methods.acm import flops, record  # noqa: F401  (register its FLOP counter, routing-map reader)
from keras_mone.methods.acm.backbone import ACMViTBackbone
from keras_mone.methods.acm.gate import ACMGate
from keras_mone.methods.acm.linear import ACMLinear
from keras_mone.methods.acm.method import ACM
from keras_mone.methods.acm.mlp import ACMMLP
from keras_mone.methods.acm.transfer import acm_from_dense

for _layer in (ACMGate, ACMLinear, ACMMLP):
    export("keras_mone.layers")(_layer)
for _model in (ACMViTBackbone, acm_from_dense):
    export("keras_mone.models")(_model)

__all__ = ["ACM", "ACMGate", "ACMLinear", "ACMMLP", "ACMViTBackbone", "acm_from_dense"]
