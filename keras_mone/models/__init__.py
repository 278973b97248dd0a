"""Models of keras_mone: the dense ViT and ViViT backbones, the shared backbone parts and the tasks.

Also the public namespace of every method family's models: ``MoNEViTBackbone``,
``ACMViTBackbone``, ``MixerBackbone``, ... live in their family's folder
(``keras_mone/methods/<family>/``) and are exported here
(``keras_mone.exports``), so ``keras_mone.models.MoNEViTBackbone`` works.
"""

from keras_mone.exports import exported_names

from keras_mone.models.backbone import Backbone
from keras_mone.models.dense_pruning import prune_dense_vit
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.loss_terms import LossTerm
from keras_mone.models.record_call import forward_with_record
from keras_mone.models.variants import VIT_SIZES, decode_variant
from keras_mone.models.video_classifier import VideoClassifier
from keras_mone.models.video_init import load_image_weights, vivit_from_image_backbone
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import ViViTBackbone, video_form
from keras_mone.models.weight_transfer import copy_matching_weights, transfer_weights

__getattr__, __dir__ = exported_names("keras_mone.models", globals())

__all__ = [
    "Backbone",
    "LossTerm",
    "VIT_SIZES",
    "ImageClassifier",
    "ViTBackbone",
    "ViViTBackbone",
    "VideoClassifier",
    "copy_matching_weights",
    "forward_with_record",
    "decode_variant",
    "load_image_weights",
    "prune_dense_vit",
    "transfer_weights",
    "video_form",
    "vivit_from_image_backbone",
]
