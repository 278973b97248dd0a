"""Mixture-of-Depths (Raposo et al.) and A-MoD (Gadhikar et al.) on ViTs and ViViTs: routed blocks
that run only the top ``floor(C N)`` tokens.

The family's folder: ``backbone`` (the image backbones and their ViViT-FE
forms) and ``method`` (the registry entries). The backbones are also
``keras_mone.models.MoDViTBackbone`` and the like.
"""

from keras_mone.exports import export
from keras_mone.methods.mod.backbone import AMoDViTBackbone, AMoDViViTBackbone, MoDViTBackbone, MoDViViTBackbone
from keras_mone.methods.mod.method import AMOD, MOD

for _model in (MoDViTBackbone, AMoDViTBackbone, MoDViViTBackbone, AMoDViViTBackbone):
    export("keras_mone.models")(_model)

__all__ = ["AMOD", "AMoDViTBackbone", "AMoDViViTBackbone", "MOD", "MoDViTBackbone", "MoDViViTBackbone"]
