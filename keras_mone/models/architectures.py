"""The architecture names of the zoo files and recipes: backbone and task class of each."""

from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.matvit_backbone import MatViTBackbone
from keras_mone.models.matvit_classifier import MatViTClassifier, MatViViTClassifier
from keras_mone.models.mone_vit_backbone import MoNEViTBackbone
from keras_mone.models.video_classifier import VideoClassifier
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import MatViViTBackbone, MoNEViViTBackbone, ViViTBackbone

ARCHITECTURES = {
    "vit": ViTBackbone,
    "mone_vit": MoNEViTBackbone,
    "matvit": MatViTBackbone,
    "vivit": ViViTBackbone,
    "mone_vivit": MoNEViViTBackbone,
    "matvivit": MatViViTBackbone,
}
"""Backbone class of each ``architecture`` name."""

TASKS = {
    "vit": ImageClassifier,
    "mone_vit": ImageClassifier,
    "matvit": MatViTClassifier,
    "vivit": VideoClassifier,
    "mone_vivit": VideoClassifier,
    "matvivit": MatViViTClassifier,
}
"""Task (classifier) class of each ``architecture`` name."""
