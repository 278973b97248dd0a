"""Training utilities: schedules, optimizers, losses, modes, checkpoints, distribution, quickstart."""

from keras_mone.training.adaptive_capacity import DEFAULT_CAPACITIES, AdaptiveCapacity
from keras_mone.training.losses import FullWidthAccuracy, SigmoidCrossEntropy, SumOverWidths
from keras_mone.training.modes import STANDARD_MODES, TrainingMode, isoflops_epochs
from keras_mone.training.optimizers import NO_DECAY_NAMES, adamw_kernels_only, sgd_kernels_only
from keras_mone.training.schedules import WarmupCosineDecay

__all__ = [
    "DEFAULT_CAPACITIES",
    "STANDARD_MODES",
    "NO_DECAY_NAMES",
    "AdaptiveCapacity",
    "FullWidthAccuracy",
    "SigmoidCrossEntropy",
    "SumOverWidths",
    "TrainingMode",
    "WarmupCosineDecay",
    "adamw_kernels_only",
    "sgd_kernels_only",
    "isoflops_epochs",
]
