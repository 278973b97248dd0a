"""Named, ready-to-build models: ``from_preset("mone_vit_b16", capacity=0.3)``."""

from keras_mone.presets.registry import (
    ARCHITECTURES,
    from_preset,
    get_preset,
    list_presets,
    shipped_presets,
)

__all__ = ["ARCHITECTURES", "from_preset", "get_preset", "list_presets", "shipped_presets"]
