"""Trained presets that ship inside the package: checked loading, accuracy, publishing.

Every preset with weights in ``zoo/weights/manifest.toml`` is loaded on the
backend under test and must reach the test accuracy its manifest records (on
the recorded test split, at every recorded capacity / width) within 0.5
points: the weights and test images are the same bit for bit, and only
cross-backend float differences (near-tied logits or router scores) may flip
a prediction. Publishing and the error paths run on a tiny run in a temporary
zoo folder (``KERAS_MONE_ZOO_PATH``).
"""

import os

import keras
import numpy as np
import pytest

from keras_mone import presets, recipes
from keras_mone.presets import registry
from keras_mone.presets.publish import measure_accuracy, publish_run
from keras_mone.presets.weights import ZOO_PATH_ENV, sha256_of
from recipe_helpers import tiny_overrides

TOLERANCE = 0.005  # 0.5 points (25 of 5026 test images)


@pytest.mark.parametrize("name", presets.shipped_presets())
def test_shipped_preset_loads_and_meets_its_recorded_accuracy(name):
    entry = presets.get_preset(name)["weights"]
    assert sha256_of(os.path.join(entry["folder"], entry["file"])) == entry["sha256"]
    model = presets.from_preset(name)
    recorded, setting = entry["eval"]["accuracy"], entry["eval"]["setting"]
    values = list(recorded) if setting == "execution" else [float(v) for v in recorded]  # ACM: exact, grouped
    measured = measure_accuracy(
        model, setting, values, entry["eval"]["test_split"],
        entry["eval"].get("dataset", "cluttered_digits"),
    )
    for value, accuracy in recorded.items():
        assert abs(measured[value] - accuracy) <= TOLERANCE, (name, value, measured[value], accuracy)


TINY_PRESET = """
[tiny_vit_digits]
description = "test preset"
architecture = "vit"
variant = "Ti/4"
image_size = 32
patch_size = 8
hidden_dim = 32
depth = 2
num_heads = 4
mlp_dim = 64
num_classes = 10
"""


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny trained run, published into a temporary zoo folder."""
    root = tmp_path_factory.mktemp("zoo")
    zoo, run = root / "zoo", root / "run"
    zoo.mkdir()
    (zoo / "tiny.toml").write_text(TINY_PRESET)
    previous = os.environ.get(ZOO_PATH_ENV)
    os.environ[ZOO_PATH_ENV] = str(zoo)
    registry._load_zoo.cache_clear()
    setup = recipes.load("cluttered_digits_vit", **tiny_overrides(run, test_samples_per_digit=1))
    setup.fit(verbose=0)
    entry = publish_run(str(run), "tiny_vit_digits", command="test", zoo_folder=str(zoo))
    yield dict(zoo=zoo, run=run, entry=entry, trained=setup.model)
    if previous is None:
        os.environ.pop(ZOO_PATH_ENV)
    else:
        os.environ[ZOO_PATH_ENV] = previous
    registry._load_zoo.cache_clear()


def _weights_file(published):
    return published["zoo"] / "weights" / published["entry"]["file"]


def test_published_preset_loads_the_trained_model_exactly(published):
    assert "tiny_vit_digits" in presets.shipped_presets()
    spec = presets.get_preset("tiny_vit_digits")["weights"]
    assert spec["sha256"] == sha256_of(_weights_file(published)) and spec["command"] == "test"
    assert spec["recipe"] == "cluttered_digits_vit" and set(spec["eval"]["accuracy"]) == {"1.0"}
    model = presets.from_preset("tiny_vit_digits")
    images = np.random.default_rng(0).uniform(-1, 1, (4, 32, 32, 3)).astype("float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model(images)), keras.ops.convert_to_numpy(published["trained"](images))
    )


@pytest.mark.parametrize("damage", ["flip_byte", "truncate"])
def test_corrupt_weights_file_is_named_with_the_expected_sha(published, damage):
    path = _weights_file(published)
    original = path.read_bytes()
    damaged = original[: len(original) // 2] if damage == "truncate" else (
        original[:100] + bytes([original[100] ^ 0xFF]) + original[101:]
    )
    try:
        path.write_bytes(damaged)
        with pytest.raises(ValueError, match=published["entry"]["sha256"]) as error:
            presets.from_preset("tiny_vit_digits")
        assert str(path) in str(error.value) and "corrupt" in str(error.value)
        assert path.read_bytes() == damaged  # never rewritten or deleted
    finally:
        path.write_bytes(original)


def test_missing_file_and_wrong_manifest_sha_are_clear_errors(published):
    path = _weights_file(published)
    original = path.read_bytes()
    manifest = published["zoo"] / "weights" / "manifest.toml"
    text = manifest.read_text()
    try:
        manifest.write_text(text.replace(published["entry"]["sha256"], "0" * 64))
        registry._load_zoo.cache_clear()
        with pytest.raises(ValueError, match="0" * 64):
            presets.from_preset("tiny_vit_digits")
        manifest.write_text(text)
        registry._load_zoo.cache_clear()
        path.unlink()
        with pytest.raises(ValueError, match="missing"):
            presets.from_preset("tiny_vit_digits")
    finally:
        manifest.write_text(text)
        path.write_bytes(original)
        registry._load_zoo.cache_clear()


def test_shape_changing_override_is_refused_and_others_work(published):
    with pytest.raises(ValueError, match="does not fit") as error:
        presets.from_preset("tiny_vit_digits", num_classes=7)
    assert str(_weights_file(published)) in str(error.value) and published["entry"]["sha256"] in str(error.value)
    model = presets.from_preset("tiny_vit_digits", name="renamed")  # no shape change: loads
    assert model.name == "renamed"


def test_publish_refuses_a_run_of_another_architecture(published, tmp_path):
    (published["zoo"] / "other.toml").write_text(
        TINY_PRESET.replace("tiny_vit_digits", "tiny_wide_digits").replace("hidden_dim = 32", "hidden_dim = 64")
    )
    registry._load_zoo.cache_clear()
    try:
        with pytest.raises(ValueError, match="does not fit preset 'tiny_wide_digits'"):
            publish_run(str(published["run"]), "tiny_wide_digits", zoo_folder=str(published["zoo"]))
        assert not (published["zoo"] / "weights" / "tiny_wide_digits.weights.h5").exists()
    finally:
        (published["zoo"] / "other.toml").unlink()
        registry._load_zoo.cache_clear()
