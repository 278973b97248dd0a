"""Named, ready-to-build models: ``from_preset("mone_vit_b16", capacity=0.3)``."""

from keras_mone.presets.evaluation import evaluation_data
from keras_mone.presets.folder import save_to_preset
from keras_mone.presets.registry import (
    ARCHITECTURES,
    from_preset,
    get_preset,
    list_presets,
    shipped_presets,
    weights_tags,
)
from keras_mone.presets.untrained import UntrainedWeightsWarning

__all__ = [
    "ARCHITECTURES", "evaluation_data", "from_preset", "get_preset", "list_presets", "save_to_preset",
    "shipped_presets", "weights_tags",
    "UntrainedWeightsWarning",
]
