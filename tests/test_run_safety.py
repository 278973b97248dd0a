"""Training never loses work: divergence, changed recipes, restarts, corrupt checkpoints, bad keys."""

import os
import warnings

import keras
import numpy as np
import pytest

from keras_mone import recipes
from keras_mone.cli.main import main as cli
from keras_mone.training import checkpoint
from recipe_helpers import tiny_overrides


def _train(path, **extra):
    setup = recipes.load("cluttered_digits_vit", **tiny_overrides(path, checkpoint_steps=2, **extra))
    return setup, setup.fit(verbose=0)


class PoisonAt(keras.callbacks.Callback):
    """Writes NaN into the first kernel after ``step`` steps: a divergence on cue."""

    def __init__(self, step):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            kernel = self.model.trainable_variables[0]
            kernel.assign(np.full(kernel.shape, np.nan, "float32"))


def test_divergence_keeps_the_last_good_checkpoint_and_raises(tmp_path):
    run = tmp_path / "run"
    setup = recipes.load("cluttered_digits_vit", **tiny_overrides(run, epochs=2, checkpoint_steps=2))
    with pytest.raises(checkpoint.TrainingDiverged, match=r"at step [56].*last good checkpoint is step 4"):
        setup.fit(extra_callbacks=[PoisonAt(5)], verbose=0)
    saved = checkpoint.checkpoints(str(run / "checkpoint"))
    assert [step for step, _ in saved] == [4, 2]
    assert not (run / "model.keras").exists() and not (run / "results.json").exists()
    # The checkpoint left is finite and resumes.
    resumed = recipes.load("cluttered_digits_vit", **tiny_overrides(run, epochs=2, checkpoint_steps=2))
    assert resumed.initial_step == 4 and not checkpoint.non_finite_variables(resumed.model)


def test_cli_exits_nonzero_on_divergence(tmp_path, capsys, monkeypatch):
    def diverge(self, *args, **kwargs):
        raise checkpoint.TrainingDiverged("training diverged at step 3")

    monkeypatch.setattr(recipes.TrainingSetup, "fit", diverge)
    status = cli(["train", "cluttered_digits_vit", f"output_dir={tmp_path}", "epochs=1", "steps_per_epoch=1",
                  "samples_per_digit=1", "test_samples_per_digit=1", "batch_size=8", "image_size=32",
                  "model_args.patch_size=8", "model_args.depth=1"])
    assert status == 1 and "diverged at step 3" in capsys.readouterr().err


def test_resuming_with_another_recipe_is_refused(tmp_path):
    run = tmp_path / "run"
    _train(run)
    for change, key in ((dict(learning_rate=0.1), "learning_rate"), (dict(model_args={"depth": 1}), "model_args")):
        with pytest.raises(recipes.RecipeError, match=rf"different recipe \({key}: "):
            recipes.load("cluttered_digits_vit", **tiny_overrides(run, checkpoint_steps=2, **change))
    # Keys that change neither model, data nor optimisation may differ.
    same = recipes.load("cluttered_digits_vit", **tiny_overrides(run, checkpoint_steps=3, eval_batch_size=32))
    assert same.initial_step == 4


def test_restart_moves_the_old_run_aside(tmp_path):
    run = tmp_path / "run"
    _train(run)
    old_history = (run / "history.csv").read_text()
    setup = recipes.load("cluttered_digits_vit", resume=False, **tiny_overrides(run, learning_rate=0.01))
    assert setup.initial_step == 0 and not (run / "history.csv").exists()
    previous = run / "previous" / "1"
    assert (previous / "history.csv").read_text() == old_history
    assert checkpoint.saved_step(str(previous / "checkpoint")) == 4 and (previous / "model.keras").exists()
    setup.fit(verbose=0)
    rows = (run / "history.csv").read_text().strip().splitlines()
    assert len(rows) == 2  # header + the new run's one epoch: the old rows stay in previous/1


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    run = tmp_path / "run"
    setup, _ = _train(run, epochs=2)
    directory = str(run / "checkpoint")
    (newest_step, newest), (older_step, older) = checkpoint.checkpoints(directory)
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = recipes.load("cluttered_digits_vit", **tiny_overrides(run, epochs=2, checkpoint_steps=2))
    assert resumed.initial_step == older_step < newest_step
    assert any("Skipping checkpoint" in str(w.message) for w in caught)
    with open(older, "r+b") as f:
        f.truncate(100)
    with pytest.raises(recipes.RecipeError, match="could be restored") as error:
        recipes.load("cluttered_digits_vit", **tiny_overrides(run, epochs=2, checkpoint_steps=2))
    assert newest in str(error.value) and older in str(error.value)
    assert os.path.exists(newest) and os.path.exists(older)  # reported, never deleted


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(learning_rate=float("nan")), "'learning_rate' must be a finite number"),
        (dict(learning_rate=float("inf")), "'learning_rate' must be a finite number"),
        (dict(learning_rate=0.0), "'learning_rate' must be > 0"),
        (dict(capacity=0.0), r"'capacity' must lie in \(0.0, 1.0\]"),
        (dict(seed=-1), "'seed' must be >= 0"),
        (dict(model_args=5), "'model_args' must be a table"),
        (dict(num_classes=3), r"'num_classes' must be 0 or 10"),
        (dict(adaptive_capacities=[True, 0.5]), "'adaptive_capacities'"),
    ],
)
def test_bad_recipe_values_are_refused_before_anything_is_written(tmp_path, overrides, message):
    run = tmp_path / "run"
    with pytest.raises(recipes.RecipeError, match=message):
        recipes.load("cluttered_digits_vit", output_dir=str(run), **overrides)
    assert not run.exists()


def test_output_dir_that_is_a_file_is_a_recipe_error(tmp_path):
    path = tmp_path / "file"
    path.write_text("keep me")
    with pytest.raises(recipes.RecipeError, match="'output_dir'.*is a file"):
        recipes.load("cluttered_digits_vit", output_dir=str(path))
    assert path.read_text() == "keep me"
