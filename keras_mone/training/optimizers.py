"""Optimizers of the ViT and ViViT recipes."""

import keras

from keras_mone.training.schedules import WarmupCosineDecay

NO_DECAY_NAMES = ("bias", "gamma", "beta", "position_embedding", "class_token", "alpha")
"""Variable names without weight decay: everything but kernels (AugReg)."""


def adamw_kernels_only(
    peak_learning_rate, total_steps, warmup_steps, weight_decay=0.1, clipnorm=1.0, beta_2=0.999,
    end_learning_rate=0.0,
):
    """AdamW with decoupled weight decay on kernels only, warm-up + cosine, and
    global gradient-norm clipping (the AugReg recipe, Steiner et al. 2021).

    ``weight_decay`` is in AdamW units (multiplied by the learning rate):
    AugReg's 1e-4 at lr 1e-3 is 0.1 here. ``clipnorm=None`` disables clipping.
    """
    optimizer = keras.optimizers.AdamW(
        learning_rate=WarmupCosineDecay(peak_learning_rate, total_steps, warmup_steps, end_learning_rate),
        weight_decay=weight_decay,
        beta_2=beta_2,
        global_clipnorm=clipnorm,
    )
    optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY_NAMES))
    return optimizer


def sgd_kernels_only(
    peak_learning_rate, total_steps, warmup_steps, momentum=0.9, weight_decay=0.0, clipnorm=1.0,
    end_learning_rate=0.0,
):
    """SGD with momentum, warm-up + cosine and global gradient-norm clipping
    (the ViViT Kinetics / SSv2 recipes, Arnab et al. 2021).

    ``weight_decay`` is decoupled (times the learning rate) and kernels only,
    as in ``adamw_kernels_only``; ``clipnorm=None`` disables clipping.
    """
    optimizer = keras.optimizers.SGD(
        learning_rate=WarmupCosineDecay(peak_learning_rate, total_steps, warmup_steps, end_learning_rate),
        momentum=momentum,
        weight_decay=weight_decay or None,
        global_clipnorm=clipnorm,
    )
    if weight_decay:
        optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY_NAMES))
    return optimizer
