"""Training never loses work: divergence, changed recipes, restarts, corrupt checkpoints, bad keys."""

import os
import shutil
import warnings
import zipfile

import keras
import numpy as np
import pytest

from keras_mone import recipes
from keras_mone.file_io import sha256_of
from keras_mone.cli.main import main as cli
from keras_mone.models.weights_file import load_saved_model
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
    assert "--restart" in str(error.value)  # what a command-line user can do about it
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
        # Issue 24, item 9: model_args may not change what the data feeds the model.
        (dict(model_args={"num_classes": 3}), r"'model_args.num_classes' = 3 differs .*allowed: 10 or none"),
        (dict(model_args={"image_size": 64}), r"'model_args.image_size' = 64 differs .*allowed: 32 or none"),
        (dict(model_args={"num_channels": 1}), r"'model_args.num_channels' = 1.*allowed: 3"),
        (dict(dataset="image_folder", data_dir="x", model_args={"num_classes": 3}), "top-level key 'num_classes'"),
        (dict(model_args={"no_such_argument": 1}), r"unknown argument\(s\) \['no_such_argument'\]"),
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


# Issue 30: checks a plausible bug would slip through; each test names the bug it rules out.
def _tiny_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _trained_with_checkpoints(directory):
    """A tiny model trained 2 epochs of 2 steps, checkpointed at steps 2 and 4."""
    model = _tiny_model()
    x = np.random.default_rng(0).standard_normal((8, 4)).astype("float32")
    model.fit(x, x[:, :3], batch_size=4, epochs=2, verbose=0, callbacks=[checkpoint.StepCheckpoint(directory)])
    return model


def test_a_flipped_byte_inside_an_array_falls_back_with_a_corrupt_warning(tmp_path):
    # Rules out: restore skipping the sha256 check. The flipped byte is the
    # lowest of a float32 kernel entry, so the file still loads and stays finite.
    import h5py

    directory = str(tmp_path / "checkpoint")
    _trained_with_checkpoints(directory)
    (newest_step, newest), (older_step, _) = checkpoint.checkpoints(directory)
    with h5py.File(newest, "r") as file:
        kernels = []
        file.visititems(lambda name, node: kernels.append(name) if isinstance(node, h5py.Dataset) else None)
        name = next(n for n in kernels if file[n].ndim == 2)  # the Dense kernel
        offset, before = file[name].id.get_offset(), np.array(file[name])
    with open(newest, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    with h5py.File(newest, "r") as file:
        after = np.array(file[name])
    assert np.isfinite(after).all() and (after != before).sum() == 1  # one value changed, still loadable

    model = _tiny_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checkpoint.restore(model, directory) == older_step < newest_step
    assert any("corrupt" in str(w.message) and f"step {newest_step}" in str(w.message) for w in caught)


def test_when_every_checkpoint_is_rejected_restore_raises_and_keeps_the_initial_weights(tmp_path):
    # Rules out: restore returning without an error, or leaving the values of
    # the last rejected checkpoint (NaN) in the model.
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    trained = _trained_with_checkpoints(str(tmp_path / "unused"))
    kernel = trained.trainable_variables[0]
    for step in (2, 4):  # finite sha256-matching files that each hold a NaN
        value = np.array(keras.ops.convert_to_numpy(kernel))
        value[0, step % 3] = np.nan
        kernel.assign(value)
        weights = str(directory / f"step_{step}.weights.h5")
        trained.save_weights(weights)
        (directory / f"step_{step}.json").write_text(
            '{"step": %d, "sha256": "%s"}' % (step, sha256_of(weights))
        )
    model = _tiny_model()
    initial = [keras.ops.convert_to_numpy(v) for v in model.variables]
    with pytest.warns(UserWarning, match="non-finite"):
        with pytest.raises(ValueError, match="could be restored") as error:
            checkpoint.restore(model, str(directory))
    assert "step_4.weights.h5" in str(error.value) and "step_2.weights.h5" in str(error.value)
    for variable, value in zip(model.variables, initial):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value)
    assert not checkpoint.non_finite_variables(model)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0


def test_a_nan_in_an_optimizer_slot_is_a_divergence_and_nothing_is_written(tmp_path):
    # Rules out: non_finite_variables looking at the model's variables only.
    model = _trained_with_checkpoints(str(tmp_path / "first"))
    slot = next(v for v in model.optimizer.variables if "momentum" in v.path)
    slot.assign(np.full(slot.shape, np.nan, "float32"))
    assert not any(not np.isfinite(keras.ops.convert_to_numpy(v)).all() for v in model.variables)
    assert checkpoint.non_finite_variables(model) == [slot.path]
    directory = tmp_path / "checkpoint"
    callback = checkpoint.StepCheckpoint(str(directory))
    callback.set_model(model)
    callback.on_train_begin()
    assert callback.save() is None
    assert callback.diverged_step == 4 and model.stop_training
    assert not directory.exists()


def test_model_args_that_repeat_the_data_keys_are_accepted():
    for size in (32, [32, 32], (32, 32)):
        recipe, _ = recipes.resolve("cluttered_digits_vit", model_args={"num_classes": 10, "image_size": size})
        assert recipe["model_args"] == {"num_classes": 10, "image_size": size}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished run of the tiny recipe (trained once per module; copy it to change it)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    _train(run)
    return run


def test_the_run_directory_is_bound_by_its_recipe_without_checkpoints(finished_run, tmp_path):
    # Issue 24, item 2: a finished run whose checkpoint/ was deleted.
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "checkpoint")
    before = {name: (run / name).read_bytes() for name in ("recipe.toml", "history.csv", "model.keras", "results.json")}
    with pytest.raises(recipes.RecipeError, match=r"no checkpoint\) of a different recipe \(learning_rate: "):
        recipes.load("cluttered_digits_vit", **tiny_overrides(run, checkpoint_steps=2, learning_rate=0.1))
    assert {name: (run / name).read_bytes() for name in before} == before and not (run / "previous").exists()
    # The same recipe starts afresh; the old run moves aside, nothing is overwritten or appended to.
    with pytest.warns(UserWarning, match=r"no checkpoint to resume from; the old run's files were moved to .*previous"):
        setup = recipes.load("cluttered_digits_vit", **tiny_overrides(run, checkpoint_steps=2))
    assert setup.initial_step == 0
    assert {name: (run / "previous" / "1" / name).read_bytes() for name in before} == before
    assert not any((run / name).exists() for name in ("history.csv", "model.keras", "results.json"))


def test_an_unreadable_recorded_recipe_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.toml").write_text("this is = = not toml")
    with pytest.raises(recipes.RecipeError, match="recipe.toml' cannot be read"):
        recipes.load("cluttered_digits_vit", **tiny_overrides(run))
    assert (run / "recipe.toml").read_text() == "this is = = not toml"


@pytest.mark.parametrize("name", ["", "checkpoint", "history.csv", "model.keras", "results.json", "recipe.toml"])
def test_an_unwritable_path_of_the_run_is_refused_before_training(finished_run, name, monkeypatch):
    # Issue 24, item 13. Root may write anything, so os.access says what a user would meet.
    denied = os.path.join(str(finished_run), name) if name else str(finished_run)
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: os.fspath(path) != denied and access(path, mode, **kw))
    with pytest.raises(recipes.RecipeError, match=f"{denied!r} .*not writable"):
        recipes.load("cluttered_digits_vit", **tiny_overrides(finished_run, checkpoint_steps=2))


def test_a_directory_where_the_history_goes_is_refused(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "history.csv").unlink()
    (run / "history.csv").mkdir()
    with pytest.raises(recipes.RecipeError, match="history.csv' is not a regular file"):
        recipes.load("cluttered_digits_vit", **tiny_overrides(run, checkpoint_steps=2))


def _damaged_keras_files(tmp_path):
    from conftest import TINY
    from keras_mone import models

    path = tmp_path / "model.keras"
    model = models.ImageClassifier(models.ViTBackbone(**TINY), num_classes=3)
    model.build()
    model.save(str(path))
    data = path.read_bytes()
    truncated = tmp_path / "truncated.keras"
    truncated.write_bytes(data[: len(data) // 2])
    inner = tmp_path / "inner.keras"  # a sound zip holding a truncated weights file
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(inner, "w") as target:
        for member in source.namelist():
            content = source.read(member)
            target.writestr(member, content[: len(content) // 2] if member.endswith(".h5") else content)
    return truncated, inner


def test_a_truncated_keras_file_is_named_as_such(tmp_path):
    # Issue 24, item 11: Keras says "File not found" for a file that exists.
    truncated, inner = _damaged_keras_files(tmp_path)
    for path, message in ((truncated, "exists .* but is not a readable .keras archive"),
                          (inner, "exists but could not be loaded as a .keras model")):
        with pytest.raises(ValueError, match=message) as error:
            load_saved_model(str(path))
        assert str(path) in str(error.value) and "File not found" not in str(error.value)
        assert error.value.__cause__ is not None
