"""A method family added from outside the library (issue 41's target): a toy that runs only
every ``token_stride``-th token (``tests/demo_method/half_tokens.py``: a routing part, a
backbone and one registry entry with its own recipe key).

Its one change to what the library lists is the module's name in
``keras_mone.methods.families.FAMILIES``. With that, the registry-driven
harness (shapes, config and ``.keras`` round trips, a training step, mixed
precision, bad input), recipes (its key, its checks, a training run), presets
(a zoo file of its own, preset folders, the model card) and FLOPs all serve it.
"""

import sys

import keras
import numpy as np
import pytest
from conftest import TINY, images, randomize_weights, to_numpy
from harness import run_backbone_test
from recipe_helpers import tiny_overrides

from keras_mone import flops, presets, recipes
from keras_mone.methods import families, registry
from keras_mone.models import ViTBackbone

DEMO = "demo_method.half_tokens"


@pytest.fixture
def demo_family(monkeypatch):
    """The demo family in the one list, loaded as the library loads its own; gone afterwards."""
    monkeypatch.setattr(registry, "METHODS", dict(registry.METHODS))
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (DEMO,))
    monkeypatch.delitem(sys.modules, DEMO, raising=False)
    families.load_families()
    return sys.modules[DEMO]


def test_the_family_is_registered_from_the_one_list(demo_family):
    assert registry.method_of("strided_vit").name == "strided_tokens"
    assert registry.architectures()["strided_vivit"].video
    assert "token_stride" in recipes.KEYS and recipes.KEYS["token_stride"].default == 2
    assert not demo_family.__file__.startswith(registry.__file__.rsplit("keras_mone", 1)[0] + "keras_mone")


@pytest.mark.parametrize("name", ["strided_vit", "strided_vivit"])
def test_the_shared_harness_passes(demo_family, name, tmp_path):
    run_backbone_test(name, tmp_path)


def test_outputs_and_flops_follow_the_routing_part(demo_family):
    model = demo_family.StridedViTBackbone(**TINY, token_stride=3)
    model.build()
    randomize_weights(model, seed=0)
    dense = ViTBackbone(**TINY)
    dense.build()
    dense.set_weights(model.get_weights())
    x = images()
    tokens = to_numpy(dense.patch_embedding(x))
    kept = keras.ops.convert_to_tensor(tokens[:, ::3])
    for block in dense.blocks:
        kept = block(kept)
    expected = tokens.copy()
    expected[:, ::3] = to_numpy(kept)
    np.testing.assert_allclose(to_numpy(model(x)), to_numpy(dense.norm(expected)), rtol=1e-5, atol=1e-5)
    n = tokens.shape[1]
    assert flops(model).breakdown["mlp"] == flops(dense).breakdown["mlp"] * len(range(0, n, 3)) // n


def test_recipes_take_its_key_and_train_it(demo_family, tmp_path):
    setup = recipes.load("cluttered_digits_vit", **tiny_overrides(tmp_path / "run", architecture="strided_vit",
                                                                  token_stride=3))
    assert type(setup.model.backbone) is demo_family.StridedViTBackbone
    assert setup.model.backbone.token_stride == 3
    assert np.isfinite(setup.fit(verbose=0)["loss"])
    with pytest.raises(recipes.RecipeError, match="token_stride.*must be >= 1"):
        recipes.load("cluttered_digits_vit", **tiny_overrides(tmp_path / "a", architecture="strided_vit",
                                                              token_stride=0))
    # Its key belongs to its architectures: a dense recipe that sets it is refused, naming them.
    with pytest.raises(recipes.RecipeError, match="'token_stride' is for architecture 'strided_vit' / 'strided_vivit'"):
        recipes.load("cluttered_digits_vit", **tiny_overrides(tmp_path / "b", token_stride=3))


def test_presets_serve_it(demo_family, tmp_path, monkeypatch):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "strided.toml").write_text(
        '[strided_vit_tiny]\n'
        'description = "A toy: every other token runs the blocks."\n'
        'architecture = "strided_vit"\nvariant = "Ti/16"\nimage_size = 32\npatch_size = 8\n'
        'num_classes = 10\ntoken_stride = 2\n'
    )
    monkeypatch.setenv("KERAS_MONE_ZOO_PATH", str(zoo))
    presets.registry._load_zoo.cache_clear()
    try:
        assert "strided_vit_tiny" in presets.list_presets()
        model = presets.from_preset("strided_vit_tiny", load_weights=False)
        assert type(model.backbone) is demo_family.StridedViTBackbone and model.backbone.token_stride == 2
        randomize_weights(model, seed=1)
        folder = tmp_path / "preset"
        presets.save_to_preset(model, folder)
        loaded = presets.from_preset(str(folder))
        x = images(size=32)
        np.testing.assert_array_equal(to_numpy(loaded(x)), to_numpy(model(x)))
        from keras_mone.cli.preset_card import model_card

        card = model_card("strided_vit_tiny")
        assert "strided_vit Ti/16" in card and "capacity" in card
    finally:
        presets.registry._load_zoo.cache_clear()


def test_without_the_list_entry_nothing_knows_it(tmp_path):
    # The registry outside the fixture: the demo's architecture is unknown everywhere.
    assert "strided_vit" not in registry.architectures()
    with pytest.raises(recipes.RecipeError, match="architecture"):
        recipes.load("cluttered_digits_vit", **tiny_overrides(tmp_path, architecture="strided_vit"))
