"""``keras-mone finetune PRESET DATA_DIR``: a preset on your own image folder (issue 43 item 2)."""

import json
import os

import numpy as np
import pytest
from conftest import to_numpy
from PIL import Image

from keras_mone import presets
from keras_mone.cli.main import main
from keras_mone.recipes import RecipeError, finetune


def _image_folder(root, classes=("cats", "dogs"), per_class=10, splits=("train",)):
    """Class folders of 40x40 PNGs (another size than the presets' 32: the pipeline resizes)."""
    rng = np.random.default_rng(0)
    for split in splits:
        for index, name in enumerate(classes):
            folder = os.path.join(root, split, name) if split else os.path.join(root, name)
            os.makedirs(folder, exist_ok=True)
            for i in range(per_class):
                image = (rng.random((40, 40, 3)) * 60).astype("uint8")
                image[8:32, 8:32, index % 3] = 220
                Image.fromarray(image).save(os.path.join(folder, f"{i}.png"))
    return str(root)


def _weights(model, prefix):
    return {v.path.split("/", 1)[1]: to_numpy(v) for v in model.weights if v.path.split("/", 1)[1].startswith(prefix)}


def test_the_layouts_give_their_splits(tmp_path):
    # train/ only: a held-out share; train/ + val/: that folder; class folders directly: the folder is the split
    only = _image_folder(tmp_path / "a")
    assert finetune.data_layout(only, 0.25)[1:3] == ("train[:75%]", "train[75%:]")
    both = _image_folder(tmp_path / "b", splits=("train", "val"))
    assert finetune.data_layout(both, 0.2)[1:3] == ("train", "val")
    flat = _image_folder(tmp_path / "c", splits=("",))
    parent, train, held, classes, images, _ = finetune.data_layout(flat, 0.2)
    assert (parent, train, held, classes, images) == (str(tmp_path), "c[:80%]", "c[80%:]", ["cats", "dogs"], 16)


@pytest.mark.parametrize("layout, message", [
    ("missing", "is not a folder"),
    ("empty", "neither a 'train' folder nor class folders"),
    ("one_class", "at least two class folders"),
])
def test_bad_folders_are_named_before_anything_is_built(tmp_path, layout, message):
    root = tmp_path / "data"
    if layout == "empty":
        root.mkdir()
    if layout == "one_class":
        _image_folder(root, classes=("cats",))
    with pytest.raises(RecipeError, match=message):
        finetune.plan("vit_digits", str(root), output_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    with pytest.raises(RecipeError, match="eval_fraction"):
        finetune.data_layout(_image_folder(tmp_path / "ok"), 1.0)


@pytest.mark.parametrize("preset", ["mone_vit_digits", "mixer_digits"])
def test_the_model_is_the_presets_with_a_new_head_for_other_classes(tmp_path, preset):
    # Rules out: a model built from the recipe's own size table (another
    # configuration), a backbone left at random initialisation, and a head
    # silently copied or dropped without saying so.
    data = _image_folder(tmp_path / "data")
    setup, notes = finetune.load(preset, data, output_dir=str(tmp_path / "run"))
    reference = presets.from_preset(preset)
    configuration = lambda model: {  # noqa: E731  (initialiser seeds aside: the weights are copied)
        k: v for k, v in model.backbone.get_config().items() if k != "name" and not k.endswith("_seed")
    }
    assert configuration(setup.model) == configuration(reference)
    mine, theirs = _weights(setup.model, "backbone/"), _weights(reference, "backbone/")
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        np.testing.assert_array_equal(mine[key], value, err_msg=key)
    assert tuple(setup.model.head.kernel.shape)[-1] == 2
    assert "a new 2-class head (the preset has 10 classes" in " ".join(notes)
    assert setup.recipe["batch_size"] == 16  # no larger than the 16 training images


def test_the_head_is_kept_when_the_classes_agree(tmp_path):
    data = _image_folder(tmp_path / "data", classes=[str(d) for d in range(10)], per_class=2)
    setup, notes = finetune.load("vit_digits", data, output_dir=str(tmp_path / "run"))
    reference = presets.from_preset("vit_digits")
    np.testing.assert_array_equal(to_numpy(setup.model.head.kernel), to_numpy(reference.head.kernel))
    assert "the preset's 10-class head is kept" in notes


def test_the_command_trains_evaluates_and_resumes(tmp_path, capsys):
    data = _image_folder(tmp_path / "data")
    run = tmp_path / "run"
    argv = ["finetune", "vit_digits", data, "epochs=2", "learning_rate=0.001", f"output_dir={run}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "a new 2-class head" in out and "20% of 'train' held out" in out
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 2 and 0.0 <= results["accuracy"] <= 1.0
    assert (run / "model.keras").exists() and (run / "recipe.toml").exists()
    assert main(argv) == 0  # the same command again: resumes at its end, trains nothing
    assert "Resuming cluttered_digits_vit_from_dense at step 2 of 2" in capsys.readouterr().out
    assert main(["finetune", "vit_digits", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
