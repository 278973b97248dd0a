"""Bundled, download-free datasets, generated locally from scikit-learn's 8x8 digits."""

from keras_mone.data.cluttered_digits import (
    load_cluttered_digits,
    patch_coverage,
    source_indices,
)
from keras_mone.data.digit_stream import ClutteredDigitsStream, MovingDigitsStream
from keras_mone.data.moving_digits import DIRECTIONS, MOVING_TARGETS, clear_cache, load_moving_digits

__all__ = [
    "ClutteredDigitsStream",
    "DIRECTIONS",
    "MOVING_TARGETS",
    "MovingDigitsStream",
    "clear_cache",
    "load_cluttered_digits",
    "load_moving_digits",
    "patch_coverage",
    "source_indices",
]
