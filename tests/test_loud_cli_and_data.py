"""Issue 42: cases that ran silently or failed late now stop early, naming the argument and what is allowed."""

import os
import sys
import warnings

import keras
import numpy as np
import pytest
from PIL import Image
from recipe_helpers import TINY_MODEL

from keras_mone import host_memory
from keras_mone.cli import analyze_common
from keras_mone.cli.main import main
from keras_mone.data import pipeline
from keras_mone.methods.mixer.sparse_moe import SparseMoE
from keras_mone.recipes import RecipeError, load


def _analyze(tmp_path, *extra, output=None):
    """``keras-mone analyze routing-maps`` on a model that does not exist: only the argument checks can run."""
    output = str(tmp_path / "out") if output is None else output
    return main(["analyze", "routing-maps", "no_such_model", "--output", output, *extra])


def _one_line_error(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# -- 1. --num-images 0 and the other counts -----------------------------------------------------
@pytest.mark.parametrize("flag, value", [
    ("--num-images", "0"), ("--num-images", "-3"), ("--batch-size", "0"), ("--shown", "0"),
])
def test_counts_below_one_are_refused_before_any_work(tmp_path, capsys, flag, value):
    assert _analyze(tmp_path, flag, value) == 2
    assert f"{flag} must be an integer >= 1, got {value}" in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_budget_numbers_are_checked_too(tmp_path, capsys):
    for extra, expected in [
        (["--gmacs", "1e-3", "--timing-batch", "0"], "--timing-batch must be an integer >= 1, got 0"),
        (["--gmacs", "1e-3", "--step", "0"], "--step must be a number in (0, 1], got 0"),
        (["--gmacs", "-1"], "--gmacs must be a number > 0, got -1"),
    ]:
        assert main(["analyze", "budget", "no_such_model", "--output", str(tmp_path), *extra]) == 2
        assert expected in _one_line_error(capsys)


# -- 2. --output that cannot become a directory ---------------------------------------------------
def test_output_that_is_a_file_or_under_one_is_refused_up_front(tmp_path, capsys):
    file = tmp_path / "taken.txt"
    file.write_text("x")
    assert _analyze(tmp_path, output=str(file)) == 2
    assert f"--output {str(file)!r} is an existing file" in _one_line_error(capsys)
    assert _analyze(tmp_path, output=str(file / "sub")) == 2
    assert f"lies under {str(file)!r}, a file" in _one_line_error(capsys)
    assert file.read_text() == "x"


def test_output_in_an_unwritable_directory_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(analyze_common.os, "access", lambda path, mode: False)  # as for a non-root user
    assert _analyze(tmp_path, output=str(tmp_path / "new" / "deeper")) == 2
    assert f"the directory {str(tmp_path)!r} is not writable" in _one_line_error(capsys)


def test_a_missing_output_directory_is_fine():
    analyze_common.check_output(os.path.join(os.getcwd(), "no", "such", "folder"))  # made when written


# -- 3. the huge-page restart where exec is not allowed ---------------------------------------------
def test_a_refused_restart_runs_in_place_with_one_line(monkeypatch, capsys):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(host_memory.os, "execve", refuse)
    monkeypatch.setattr(host_memory.sys, "platform", "linux")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(host_memory.ENVIRONMENT_SWITCH, raising=False)
    monkeypatch.setattr(sys, "argv", ["keras-mone", "train", "--list"])
    assert main() == 0  # restart tried, refused, then `train --list` ran in place
    out, err = capsys.readouterr()
    assert "cluttered_digits_vit" in out
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "could not restart" in err and "PermissionError" in err and "running in place" in err


# -- 4. distribution=data_parallel on torch ----------------------------------------------------------
def test_torch_distribution_refusal_is_a_recipe_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")  # the torch backend's answer
    run = tmp_path / "run"
    assert main(["train", "cluttered_digits_vit", "distribution=data_parallel", f"output_dir={run}"]) == 2
    err = _one_line_error(capsys)
    assert "key 'distribution'" in err and "needs the jax or tensorflow backend" in err
    assert not run.exists()  # refused before the run directory is made


# -- 5. Sparse-MLP with a capacity factor below one slot per expert ----------------------------------
def test_sparse_mlp_capacity_factor_of_no_slot_warns():
    from keras_mone.presets import from_preset

    with pytest.warns(UserWarning, match=r"`capacity_factor`=0.01 is realised as 0.125 with 32 items per example "
                                         r"in `token_mixing`: each of the 4 experts takes 1 item per example"):
        from_preset("sparse_mlp_digits", load_weights=False, capacity_factor=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_preset("sparse_mlp_digits", load_weights=False)  # 1.25: 10 and 80 slots, no warning


def test_a_standalone_sparse_moe_warns_at_build():
    layer = SparseMoE(4, 8, 1, capacity_factor=0.1)
    with pytest.warns(UserWarning, match=r"`capacity_factor`=0.1 .* 0.1 \* top_k 1 \* 8 items / 4 experts = 0.2 slots"):
        layer.build((None, 8, 16))


# -- 6. labels outside num_classes ---------------------------------------------------------------
def _folder(root, classes=("a", "b", "c"), per_class=2):
    for label, name in enumerate(classes):
        os.makedirs(root / "train" / name)
        for i in range(per_class):
            Image.fromarray(np.full((8, 8, 3), 60 * label + i, "uint8")).save(root / "train" / name / f"{i}.png")
    return root


def test_image_folder_with_more_classes_than_num_classes_is_refused(tmp_path):
    root = _folder(tmp_path / "data")
    with pytest.raises(RecipeError, match=r"label 2 in split 'train' is outside num_classes=2 \(labels must be "
                                          r"0..1\); outside: 2 of 6 labels\. The split has 3 classes"):
        load("augreg_vit_s16_i1k", dataset="image_folder", data_dir=str(root), train_split="train", eval_split="",
             num_classes=2, image_size=32, model_args=dict(TINY_MODEL), output_dir=str(tmp_path / "run"))


def test_bundled_arrays_are_checked_before_the_pipeline_is_built():
    source = pipeline.cluttered_digits_source("train", 32, 0.5, 0, samples_per_digit=1, seed=0)
    with pytest.raises(ValueError, match=r"label \d in split 'train' is outside num_classes=5 \(labels must be 0..4\)"):
        pipeline.train_dataset(source, 32, 4, 5, preprocessing="plain")
    assert set(source.labels) == set(range(10)) and source.split == "train"


def test_labels_unknown_up_front_are_asserted_in_the_pipeline():
    tf = pytest.importorskip("tensorflow")
    labels = np.array([0, 1, 12, 3], "int32")
    examples = tf.data.Dataset.from_tensor_slices((np.zeros((4, 4, 4, 3), "float32"), labels))
    source = pipeline.Source(examples, 4, 10, lambda image: image)  # labels unknown, as from TFDS
    source.split = "validation"
    eval_data = pipeline.eval_dataset(source, 4, 2, 10, preprocessing="plain")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[label\] \[12\] \[in split validation is outside "
                                                              r"num_classes=10 \(labels must be 0..9\)\]"):
        list(eval_data.as_numpy_iterator())
    train = pipeline.train_dataset(source, 4, 4, 10, preprocessing="plain", shuffle_buffer=1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[label\] \[12\]"):
        next(iter(train))
    within = pipeline.eval_dataset(source, 4, 2, 13, preprocessing="plain")
    assert sum(len(batch[1]) for batch in within.as_numpy_iterator()) == 4
