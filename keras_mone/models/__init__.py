"""Models of keras_mone: backbones (dense and MoNE ViT) and tasks."""

from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.mone_vit_backbone import MoNEViTBackbone
from keras_mone.models.variants import VIT_SIZES, decode_variant
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.weight_transfer import transfer_weights

__all__ = [
    "VIT_SIZES",
    "ImageClassifier",
    "MoNEViTBackbone",
    "ViTBackbone",
    "decode_variant",
    "transfer_weights",
]
