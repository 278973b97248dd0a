"""What a recipe trains with: optimizer, loss and callbacks."""

import os

import keras

from keras_mone.methods.registry import mode_of
from keras_mone.training import checkpoint as checkpoint_lib
from keras_mone.training.losses import SigmoidCrossEntropy
from keras_mone.training.optimizers import adamw_kernels_only, sgd_kernels_only
from keras_mone.training.router_monitor import RouterMonitor

ROUTER_PROBE_SIZE = 256  # evaluation images on which RouterMonitor measures router entropy


def make_optimizer(recipe, total_steps, steps_per_epoch):
    """The recipe's optimizer (AdamW or SGD, kernels-only decay, warm-up + cosine
    over ``total_steps``, global norm clip); the warm-up comes from
    ``warmup_steps``, else ``warmup_epochs``, else ``warmup_fraction``."""
    warmup = (
        recipe["warmup_steps"] or round(recipe["warmup_epochs"] * steps_per_epoch)
        or int(recipe["warmup_fraction"] * total_steps)
    )
    warmup = min(warmup, total_steps)
    common = dict(
        weight_decay=recipe["weight_decay"], clipnorm=recipe["grad_clip"] or None,
        end_learning_rate=recipe["end_learning_rate"],
    )
    if recipe["optimizer"] == "sgd":
        return sgd_kernels_only(recipe["learning_rate"], total_steps, warmup, momentum=recipe["momentum"], **common)
    return adamw_kernels_only(recipe["learning_rate"], total_steps, warmup, beta_2=recipe["beta_2"], **common)


def training_mode(recipe):
    """The ``TrainingMode`` the recipe's ``mode`` names, owned by its architecture's method."""
    return mode_of(recipe["architecture"], recipe["mode"])


def make_loss(recipe):
    """The recipe's task loss on one-hot labels: sigmoid or softmax cross-entropy
    (with ``label_smoothing``), as the training mode wraps it (MatViT joint
    training sums it over the widths)."""
    if recipe["loss"] == "sigmoid":
        loss = SigmoidCrossEntropy()
    else:
        loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=recipe["label_smoothing"])
    return training_mode(recipe).wrap_loss(loss)


def checkpoint_dir(recipe):
    return os.path.join(recipe["output_dir"], "checkpoint")


def make_callbacks(recipe, model, eval_data):
    """Router monitor (learned routers), checkpoints, ``history.csv`` and the training mode's own
    callbacks (the adaptive modes' capacity sampler)."""
    callbacks = []
    if getattr(model.backbone, "router_type", None) == "learned" and eval_data is not None:
        # alpha and router entropy per epoch, into history.csv (CSVLogger comes after it)
        probe = keras.ops.convert_to_numpy(next(iter(eval_data))[0])[:ROUTER_PROBE_SIZE]
        callbacks.append(RouterMonitor(probe))
    callbacks += [
        checkpoint_lib.StepCheckpoint(checkpoint_dir(recipe), recipe["checkpoint_steps"]),
        keras.callbacks.CSVLogger(os.path.join(recipe["output_dir"], "history.csv"), append=True),
    ]
    return callbacks + list(training_mode(recipe).callbacks(recipe, model))
