"""Augmentation layers of the input pipelines (tf.data-safe Keras layers): Inception crop, MixUp."""

from keras_mone.data.augment.inception_crop import InceptionCrop
from keras_mone.data.augment.mixup import RolledMixUp

__all__ = ["InceptionCrop", "RolledMixUp"]
