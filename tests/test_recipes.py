"""Recipes as data: bundled files, validation, overrides, tiny runs of big recipes."""

import importlib.util
import os

import keras
import numpy as np
import pytest

from keras_mone import recipes
from keras_mone.cli.main import main
from recipe_helpers import TINY_MODEL, tiny_overrides

AUGREG = [n for n in recipes.list_recipes() if n.startswith("augreg_")]


def test_bundled_recipes_resolve():
    names = recipes.list_recipes()
    assert len(AUGREG) == 12
    assert {"cluttered_digits_vit", "cluttered_digits_mone", "cluttered_digits_mone_adaptive", "cluttered_digits_matvit"} <= set(names)
    for name in names:
        recipe, _ = recipes.resolve(name)
        assert recipe["description"]


@pytest.mark.parametrize("name", ["augreg_vit_s16_i21k", "augreg_mone_vit_l16_i21k", "augreg_vit_b16_i1k"])
def test_augreg_hyperparameters(name):
    recipe, _ = recipes.resolve(name)
    i21k = name.endswith("i21k")
    assert (recipe["learning_rate"], recipe["warmup_steps"], recipe["batch_size"], recipe["epochs"]) == (1e-3, 10000, 4096, 300)
    assert (recipe["weight_decay"], recipe["grad_clip"], recipe["beta_2"], recipe["loss"]) == (0.1, 1.0, 0.999, "sigmoid")
    assert recipe["head_bias_init"] == (-10.0 if i21k else -6.9)
    assert recipe["tfds_name"] == ("imagenet21k" if i21k else "imagenet2012")
    size = name.split("_")[-2]
    expected = {"s16": "light1", "b16": "light2", "l16": "medium2"}[size] if i21k else "medium2"
    assert recipe["augmentation"] == expected


def test_unknown_key_names_the_key_and_allowed_keys():
    with pytest.raises(recipes.RecipeError, match=r"unknown key 'lr'.*learning_rate"):
        recipes.resolve("cluttered_digits_vit", lr=0.1)


def test_bad_values_name_the_allowed_values():
    with pytest.raises(recipes.RecipeError, match=r"'augmentation' must be one of \['none', 'light1'"):
        recipes.resolve("augreg_vit_s16_i1k", augmentation="heavy")
    with pytest.raises(recipes.RecipeError, match=r"'epochs' must be a int"):
        recipes.resolve("cluttered_digits_vit", epochs="ten")
    with pytest.raises(recipes.RecipeError, match=r"'capacity' must lie in \(0.0, 1.0\]"):
        recipes.resolve("cluttered_digits_mone", capacity=1.5)
    with pytest.raises(recipes.RecipeError, match=r"'mode' must be one of \['fixed'\] for architecture 'vit'"):
        recipes.resolve("cluttered_digits_vit", mode="adaptive")
    with pytest.raises(recipes.RecipeError, match=r"model_args.*\['depht'\].*Allowed"):
        recipes.resolve("cluttered_digits_vit", model_args={"depht": 2})
    with pytest.raises(recipes.RecipeError, match=r"'variant'"):
        recipes.resolve("cluttered_digits_vit", variant="XL/16")
    with pytest.raises(recipes.RecipeError, match="Unknown recipe 'nope'"):
        recipes.resolve("nope")


def test_parse_overrides():
    parsed = recipes.parse_overrides(["epochs=3", "learning_rate=1e-4", "dataset=image_folder", "model_args.depth=2", 'variant="B/16"'])
    assert parsed == {"epochs": 3, "learning_rate": 1e-4, "dataset": "image_folder", "model_args": {"depth": 2}, "variant": "B/16"}


def test_cli_lists_and_rejects_bad_keys(capsys):
    assert main(["train", "--list"]) == 0
    assert "augreg_mone_vit_b16_i21k" in capsys.readouterr().out
    assert main(["train", "cluttered_digits_vit", "batchsize=8"]) == 2
    assert "unknown key 'batchsize'" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("tensorflow_datasets") is not None, reason="tfds installed")
def test_tfds_missing_is_a_clear_error(tmp_path):
    with pytest.raises(ImportError, match="pip install tensorflow-datasets"):
        recipes.load("augreg_vit_s16_i1k", output_dir=str(tmp_path))


def _image_folder(root, sizes=((40, 48), (36, 30), (50, 50))):
    tf = pytest.importorskip("tensorflow")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for label in ("cat", "dog"):
            folder = os.path.join(root, split, label)
            os.makedirs(folder)
            for i, (h, w) in enumerate(sizes):
                image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                tf.io.write_file(os.path.join(folder, f"{i}.png"), tf.io.encode_png(image))


def test_augreg_recipe_runs_on_a_tiny_image_folder(tmp_path):
    data = str(tmp_path / "data")
    _image_folder(data)
    setup = recipes.load(
        "augreg_mone_vit_s16_i1k", dataset="image_folder", data_dir=data, train_split="train",
        eval_split="val", image_size=32, model_args=dict(TINY_MODEL), batch_size=4, epochs=1,
        steps_per_epoch=2, shuffle_buffer=8, output_dir=str(tmp_path / "run"),
    )
    assert setup.recipe["augmentation"] == "medium2"
    assert setup.model.num_classes == 2
    np.testing.assert_allclose(keras.ops.convert_to_numpy(setup.model.head.bias), -6.9, rtol=1e-6)
    images, labels = next(iter(setup.train_data))
    images, labels = images.numpy(), labels.numpy()
    assert images.shape == (4, 32, 32, 3) and -1.0 <= images.min() and images.max() <= 1.0
    np.testing.assert_allclose(labels.sum(axis=1), 1.0, rtol=1e-5)
    assert not np.isin(labels, [0.0, 1.0]).all()  # MixUp (alpha 0.5) mixed the labels
    results = setup.fit(verbose=0)
    assert results["steps"] == 2 and np.isfinite(results["loss"])
    for name in ("recipe.toml", "history.csv", "model.keras", "results.json", "checkpoint"):
        assert os.path.exists(os.path.join(setup.output_dir, name)), name
    again, _ = recipes.resolve(os.path.join(setup.output_dir, "recipe.toml"))
    assert {k: v for k, v in again.items() if k != "output_dir"} == {k: v for k, v in setup.recipe.items() if k != "output_dir"}


def test_a_few_steps_lower_the_loss(tmp_path):
    setup = recipes.load("cluttered_digits_vit", **tiny_overrides(tmp_path, steps_per_epoch=12, learning_rate=3e-3))
    # The recipe's model, optimizer and pipeline, fitted to one batch of its stream.
    batch = next(setup.train_data)
    before = setup.model.evaluate(*batch, verbose=0, return_dict=True)["loss"]
    setup.model.fit((batch for _ in range(12)), steps_per_epoch=12, epochs=1, verbose=0, shuffle=False)
    after = setup.model.evaluate(*batch, verbose=0, return_dict=True)["loss"]
    assert after < before - 0.05, (before, after)


def test_adaptive_recipe_changes_capacity_every_step(tmp_path):
    setup = recipes.load("cluttered_digits_mone_adaptive", **tiny_overrides(tmp_path, steps_per_epoch=6))
    (callback,) = [c for c in setup.callbacks if type(c).__name__ == "AdaptiveCapacity"]
    seen = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(setup.model.capacity))
    setup.model.fit(setup.train_data, steps_per_epoch=6, epochs=1, verbose=0, callbacks=[callback, record], shuffle=False)
    assert seen == callback.history and len(set(seen)) > 1
    assert set(seen) <= set(setup.recipe["adaptive_capacities"])
    assert setup.model.capacity == setup.recipe["capacity"]


def test_matvit_and_isoflops_recipes_build(tmp_path):
    joint = recipes.load("cluttered_digits_matvit", **tiny_overrides(tmp_path / "a", steps_per_epoch=2))
    assert type(joint.loss).__name__ == "SumOverWidths"
    assert np.isfinite(joint.fit(verbose=0, save=False)["loss"])
    iso = recipes.load("cluttered_digits_mone", **tiny_overrides(tmp_path / "b", mode="isoflops", capacity=0.25, epochs=4))
    assert iso.epochs > 4
    adaptive = recipes.load(
        "cluttered_digits_mone_adaptive",
        **tiny_overrides(tmp_path / "c", mode="adaptive_isoflops", adaptive_capacities=[0.25, 0.75], epochs=4),
    )
    assert 4 < adaptive.epochs < iso.epochs  # the mean cost of 0.25 and 0.75 lies between
    assert any(type(c).__name__ == "AdaptiveCapacity" for c in adaptive.callbacks)


def test_digit_stream_arguments_are_recipe_errors(tmp_path):
    with pytest.raises(recipes.RecipeError, match="num_classes"):
        recipes.load("cluttered_digits_vit", output_dir=str(tmp_path), num_classes=3)
    with pytest.raises(recipes.RecipeError, match="position_step"):
        recipes.load("cluttered_digits_vit", output_dir=str(tmp_path), position_step=0)
