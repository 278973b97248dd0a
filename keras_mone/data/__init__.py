"""Bundled, download-free datasets, generated locally from scikit-learn's 8x8 digits; ``ImageConverter`` /
``preprocess`` map raw (uint8 or [0, 1]) images to the [-1, 1] the models take."""

from keras_mone.data.cluttered_digits import (
    load_cluttered_digits,
    patch_coverage,
    source_indices,
)
from keras_mone.data.image_converter import ImageConverter, preprocess
from keras_mone.data.digit_stream import ClutteredDigitsStream, MovingDigitsStream
from keras_mone.data.moving_digits import DIRECTIONS, MOVING_TARGETS, clear_cache, load_moving_digits

__all__ = [
    "ClutteredDigitsStream",
    "DIRECTIONS",
    "ImageConverter",
    "MOVING_TARGETS",
    "MovingDigitsStream",
    "clear_cache",
    "load_cluttered_digits",
    "load_moving_digits",
    "patch_coverage",
    "preprocess",
    "source_indices",
]
