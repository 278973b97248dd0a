"""Nothing lost: a run killed mid-epoch resumes at its last checkpoint's step,
and ends exactly where an uninterrupted run ends (weights bit for bit, and
the history rows of the interrupted epochs)."""

import csv
import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from keras_mone import recipes
from keras_mone.training import checkpoint
from recipe_helpers import tiny_overrides

RECIPE = "cluttered_digits_vit"
KILL_AT = 9  # global step (mid-epoch 2 of 2 x 6 steps); checkpoints every 2 steps


def _overrides(path):
    return tiny_overrides(path, epochs=2, steps_per_epoch=6, checkpoint_steps=2, learning_rate=3e-3)


def _run_until_killed(run, kill_after):
    """Trains ``run`` in a subprocess that dies abruptly after ``kill_after`` steps of its own."""
    script = textwrap.dedent(f"""
        import os, sys, keras
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from keras_mone import recipes
        from recipe_helpers import tiny_overrides
        overrides = tiny_overrides({str(run)!r}, epochs=2, steps_per_epoch=6, checkpoint_steps=2, learning_rate=3e-3)
        setup = recipes.load({RECIPE!r}, **overrides)

        class Kill(keras.callbacks.Callback):
            steps = 0
            def on_train_batch_end(self, batch, logs=None):
                self.steps += 1
                if self.steps == {kill_after}:
                    os._exit(17)  # as abrupt as a SIGKILL: no callbacks, no cleanup

        setup.fit(extra_callbacks=[Kill()], verbose=0)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 17, done.stderr[-3000:]


def _history(run):
    with open(run / "history.csv") as f:
        return list(csv.DictReader(f))


def _all_finite(weights_file):
    values = []
    with h5py.File(weights_file, "r") as file:
        file.visititems(lambda _, node: values.append(np.asarray(node)) if isinstance(node, h5py.Dataset) else None)
    return all(np.isfinite(v).all() for v in values if v.dtype.kind == "f")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run every interrupted one must equal."""
    run = tmp_path_factory.mktemp("straight")
    setup = recipes.load(RECIPE, **_overrides(run))
    return dict(results=setup.fit(verbose=0), weights=setup.model.get_weights(), history=_history(run))


def _assert_same_as_straight(resumed, results, run, straight):
    for resumed_weight, straight_weight in zip(resumed.model.get_weights(), straight["weights"]):
        np.testing.assert_array_equal(resumed_weight, straight_weight)
    assert results["loss"] == straight["results"]["loss"]
    assert results["accuracy"] == straight["results"]["accuracy"]
    history = _history(run)
    assert [int(row["epoch"]) for row in history] == [0, 1]
    for row, expected in zip(history, straight["history"]):  # whole-epoch metrics, not just the steps after a resume
        for key in ("loss", "accuracy"):
            assert float(row[key]) == pytest.approx(float(expected[key]), rel=1e-5), (key, row, expected)


def test_killed_run_resumes_to_the_same_final_state(tmp_path, straight):
    run = tmp_path / "run"
    _run_until_killed(run, KILL_AT)
    assert checkpoint.saved_step(str(run / "checkpoint")) == 8
    assert [step for step, _ in checkpoint.checkpoints(str(run / "checkpoint"))] == [8, 6]  # the newest two

    resumed = recipes.load(RECIPE, **_overrides(run))
    assert resumed.initial_step == 8
    results = resumed.fit(verbose=0)
    assert results["steps"] == 12 and np.isfinite(results["loss"])
    # The resumed run saw the same data at the same steps as an uninterrupted one
    # (fresh renderings per (seed, epoch, batch); no augmentation or dropout in
    # this recipe), so it ends with the same weights, bit for bit.
    _assert_same_as_straight(resumed, results, run, straight)


def test_killed_again_and_again_at_random_steps(tmp_path, straight):
    run = tmp_path / "run"
    recipe_file = None
    for kill_after in np.random.default_rng(13).integers(1, 5, size=3):  # several kills in one run
        _run_until_killed(run, int(kill_after))
        found = checkpoint.checkpoints(str(run / "checkpoint"))
        assert all(_all_finite(weights) for _, weights in found)
        text = (run / "recipe.toml").read_text()
        assert recipe_file in (None, text)  # the run directory still belongs to the same recipe
        recipe_file = text
    resumed = recipes.load(RECIPE, **_overrides(run))
    assert resumed.initial_step > 0
    _assert_same_as_straight(resumed, resumed.fit(verbose=0), run, straight)
