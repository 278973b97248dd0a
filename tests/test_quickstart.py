"""The README's main job (`keras-mone quickstart`) end to end, on shrunken recipes."""

import json
import os

import numpy as np
import pytest

from keras_mone import recipes
from keras_mone.cli.main import main
from keras_mone.training.quickstart import (
    DENSE_RECIPE,
    MONE_RECIPE,
    build_and_compile,
    format_results,
    load_test_data,
    resolve_recipe,
    run_quickstart,
)

TINY_OVERRIDES = dict(
    image_size=16, model_args=dict(patch_size=8, hidden_dim=32, depth=1, num_heads=4, mlp_dim=64),
    digit_scale=1, clutter=1, samples_per_digit=1, test_samples_per_digit=1, epochs=1, batch_size=128,
    position_step=8,
)


def test_quickstart_writes_results_and_figures(tmp_path):
    results = run_quickstart(str(tmp_path), TINY_OVERRIDES, eval_capacities=(0.2, 0.5, 1.0), verbose=0)
    for name in ("results.json", "accuracy_vs_gmacs.png", "routing.png"):
        assert os.path.getsize(tmp_path / name) > 0, name
    with open(tmp_path / "results.json") as f:
        saved = json.load(f)
    assert [r["capacity"] for r in saved["mone"]] == [0.2, 0.5, 1.0]
    assert saved["recipes"] == {"dense": DENSE_RECIPE, "mone": MONE_RECIPE} and saved["train_capacity"] == 0.5
    rows = [saved["dense"], *saved["mone"]]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["images_per_second"] > 0 for r in rows)
    for r in saved["mone"]:  # where the digit tokens went: one share per expert
        assert len(r["digit_tokens_by_expert"]) == 4 and abs(sum(r["digit_tokens_by_expert"]) - 1) < 1e-9
    # MACs fall with the capacity; MoNE at 1.0 costs the dense model plus its router.
    gmacs = [r["gmacs"] for r in saved["mone"]]
    assert gmacs == sorted(gmacs) and gmacs[-1] > saved["dense"]["gmacs"] > gmacs[0]
    assert "MoNE-ViT" in format_results(results) and "dense ViT" in format_results(results)


@pytest.mark.parametrize("name", [DENSE_RECIPE, MONE_RECIPE])
def test_quickstart_model_is_the_recipe_model(name, tmp_path):
    """Same architecture, initial weights and optimizer as `keras-mone train NAME`."""
    recipe = resolve_recipe(name, TINY_OVERRIDES)
    stream = recipes.data_sources.digits_stream(recipe)
    mine = build_and_compile(recipe, stream.steps_per_epoch)
    setup = recipes.load(name, resume=False, output_dir=str(tmp_path), **TINY_OVERRIDES)
    assert mine.get_config()["backbone"]["config"] == setup.model.get_config()["backbone"]["config"]
    for a, b in zip(mine.weights, setup.model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()), err_msg=a.path)
    ours, theirs = mine.optimizer.get_config(), setup.optimizer.get_config()
    ours.pop("name"), theirs.pop("name")
    assert ours == theirs  # schedule (and its step count) included
    assert type(mine.loss) is type(setup.loss)
    # Same training batches: the recipe's stream of fresh renderings.
    images, labels = next(setup.train_data)
    np.testing.assert_array_equal(images, stream.batch(0)[0])
    np.testing.assert_array_equal(labels, stream.batch(0)[1])
    (test_images, test_labels), digit_tokens = load_test_data(recipe)
    assert test_images.min() >= -1.0 and test_images.max() <= 1.0 and test_labels.shape == (len(test_images), 10)
    assert digit_tokens.shape == (len(test_images), (16 // 8) ** 2) and digit_tokens.any(axis=1).all()


def test_quickstart_rejects_bad_overrides_before_training(tmp_path, capsys):
    with pytest.raises(recipes.RecipeError, match="epochs"):
        run_quickstart(str(tmp_path / "a"), {"epochs": 0})
    with pytest.raises(recipes.RecipeError, match="mode"):
        run_quickstart(str(tmp_path / "b"), {"mode": "adaptive"})
    with pytest.raises(ValueError, match="eval_capacities"):
        run_quickstart(str(tmp_path / "c"), TINY_OVERRIDES, eval_capacities=(0.5, 1.5))
    assert main(["quickstart", "--output", str(tmp_path / "d"), "nonsense_key=1"]) == 2
    assert "nonsense_key" in capsys.readouterr().err
    assert not any(os.path.exists(tmp_path / d) for d in "abcd")
