"""`.keras` files saved before the method families moved into their folders still load (issue 41).

``tests/data/legacy_keras/<architecture>.keras``: the harness's tiny classifier
of every architecture whose classes moved (``tests/harness.build_classifier``,
weights randomised with seed 1), saved by keras_mone at commit 76023b9 on
jax, with its outputs on ``harness.tiny_inputs(architecture, seed=4)``. The
configs name the old modules (``keras_mone.models.mone_vit_backbone``); Keras
resolves the registered names (``keras_mone>MoNEViTBackbone``), which did not
change, and the weights sit at the same paths.
"""

import pathlib

import keras
import numpy as np
import pytest
from conftest import assert_f32_close, to_numpy
from harness import tiny_inputs

from keras_mone.methods import architectures

LEGACY = pathlib.Path(__file__).parent / "data" / "legacy_keras"
NAMES = sorted(path.stem for path in LEGACY.glob("*.keras"))


def test_every_moved_family_has_a_legacy_file():
    assert set(NAMES) == {"acm_vit", "amod_vit", "matvit", "matvivit", "mixer", "mod_vit", "mone_vit", "mone_vivit",
                          "sparse_mlp"}


@pytest.mark.parametrize("name", NAMES)
def test_a_file_saved_before_the_move_loads_and_gives_its_outputs(name):
    model = keras.saving.load_model(LEGACY / f"{name}.keras")
    architecture = architectures()[name]
    assert isinstance(model.backbone, architecture.backbone)
    assert architecture.backbone.__module__.startswith("keras_mone.methods.") or architecture.video
    expected = np.load(LEGACY / "outputs.npz")[name]
    # Saved and computed on jax; float32 round-off of a two-block model on
    # another backend is a few ulps of the largest logit (conftest.F32_ULPS).
    assert_f32_close(to_numpy(model(tiny_inputs(architecture, seed=4), training=False)), expected)
