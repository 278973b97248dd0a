"""Every registered architecture through the shared harness, and every zoo preset at a tiny size."""

import numpy as np
import pytest
from conftest import TINY, TINY_VIDEO, to_numpy
from harness import run_backbone_test, tiny_inputs

from keras_mone import flops, presets
from keras_mone.methods.registry import architectures
from keras_mone.presets import registry


@pytest.mark.parametrize("name", sorted(architectures()))
def test_architecture_passes_the_harness(name, tmp_path):
    run_backbone_test(name, tmp_path)


def tiny_preset_overrides(spec):
    """The tiny geometry, keeping the preset's method settings (capacity, routers, widths)."""
    entry = architectures()[spec["architecture"]]
    # the ViT family's shared tiny sizes; other families (Mixer, Sparse-MLP) their registry entry's
    tiny = TINY_VIDEO if entry.video else TINY if entry.tiny is None else entry.tiny_config
    overrides = dict(tiny, num_classes=3)
    depth = overrides["depth"]
    for key in ("router_positions", "routed_blocks"):  # the preset's blocks, within the tiny depth
        if key in spec:
            overrides[key] = [p for p in spec[key] if p < depth] or [depth - 1]
    if "layer_width_fractions" in spec:
        overrides["layer_width_fractions"] = list(spec["layer_width_fractions"])[:depth]
    return overrides


@pytest.mark.parametrize("name", presets.list_presets())
def test_every_preset_builds_and_runs_at_a_tiny_size(name):
    spec = presets.get_preset(name)
    model = presets.from_preset(name, load_weights=False, **tiny_preset_overrides(spec))
    architecture = architectures()[spec["architecture"]]
    assert type(model.backbone) is architecture.backbone
    for key, value in architecture.defaults.items():
        assert getattr(model.backbone, key) == value
    for key in set(spec) - set(registry.META_KEYS) - set(tiny_preset_overrides(spec)) - {"variant", "image_size", "patch_size"}:
        value = getattr(model.backbone, key, getattr(model, key, None))
        assert value == spec[key] or list(np.atleast_1d(value)) == list(np.atleast_1d(spec[key])), key
    logits = to_numpy(model(tiny_inputs(architecture)))
    assert logits.shape[-1] == 3 and np.isfinite(logits).all()
    assert flops(model).total > 0
