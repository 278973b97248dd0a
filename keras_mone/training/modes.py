"""Training modes, owned by the methods that register them (MoNE paper Sec. 5).

A ``TrainingMode`` says what a recipe's ``mode`` changes in training: model
arguments (MatViT's ``joint_training``), the task loss (``SumOverWidths``),
the number of epochs (isoFLOPs), callbacks (the adaptive-capacity sampler)
and the method's own loss terms (``keras_mone.models.loss_terms.LossTerm``,
logged by name in ``history.csv``). A method lists its modes in its
registry entry (``keras_mone.methods.registry.Method.modes``); nothing else
keeps a table of mode names.

The standard modes:

- ``FIXED``: one effective capacity e_c (or width) for the whole run.
- ``ADAPTIVE``: e_c drawn per step from ``adaptive_capacities``
  (``AdaptiveCapacity``), evaluated at ``capacity``.
- ``ISOFLOPS``: a MoNE model trained at e_c gets ``dense MACs / MoNE MACs``
  times the dense model's epochs, i.e. the same training compute.
- ``ADAPTIVE_ISOFLOPS``: adaptive, with the epochs scaled so that the expected
  training MACs (the mean over the drawn capacities) equal the dense model's;
  Sec. 5 notes that the paper's adaptively trained model has the training
  FLOPs of the baseline.
- ``JOINT`` (MatViT baseline): the losses of the nested widths D/8 .. D are
  summed every step (``MatViTClassifier`` + ``SumOverWidths``).
"""

import dataclasses
from typing import Callable

from keras_mone.training.adaptive_capacity import AdaptiveCapacity
from keras_mone.training.losses import SumOverWidths


def _no_arguments(recipe):
    return {}


def _same_loss(loss):
    return loss


def _no_callbacks(recipe, model):
    return []


def _same_epochs(recipe, backbone, epochs):
    return epochs


def _no_terms(recipe, model):
    return ()


def _nothing_to_prepare(recipe, model):
    return None


@dataclasses.dataclass(frozen=True)
class TrainingMode:
    """What a recipe's ``mode`` changes in training.

    Attributes:
        name: the recipe's ``mode`` value.
        description: one line for the recipe schema and ``--help``.
        model_arguments: ``recipe -> {constructor argument: value}`` for the
            backbone or task (e.g. ``joint_training=True``).
        wrap_loss: ``task loss -> training loss``.
        callbacks: ``(recipe, model) -> [keras.callbacks.Callback]``.
        epochs: ``(recipe, backbone, recipe epochs) -> epochs to train``.
        loss_terms: ``(recipe, model) -> (LossTerm, ...)``: the method's own loss
            terms, added to the task loss and logged by name (the built model
            gives what they depend on, e.g. ACM's per-module learner costs).
        prepare: ``(recipe, model) -> None``, run on the built model before
            ``compile`` (e.g. freezing what a phase does not train).
    """

    name: str
    description: str = ""
    model_arguments: Callable = _no_arguments
    wrap_loss: Callable = _same_loss
    callbacks: Callable = _no_callbacks
    epochs: Callable = _same_epochs
    loss_terms: Callable = _no_terms
    prepare: Callable = _nothing_to_prepare


def isoflops_epochs(epochs, backbone, capacities=None):
    """Epochs giving ``backbone`` the training MACs of a dense model trained
    ``epochs`` epochs: ``round(epochs * dense / MoNE MACs)``.

    MoNE MACs are those at the backbone's capacity, or, with ``capacities``
    (adaptive training draws one per step, uniformly), their mean over
    ``capacities``; the backbone's capacity is left as it was.
    """
    from keras_mone.analysis import flops
    from keras_mone.models.vivit_backbone import dense_counterpart

    dense = flops(dense_counterpart(backbone)).total
    if capacities is None:
        return max(1, round(epochs * dense / flops(backbone).total))
    current = backbone.capacity
    try:
        per_step = []
        for capacity in capacities:
            backbone.set_capacity(capacity)
            per_step.append(flops(backbone).total)
    finally:
        backbone.set_capacity(current)
    return max(1, round(epochs * dense * len(per_step) / sum(per_step)))


def _capacity_sampler(recipe, model):
    return [AdaptiveCapacity(recipe["adaptive_capacities"], eval_capacity=recipe["capacity"], seed=recipe["seed"])]


FIXED = TrainingMode("fixed", "one capacity (or width) for the whole run")
ADAPTIVE = TrainingMode(
    "adaptive", "e_c drawn per step from adaptive_capacities, evaluated at capacity",
    callbacks=_capacity_sampler,
)
ISOFLOPS = TrainingMode(
    "isoflops", "epochs x dense MACs / MACs at capacity (the dense model's training compute)",
    epochs=lambda recipe, backbone, epochs: isoflops_epochs(epochs, backbone),
)
ADAPTIVE_ISOFLOPS = TrainingMode(
    "adaptive_isoflops", "adaptive, epochs scaled to the dense model's training compute",
    callbacks=_capacity_sampler,
    epochs=lambda recipe, backbone, epochs: isoflops_epochs(epochs, backbone, recipe["adaptive_capacities"]),
)
JOINT = TrainingMode(
    "joint", "MatViT: the losses of the nested widths D/8 .. D summed every step",
    model_arguments=lambda recipe: {"joint_training": True},
    wrap_loss=SumOverWidths,
)

STANDARD_MODES = {mode.name: mode for mode in (FIXED, ADAPTIVE, ISOFLOPS, ADAPTIVE_ISOFLOPS, JOINT)}
"""The modes methods pick from by name (``Method(modes=("fixed", "adaptive"))``)."""


def as_mode(mode):
    """A ``TrainingMode`` from itself or a standard mode's name."""
    if isinstance(mode, TrainingMode):
        return mode
    if mode not in STANDARD_MODES:
        raise ValueError(
            f"Unknown training mode {mode!r}; standard modes: {sorted(STANDARD_MODES)} "
            "(or pass a keras_mone.training.modes.TrainingMode)."
        )
    return STANDARD_MODES[mode]
