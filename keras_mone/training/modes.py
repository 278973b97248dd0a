"""MoNE training modes (paper Sec. 5): fixed, adaptive, isoFLOPs, and MatViT joint training.

- fixed: one effective capacity e_c for the whole run.
- adaptive: e_c drawn per step from {0.15, ..., 0.95} (``AdaptiveCapacity``).
- isoflops: a MoNE model trained at e_c gets ``dense MACs / MoNE MACs`` times
  the dense model's epochs, i.e. the same training compute.
- joint (MatViT baseline): the losses of the nested widths D/8 .. D are summed
  every step (``MatViTClassifier`` + ``SumOverWidths``).
"""

from keras_mone.analysis import flop_ratio
from keras_mone.layers.config import config_argument_names
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import ViViTBackbone

MODES = ("fixed", "adaptive", "isoflops", "joint")
ARCHITECTURE_MODES = {
    "vit": ("fixed",),
    "mone_vit": ("fixed", "adaptive", "isoflops"),
    "matvit": ("fixed", "joint"),
    "vivit": ("fixed",),
    "mone_vivit": ("fixed", "adaptive", "isoflops"),
}
"""Modes each backbone architecture supports ("fixed" for MatViT trains one width)."""


def dense_counterpart(backbone):
    """The (unbuilt) dense ``ViTBackbone`` (``ViViTBackbone`` for video) of ``backbone``'s size."""
    dense = ViViTBackbone if isinstance(backbone, ViViTBackbone) else ViTBackbone
    config = backbone.get_config()
    return dense(**{k: config[k] for k in config_argument_names(dense) if k in config})


def isoflops_epochs(epochs, backbone):
    """Epochs giving ``backbone`` (at its capacity) the training MACs of a dense
    model trained ``epochs`` epochs: ``round(epochs * dense / MoNE MACs)``."""
    return max(1, round(epochs * flop_ratio(dense_counterpart(backbone), backbone)))
