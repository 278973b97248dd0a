"""Weights and model files are checked before anything is loaded (issue 13, item 8)."""

import keras
import numpy as np
import pytest

from conftest import TINY, images
from keras_mone import models
from keras_mone.models.weights_file import load_saved_model


def classifier(**changes):
    model = models.ImageClassifier(models.MoNEViTBackbone(**dict(TINY, **changes), capacity=0.5), num_classes=10)
    model.build()
    return model


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(hidden_dim=64, mlp_dim=128), "Shapes only in the file: \\(1, 16, 64\\)"),
        (dict(depth=3), "it stores \\d+ variables, the model has"),
    ],
)
def test_weights_of_another_model_are_refused_before_anything_is_assigned(changes, message, tmp_path):
    other = tmp_path / "other.weights.h5"
    classifier(**changes).save_weights(str(other))
    model = classifier()
    before = model.get_weights()
    with pytest.raises(ValueError, match=message):
        model.load_weights(str(other))
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_weights_of_the_same_model_load(tmp_path):
    path = tmp_path / "same.weights.h5"
    source = classifier()
    source.save_weights(str(path))
    model = classifier()
    model.load_weights(str(path))
    np.testing.assert_array_equal(model.predict(images(), verbose=0), source.predict(images(), verbose=0))


def test_truncated_weights_file(tmp_path):
    path = tmp_path / "cut.weights.h5"
    classifier().save_weights(str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable HDF5 file"):
        classifier().load_weights(str(path))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data[: len(data) // 2], "truncated or not a Keras file"),
        (lambda data: b"not a model", "truncated or not a Keras file"),
    ],
)
def test_damaged_keras_files_are_named_as_such(damage, message, tmp_path):
    path = tmp_path / "model.keras"
    classifier().save(str(path))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        load_saved_model(str(path))


def test_a_zip_that_is_not_a_keras_model(tmp_path):
    import zipfile

    path = tmp_path / "other.keras"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "hello")
    with pytest.raises(ValueError, match="no config.json"):
        load_saved_model(str(path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_saved_model(str(tmp_path / "missing.keras"))


def test_a_saved_model_loads(tmp_path):
    path = tmp_path / "model.keras"
    source = classifier()
    source.save(str(path))
    np.testing.assert_array_equal(
        load_saved_model(str(path)).predict(images(), verbose=0), source.predict(images(), verbose=0)
    )
    assert isinstance(keras.saving.load_model(str(path)), models.ImageClassifier)
