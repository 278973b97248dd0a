"""MoNE training modes (paper Sec. 5): fixed, adaptive, isoFLOPs, and MatViT joint training.

- fixed: one effective capacity e_c for the whole run.
- adaptive: e_c drawn per step from {0.15, ..., 0.95} (``AdaptiveCapacity``).
- isoflops: a MoNE model trained at e_c gets ``dense MACs / MoNE MACs`` times
  the dense model's epochs, i.e. the same training compute.
- adaptive_isoflops: adaptive, with the epochs scaled so that the expected
  training MACs (the mean over the drawn capacities) equal the dense model's;
  Sec. 5 notes that the paper's adaptively trained model has the training
  FLOPs of the baseline.
- joint (MatViT baseline): the losses of the nested widths D/8 .. D are summed
  every step (``MatViTClassifier`` + ``SumOverWidths``).
"""

from keras_mone.analysis import flops
from keras_mone.layers.config import config_argument_names
from keras_mone.models.methods import RegistryView
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import ViViTBackbone

MODES = ("fixed", "adaptive", "isoflops", "adaptive_isoflops", "joint")
ADAPTIVE_MODES = ("adaptive", "adaptive_isoflops")
ISOFLOPS_MODES = ("isoflops", "adaptive_isoflops")
ARCHITECTURE_MODES = RegistryView(lambda method, architecture: method.modes)
"""Modes each architecture supports (a live view of the method registry; "fixed" for MatViT trains one width)."""


def dense_counterpart(backbone):
    """The (unbuilt) dense ``ViTBackbone`` (``ViViTBackbone`` for video) of ``backbone``'s size."""
    dense = ViViTBackbone if isinstance(backbone, ViViTBackbone) else ViTBackbone
    config = backbone.get_config()
    return dense(**{k: config[k] for k in config_argument_names(dense) if k in config})


def isoflops_epochs(epochs, backbone, capacities=None):
    """Epochs giving ``backbone`` the training MACs of a dense model trained
    ``epochs`` epochs: ``round(epochs * dense / MoNE MACs)``.

    MoNE MACs are those at the backbone's capacity, or, with ``capacities``
    (adaptive training draws one per step, uniformly), their mean over
    ``capacities``; the backbone's capacity is left as it was.
    """
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
