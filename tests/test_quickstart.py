"""The README's main job (`keras-mone quickstart`) end to end, on shrunken recipes."""

import json
import os

import numpy as np
import pytest

from keras_mone import recipes
from keras_mone.cli.main import main
from keras_mone.cli.quickstart import (
    DENSE_RECIPE,
    MONE_RECIPE,
    format_phases,
    format_results,
    load_test_data,
    resolve_recipe,
    run_quickstart,
    time_left,
    top1_accuracy,
    training_schedule,
)

TINY_OVERRIDES = dict(
    image_size=16, model_args=dict(patch_size=8, hidden_dim=32, depth=1, num_heads=4, mlp_dim=64),
    digit_scale=1, clutter=1, samples_per_digit=1, test_samples_per_digit=1, epochs=1, batch_size=128,
    position_step=8,
)


PHASES = ["test_data", "dense_training", "dense_evaluation", "mone_training", "mone_evaluation", "plots"]


def test_quickstart_writes_results_and_figures(tmp_path, capsys):
    results = run_quickstart(str(tmp_path), TINY_OVERRIDES, eval_capacities=(0.2, 0.5, 1.0), verbose=0)
    printed = capsys.readouterr().out
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
    # Where the time went: every phase timed once, together within the total.
    phases = saved["phase_seconds"]
    assert list(phases) == PHASES
    assert all(seconds > 0 for seconds in phases.values()) and sum(phases.values()) <= saved["seconds"]
    assert format_phases(results).startswith("Time: test data ") and f"total {saved['seconds']:.1f} s" in format_phases(results)
    # What trained, from the recipe: 1438 digits x 1 rendering // 128 = 11 steps of 128 images.
    assert saved["train_images"] == 11 * 128
    assert "1 epochs of 11 steps x 128 = 1,408 fresh images" in printed
    # A progress line after each phase: time elapsed, and about how long the rest takes.
    progress = [line for line in printed.splitlines() if line.startswith("Progress: ")]
    assert [line.split(" done, ")[0][len("Progress: "):] for line in progress] == [p.replace("_", " ") for p in PHASES]
    assert all(" s elapsed; about " in line and " s left (" in line for line in progress[:-1])
    assert progress[0].endswith("(at a quiet 2-core machine's speed)")  # nothing measured yet
    assert all("x a quiet 2-core machine's time so far)" in line for line in progress[1:-1])
    assert progress[-1].endswith(" s elapsed")
    elapsed = [int(line.split(" done, ")[1].split(" s elapsed")[0]) for line in progress]
    assert elapsed == sorted(elapsed) and elapsed[-1] <= saved["seconds"] + 1


def test_quickstart_trains_through_the_recipe_loop(tmp_path):
    """The quickstart's models are `keras-mone train NAME` runs: one run directory per
    recipe (recipe.toml, history.csv, checkpoints, model.keras), and a second call
    resumes them (nothing retrains) and reports the same figures."""
    first = run_quickstart(str(tmp_path), TINY_OVERRIDES, eval_capacities=(0.5,), verbose=0)
    for sub, name in (("dense", DENSE_RECIPE), ("mone", MONE_RECIPE)):
        recipe = resolve_recipe(name, {**TINY_OVERRIDES, "output_dir": str(tmp_path / sub)})
        saved, _ = recipes.resolve(str(tmp_path / sub / "recipe.toml"))
        assert {k: v for k, v in saved.items() if k != "description"} == {k: v for k, v in recipe.items() if k != "description"}
        assert os.path.getsize(tmp_path / sub / "model.keras") > 0
    assert len(first["dense_history"]["loss"]) == TINY_OVERRIDES["epochs"]
    assert "val_accuracy" in first["dense_history"] and "alpha_0" in first["mone_history"]
    again = run_quickstart(str(tmp_path), TINY_OVERRIDES, eval_capacities=(0.5,), verbose=0)
    assert again["dense"]["accuracy"] == first["dense"]["accuracy"]
    assert again["mone"][0]["accuracy"] == first["mone"][0]["accuracy"]


def test_time_left_scales_the_reference_by_the_measured_slowdown():
    left = {"mone_training": 90.0, "plots": 2.0}
    assert time_left({}, left) == (92.0, None)
    assert time_left({"test_data": (0.3, 0.1)}, left) == (92.0, None)  # too short to measure a speed
    seconds, slowdown = time_left({"test_data": (0.3, 0.1), "dense_training": (270.0, 90.0)}, left)
    assert slowdown == pytest.approx(3.0) and seconds == pytest.approx(276.0)
    # a resumed run that trained nothing (reference 0 s) does not count
    assert time_left({"dense_training": (5.0, 0.0), "dense_evaluation": (4.0, 2.0)}, left) == (184.0, 2.0)


def test_documented_training_images_are_the_recipes():
    """README and docs/training.md give the images a quickstart epoch trains, as the recipes count them."""
    epochs, steps, batch = training_schedule(resolve_recipe(DENSE_RECIPE, {}))
    assert (epochs, steps, batch) == (4, 179, 128)
    assert training_schedule(resolve_recipe(MONE_RECIPE, {})) == (epochs, steps, batch)
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    for doc in ("README.md", os.path.join("docs", "training.md")):
        with open(os.path.join(root, doc)) as f:
            text = " ".join(f.read().split())
        assert f"{steps * batch:,}" in text and "23,008" not in text, doc
    assert training_schedule(resolve_recipe(DENSE_RECIPE, {"steps_per_epoch": 5})) == (epochs, 5, batch)


def test_results_are_written_before_the_plots(tmp_path, monkeypatch):
    """A failing plot loses no result: results.json holds every evaluation."""
    from keras_mone.cli import quickstart_plots

    def broken_plot(*args, **kwargs):
        raise RuntimeError("plot failed")

    monkeypatch.setattr(quickstart_plots, "plot_accuracy_vs_gmacs", broken_plot)
    with pytest.raises(RuntimeError, match="plot failed"):
        run_quickstart(str(tmp_path), TINY_OVERRIDES, eval_capacities=(0.5, 1.0), verbose=0)
    with open(tmp_path / "results.json") as f:
        saved = json.load(f)
    assert [r["capacity"] for r in saved["mone"]] == [0.5, 1.0] and "plots" not in saved["phase_seconds"]


def test_in_memory_test_split_is_the_pipeline_split():
    """The recipe's eval data (in memory, no tf.data) holds the quickstart's test split."""
    recipe = resolve_recipe(DENSE_RECIPE, TINY_OVERRIDES)
    batches = recipes.data_sources.in_memory_eval_data(recipe, 10)
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches])
    (test_images, test_labels), digit_tokens = load_test_data(recipe)
    np.testing.assert_allclose(images, test_images, atol=1e-6)
    np.testing.assert_array_equal(labels, test_labels)
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


NO_TENSORFLOW = """
import json, sys
sys.modules["tensorflow"] = sys.modules["tensorflow_datasets"] = None  # import fails, find_spec is None
from keras_mone import recipes
setup = recipes.load("cluttered_digits_mone", resume=False, **json.loads(sys.argv[1]))
print("RESULT", json.dumps(setup.fit(verbose=0)))
"""


@pytest.mark.skipif(os.environ.get("KERAS_BACKEND", "jax") == "tensorflow", reason="the point is a machine without tensorflow")
def test_digits_recipes_train_and_evaluate_without_tensorflow(tmp_path):
    """As after `pip install -e ".[jax]"`: the one training loop runs the digits recipes with no tf.data."""
    import subprocess
    import sys

    overrides = json.dumps({**TINY_OVERRIDES, "output_dir": str(tmp_path / "run")})
    result = subprocess.run([sys.executable, "-c", NO_TENSORFLOW, overrides], capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, result.stderr[-3000:]
    assert 0.0 <= json.loads(lines[-1][len("RESULT "):])["accuracy"] <= 1.0


@pytest.mark.parametrize("batch_size", [4, 7, 64])  # whole batches, a padded last one, one short batch
def test_top1_accuracy_is_keras_accuracy_over_the_real_examples(batch_size):
    from conftest import images
    from harness import build_classifier

    model = build_classifier("mone_vit")
    x = images(batch=10, seed=4)
    predicted = np.argmax(np.asarray(model.predict(x, verbose=0)), axis=-1)
    labels = np.eye(3, dtype="float32")[[0, 1, 2, 0, 1, 2, 0, 1, 2, 0]]
    expected = np.mean(predicted == np.argmax(labels, axis=-1))
    assert top1_accuracy(model, (x, labels), batch_size) == pytest.approx(expected, abs=1e-12)
