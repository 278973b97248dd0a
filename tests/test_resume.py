"""Nothing lost: a run killed mid-epoch resumes at its last checkpoint's step."""

import csv
import os
import subprocess
import sys
import textwrap

import numpy as np

from keras_mone import recipes
from keras_mone.training import checkpoint
from recipe_helpers import tiny_overrides

KILL_AT = 9  # global step (mid-epoch 2 of 2 x 6 steps); checkpoints every 2 steps


def _overrides(path):
    return tiny_overrides(path, epochs=2, steps_per_epoch=6, checkpoint_steps=2, learning_rate=3e-3)


def test_killed_run_resumes_to_the_same_final_step(tmp_path):
    run = tmp_path / "run"
    script = textwrap.dedent(f"""
        import os, sys, keras
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from keras_mone import recipes
        from recipe_helpers import tiny_overrides
        overrides = tiny_overrides({str(run)!r}, epochs=2, steps_per_epoch=6, checkpoint_steps=2, learning_rate=3e-3)
        setup = recipes.load("cluttered_digits_vit", **overrides)

        class Kill(keras.callbacks.Callback):
            steps = 0
            def on_train_batch_end(self, batch, logs=None):
                self.steps += 1
                if self.steps == {KILL_AT}:
                    os._exit(17)  # as abrupt as a SIGKILL: no callbacks, no cleanup

        setup.fit(extra_callbacks=[Kill()], verbose=0)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 17, done.stderr[-3000:]
    assert checkpoint.saved_step(str(run / "checkpoint")) == 8
    assert [step for step, _ in checkpoint.checkpoints(str(run / "checkpoint"))] == [8, 6]  # the newest two

    resumed = recipes.load("cluttered_digits_vit", **_overrides(run))
    assert resumed.initial_step == 8
    results = resumed.fit(verbose=0)
    assert results["steps"] == 12 and np.isfinite(results["loss"])
    with open(run / "history.csv") as f:
        epochs = [int(row["epoch"]) for row in csv.DictReader(f)]
    assert epochs == [0, 1]  # epoch 0 from the killed run, epoch 1 finished after resuming

    # The resumed run saw the same data at the same steps as an uninterrupted one
    # (fresh renderings per (seed, epoch, batch); no augmentation or dropout in
    # this recipe), so it ends with the same weights, bit for bit.
    straight = recipes.load("cluttered_digits_vit", **_overrides(tmp_path / "straight"))
    expected = straight.fit(verbose=0)
    for resumed_weight, straight_weight in zip(resumed.model.get_weights(), straight.model.get_weights()):
        np.testing.assert_array_equal(resumed_weight, straight_weight)
    assert results["loss"] == expected["loss"] and results["accuracy"] == expected["accuracy"]
