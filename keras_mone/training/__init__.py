"""Training utilities: schedules, optimizers, adaptive capacity, the CPU quickstart."""

from keras_mone.training.adaptive_capacity import DEFAULT_CAPACITIES, AdaptiveCapacity
from keras_mone.training.optimizers import NO_DECAY_NAMES, adamw_kernels_only
from keras_mone.training.schedules import WarmupCosineDecay

__all__ = [
    "DEFAULT_CAPACITIES",
    "NO_DECAY_NAMES",
    "AdaptiveCapacity",
    "WarmupCosineDecay",
    "adamw_kernels_only",
]
