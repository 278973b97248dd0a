"""The random-router baseline (MoNE Fig. 7c), added as a method through the registry alone."""

import keras
import numpy as np

from keras_mone import flops, layers, models, presets
from keras_mone.methods.registry import method_of


def test_registry_entry_gives_presets_recipes_and_costs(tmp_path):
    method = method_of("random_mone_vit")
    assert method.name == "random_router" and method_of("random_mone_vivit") is method
    model = presets.from_preset("random_mone_vit_digits", load_weights=False)
    backbone = model.backbone
    assert type(backbone) is models.MoNEViTBackbone and backbone.router_type == "random"
    assert all(isinstance(r, layers.RandomRouter) for r in backbone.routers)
    count = flops(model)
    assert count.breakdown["router"] == 0  # random routers cost nothing
    assert count.total < flops(presets.from_preset("vit_digits", load_weights=False)).total


def test_random_router_recipe_trains_and_round_trips(tmp_path):
    from keras_mone import recipes
    from recipe_helpers import tiny_overrides

    setup = recipes.load("cluttered_digits_random_router", **tiny_overrides(tmp_path / "run", test_samples_per_digit=1))
    assert setup.model.backbone.router_type == "random" and setup.model.backbone.router_seed == setup.recipe["seed"]
    results = setup.fit(verbose=0)
    assert np.isfinite(results["loss"])
    path = tmp_path / "random.keras"
    setup.model.save(path)
    restored = keras.saving.load_model(path, compile=False)
    assert restored.backbone.router_type == "random"
    assert all(isinstance(r, layers.RandomRouter) for r in restored.backbone.routers)
