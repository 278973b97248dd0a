"""Models of keras_mone: backbones (dense, MoNE, MatViT, MoD and A-MoD ViTs and ViViTs) and tasks."""

from keras_mone.models.acm_transfer import acm_from_dense
from keras_mone.models.acm_vit_backbone import ACMViTBackbone
from keras_mone.models.backbone import Backbone
from keras_mone.models.dense_pruning import prune_dense_vit
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.loss_terms import LossTerm
from keras_mone.models.matvit_backbone import MatViTBackbone
from keras_mone.models.matvit_classifier import MatViTClassifier, MatViViTClassifier
from keras_mone.models.mod_vit_backbone import AMoDViTBackbone, MoDViTBackbone
from keras_mone.models.mixer_backbone import MIXER_SIZES, SPARSE_MLP_SIZES, MixerBackbone, SparseMLPBackbone
from keras_mone.models.mone_vit_backbone import MoNEViTBackbone
from keras_mone.models.record_call import forward_with_record
from keras_mone.models.sparse_mlp_classifier import SparseMLPClassifier
from keras_mone.models.variants import VIT_SIZES, decode_variant
from keras_mone.models.video_classifier import VideoClassifier
from keras_mone.models.video_init import load_image_weights, vivit_from_image_backbone
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import (
    AMoDViViTBackbone,
    MatViViTBackbone,
    MoDViViTBackbone,
    MoNEViViTBackbone,
    ViViTBackbone,
    video_form,
)
from keras_mone.models.weight_transfer import copy_matching_weights, sparse_mlp_from_mixer, transfer_weights

__all__ = [
    "ACMViTBackbone",
    "Backbone",
    "LossTerm",
    "MIXER_SIZES",
    "MixerBackbone",
    "SPARSE_MLP_SIZES",
    "SparseMLPBackbone",
    "SparseMLPClassifier",
    "VIT_SIZES",
    "AMoDViTBackbone",
    "AMoDViViTBackbone",
    "MoDViTBackbone",
    "MoDViViTBackbone",
    "ImageClassifier",
    "MatViTBackbone",
    "MatViTClassifier",
    "MatViViTBackbone",
    "MatViViTClassifier",
    "MoNEViTBackbone",
    "MoNEViViTBackbone",
    "ViTBackbone",
    "ViViTBackbone",
    "VideoClassifier",
    "acm_from_dense",
    "copy_matching_weights",
    "forward_with_record",
    "decode_variant",
    "load_image_weights",
    "prune_dense_vit",
    "sparse_mlp_from_mixer",
    "transfer_weights",
    "video_form",
    "vivit_from_image_backbone",
]
