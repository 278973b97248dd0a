"""A phased run killed inside any phase resumes inside that phase and ends
exactly where an uninterrupted run ends (issue 42 item 6).

The three phases of ACM's conversion hold different things: phase 1
(distill) and 2 (gates) carry the frozen dense teacher, phase 3 (end to end)
does not. Before the fix, the teacher was saved into the checkpoints of
phases 1 and 2 and the rebuilt model refused them: every rerun stopped with
"No checkpoint ... could be restored".
"""

import glob
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import h5py
import keras
import numpy as np
import pytest
from conftest import TINY, randomize_weights
from recipe_helpers import tiny_overrides

from keras_mone import models, recipes
from keras_mone.training import checkpoint

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest

RECIPE = "cluttered_digits_acm_convert"
MODES = ["distill", "gates", "end_to_end"]
STEPS = 3  # per phase (one epoch each), a checkpoint after every step
KILL_AFTER = 2  # steps into the phase being killed


def _overrides(run, dense_path):
    return tiny_overrides(
        run, init_from=dense_path, phases=MODES, phase_epochs=[1, 1, 1], phase_learning_rates=[0.01, 0.05, 0.01],
        acm_init="random", steps_per_epoch=STEPS, checkpoint_steps=1,
    )


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    model = models.ImageClassifier(models.ViTBackbone(**TINY), num_classes=10)
    model.build()
    randomize_weights(model, seed=3)
    path = str(tmp_path_factory.mktemp("dense") / "dense.keras")
    model.save(path)
    return path


@pytest.fixture(scope="module")
def straight(tmp_path_factory, dense_path):
    """The uninterrupted run every resumed one must equal."""
    run = tmp_path_factory.mktemp("straight")
    results = recipes.load(RECIPE, **_overrides(str(run), dense_path)).fit(verbose=0)
    keras.backend.clear_session()
    return results, keras.saving.load_model(run / "model.keras").get_weights()


def _run_until_killed(run, dense_path, global_step):
    """Runs the phased recipe in a subprocess that dies abruptly (``os._exit``) after ``global_step`` steps."""
    script = textwrap.dedent(f"""
        import os, sys, keras
        sys.path[:0] = [{os.path.dirname(__file__)!r}, {TESTS!r}]
        from keras_mone import recipes
        from test_acm_phase_resume import RECIPE, _overrides

        class Kill(keras.callbacks.Callback):
            steps = 0
            def on_train_batch_end(self, batch, logs=None):
                type(self).steps += 1  # counted over every phase
                if type(self).steps == {global_step}:
                    os._exit(17)  # as abrupt as a SIGKILL: no callbacks, no cleanup

        recipes.load(RECIPE, **_overrides({str(run)!r}, {dense_path!r})).fit(extra_callbacks=[Kill()], verbose=0)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 17, done.stderr[-3000:]


@pytest.mark.parametrize("phase", [1, 2, 3])
def test_a_run_killed_inside_each_phase_resumes_there_to_the_same_final_state(tmp_path, dense_path, straight, phase):
    # Rules out: the teacher saved into (and then refusing) phase 1's and 2's
    # checkpoints, a resume that restarts the killed phase from its first
    # step or reruns a finished one, and a resumed phase that ends anywhere
    # but where the uninterrupted run ends.
    run = tmp_path / "run"
    _run_until_killed(run, dense_path, (phase - 1) * STEPS + KILL_AFTER)
    killed = run / "phases" / f"{phase}_{MODES[phase - 1]}"
    assert checkpoint.saved_step(str(killed / "checkpoint")) == KILL_AFTER
    assert not (killed / "model.keras").exists()

    resumed = recipes.load(RECIPE, **_overrides(str(run), dense_path))  # the same command again
    assert resumed.current == phase - 1
    assert resumed.initial_step == (phase - 1) * STEPS + KILL_AFTER
    results = resumed.fit(verbose=0)
    expected_results, expected_weights = straight
    assert results["steps"] == 3 * STEPS
    assert results["loss"] == expected_results["loss"]
    final = keras.saving.load_model(run / "model.keras").get_weights()
    assert len(final) == len(expected_weights)
    for value, expected in zip(final, expected_weights):
        np.testing.assert_array_equal(value, expected)


def _teacher_entries(weights_file):
    found = []
    with h5py.File(weights_file, "r") as file:
        file.visit(lambda name: found.append(name) if "_acm_teacher" in name else None)
    return found


def test_the_teacher_is_never_saved_and_old_checkpoints_holding_it_restore(tmp_path, dense_path):
    # keras_mone 0.1.0 saved the teacher's MLP weights beside each ACM MLP
    # (``.../mlp/_acm_teacher/...``); such a checkpoint must still restore.
    run = tmp_path / "run"
    _run_until_killed(run, dense_path, STEPS + KILL_AFTER)  # inside phase 2 (gates)
    folder = run / "phases" / "2_gates" / "checkpoint"
    files = sorted(glob.glob(str(folder / "*.weights.h5")))
    assert files and not any(_teacher_entries(f) for f in files)
    for path in files:  # write the old layout: a copy of every ACM MLP under _acm_teacher
        with h5py.File(path, "a") as file:
            mlps = []
            file.visit(lambda name: mlps.append(name) if name.endswith("/mlp") else None)
            for mlp in mlps:
                for part in ("fc1", "fc2"):
                    file[mlp].copy(part, f"_acm_teacher/{part}")
        record = path[: -len(".weights.h5")] + ".json"
        with open(record) as f:
            state = json.load(f)
        with open(path, "rb") as f:
            state["sha256"] = hashlib.sha256(f.read()).hexdigest()
        with open(record, "w") as f:
            json.dump(state, f)
    assert all(_teacher_entries(f) for f in files)
    resumed = recipes.load(RECIPE, **_overrides(str(run), dense_path))
    assert resumed.current == 1 and resumed.initial_step == STEPS + KILL_AFTER
