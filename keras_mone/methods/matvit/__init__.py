"""MatViT (Kudugunta et al., MatFormer): one ViT (or ViViT-FE) whose blocks run at a nested width D/8..D.

The family's folder: ``backbone`` (image and video), ``classifier`` (the
joint loss over widths) and ``method`` (the registry entry, ``width_fraction``,
the scored widths). Also ``keras_mone.models.MatViTBackbone`` and the like.
"""

from keras_mone.exports import export
from keras_mone.methods.matvit.backbone import MatViTBackbone, MatViViTBackbone
from keras_mone.methods.matvit.classifier import MatViTClassifier, MatViViTClassifier
from keras_mone.methods.matvit.method import MATVIT, SCORED_WIDTHS

for _model in (MatViTBackbone, MatViViTBackbone, MatViTClassifier, MatViViTClassifier):
    export("keras_mone.models")(_model)

__all__ = ["MATVIT", "MatViTBackbone", "MatViTClassifier", "MatViViTBackbone", "MatViViTClassifier", "SCORED_WIDTHS"]
