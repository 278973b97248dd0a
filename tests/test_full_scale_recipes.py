"""The full-scale recipes (AugReg, ViViT) as the README runs them, on a tiny synthetic folder.

`dataset=image_folder data_dir=ROOT` with the recipes' own TFDS-style splits
(`train[:99%]` / `train[99%:]`), `distribution = "auto"`, padded evaluation
batches, and the error without tensorflow-datasets.
"""

import json
import os
import sys

import numpy as np
import pytest
import tomllib
from PIL import Image

from conftest import TINY
from keras_mone.cli.main import main
from keras_mone.data import pipeline, video_pipeline
from keras_mone.data.in_memory import ArrayBatches
from keras_mone.recipes import RecipeError, load
from keras_mone.recipes.files import resolve
from keras_mone.training import distribution

FULL_SCALE = [
    f"augreg_{a}_{s}16_{d}" for a in ("vit", "mone_vit") for s in "sbl" for d in ("i1k", "i21k")
] + [f"{a}_fe_b16_{d}" for a in ("vivit", "mone_vivit") for d in ("k400", "ssv2")]
TINY_ARGS = [f"model_args.{k}={v}" for k, v in TINY.items() if k != "image_size"]


def _image_folder(root, classes=("cat", "dog"), per_class=100):
    """``root/train/<class>/<i>.png``: 8x8 PNGs, one colour per class."""
    for label, name in enumerate(classes):
        os.makedirs(root / "train" / name)
        for i in range(per_class):
            pixels = np.full((8, 8, 3), 40 + 150 * label + i % 50, "uint8")
            Image.fromarray(pixels).save(root / "train" / name / f"{i:03d}.png")
    return root


def test_image_folder_with_the_recipes_default_splits_trains_end_to_end(tmp_path, capsys):
    """The README's command: before, FileNotFoundError 'ROOT/train[:99%]'."""
    root = _image_folder(tmp_path / "data")
    run = tmp_path / "run"
    code = main([
        "train", "augreg_mone_vit_s16_i1k", "dataset=image_folder", f"data_dir={root}",
        f"image_size={TINY['image_size']}", *TINY_ARGS, "batch_size=4", "steps_per_epoch=1", "epochs=1",
        "warmup_steps=0", "shuffle_buffer=16", "checkpoint_steps=0", f"output_dir={run}",
        "augmentation=none",  # tracing RandAugment into tf.data takes a minute; test_recipes.py runs it
    ])
    assert code == 0, capsys.readouterr().err
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 1 and 0.0 <= results["accuracy"] <= 1.0
    assert results["distribution"] == "none" and results["devices"] == 1  # "auto" on a CPU
    with open(run / "recipe.toml", "rb") as f:
        assert tomllib.load(f)["distribution"] == "auto"
    # 200 images: 99% = 198 train, 2 eval, disjoint
    train = pipeline.image_folder_source(str(root), "train[:99%]")
    test = pipeline.image_folder_source(str(root), "train[99%:]")
    assert (train.num_examples, test.num_examples, train.num_classes) == (198, 2, 2)


def test_folder_splits_slice_like_tfds():
    files = [(f"/r/train/c{i % 3}/{i:03d}.png", i % 3) for i in range(300)]

    def part(split):
        return pipeline.split_files(files, pipeline.parse_split(split)[1], "/r/train")

    head, tail = part("train[:90%]"), part("train[90%:]")
    assert (len(head), len(tail)) == (270, 30)
    assert sorted(head + tail) == sorted(files)  # complementary, disjoint
    assert head[:5] != files[:5]  # a fixed shuffle, not the first class's files
    assert {label for _, label in tail} == {0, 1, 2}  # every class in the held-out part
    assert part("train[:10]") == head[:10] and part("train[-1%:]") == tail[-3:]
    assert part("train") == files and pipeline.parse_split("full[51200:]") == ("full", ((51200, ""), (None, "")))


def test_folder_split_errors_name_the_key(tmp_path):
    root = _image_folder(tmp_path / "data", per_class=3)
    common = dict(dataset="image_folder", data_dir=str(root), output_dir=str(tmp_path / "run"))
    with pytest.raises(RecipeError, match=r"key 'eval_split'.*selects none of the 6 images"):
        load("augreg_vit_s16_i1k", **common)  # 99% of 6 rounds to all 6
    with pytest.raises(RecipeError, match=r"key 'train_split'.*name\[start:stop\]"):
        load("augreg_vit_s16_i1k", train_split="train[a:b]", **common)


def test_tfds_without_tensorflow_datasets_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
    code = main(["train", "augreg_vit_s16_i1k", f"output_dir={tmp_path}"])
    assert code == 2
    error = capsys.readouterr().err
    assert 'pip install "keras-mone[tfds]"' in error and "imagenet2012" in error
    assert "Traceback" not in error


@pytest.mark.parametrize("name", FULL_SCALE)
def test_full_scale_recipes_default_to_auto(name):
    assert resolve(name)[0]["distribution"] == "auto"


def test_auto_uses_every_local_accelerator_when_there_are_several(monkeypatch):
    assert distribution.local_accelerators() == []  # this CPU machine
    for found, jax_tf, torch in (([], "none", "none"), (["gpu:0"], "none", "none"), (["gpu:0", "gpu:1"], "data_parallel", "none")):
        monkeypatch.setattr(distribution, "local_accelerators", lambda backend=None, found=found: found)
        assert distribution.resolve("auto", "jax") == jax_tf
        assert distribution.resolve("auto", "tensorflow") == jax_tf
        if len(found) > 1:
            with pytest.warns(UserWarning, match="one of the 2 GPUs"):
                assert distribution.resolve("auto", "torch") == torch
        assert distribution.resolve("model_parallel", "jax") == "model_parallel"


def _weights(batches):
    return np.concatenate([np.asarray(b[2]) for b in batches])


def test_eval_batches_padded_to_full_batches_weigh_padding_zero():
    """5 examples in batches of 4: 8 rows, the last 3 repeats at weight 0; the real
    ones weigh 8/5, so Keras' loss (averaged over 8) is the mean over the 5."""
    tf = pytest.importorskip("tensorflow")
    images = np.arange(5, dtype="float32")[:, None, None, None] * np.ones((5, 4, 4, 3), "float32")
    labels = np.arange(5, dtype="int32") % 2
    source = pipeline.Source(tf.data.Dataset.from_tensor_slices((images, labels)), 5, 2, lambda x: x)
    clips = video_pipeline.VideoSource(
        tf.data.Dataset.from_tensor_slices((images[:, None].repeat(2, axis=1), labels)), 5, 2,
        length=lambda raw: tf.shape(raw)[0], frames=lambda raw, indices: tf.gather(raw, indices),
    )
    expected = [1.6] * 5 + [0.0] * 3
    for batches in (
        list(pipeline.eval_dataset(source, 4, 4, 2, preprocessing="plain", full_batches=True).as_numpy_iterator()),
        list(video_pipeline.eval_dataset(clips, 2, 4, 4, 2, preprocessing="plain", full_batches=True)
             .as_numpy_iterator()),
        list(ArrayBatches(images, np.eye(2)[labels], 4, full_batches=True)),
    ):
        assert [len(b[0]) for b in batches] == [4, 4]
        np.testing.assert_allclose(_weights(batches), expected, rtol=1e-6)
        first = np.concatenate([b[0] for b in batches]).reshape(8, -1)[:, 0]
        assert (np.diff(first[:5]) > 0).all() and (first[5:] == first[:3]).all()  # padding repeats real rows
    plain = list(pipeline.eval_dataset(source, 4, 4, 2, preprocessing="plain").as_numpy_iterator())
    assert [len(b) for b in plain] == [2, 2] and [len(b[0]) for b in plain] == [4, 1]
