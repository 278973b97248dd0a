"""Multi-device training: the same losses on 1 and 4 devices (jax, tensorflow), layout map.

The multi-device runs happen in a subprocess: JAX_NUM_CPU_DEVICES and TF's
logical CPU devices must be set before the backend starts.

Tolerance: the runs differ only in how float32 sums are split across devices
(per-device partial sums of the loss and gradients, then an all-reduce), i.e.
round-off of ~1e-7 relative per reduction; Adam divides by the root of the
squared gradients, which can amplify such differences for near-zero gradients
over the 4 steps compared. 1e-4 relative on the running loss leaves a wide
margin over that, while a mistake (gradients summed instead of averaged over
replicas, a shard seen twice, an unsynchronised replica) changes the loss from
the second step by far more than 1e-3. Every run trains on the same four
batches (taken once from the recipe's pipeline): under tf.distribute the
dataset is rewritten for the replicas, and its shuffle order is then not the
one-device order.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import BACKEND, TINY
from keras_mone.models import ImageClassifier, MoNEViTBackbone, ViTBackbone
from keras_mone.methods.matvit.backbone import MatViTBackbone
from keras_mone.training.distribution import VIT_LAYOUT, check_supported

RTOL = 1e-4

_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
{prelude}
import keras
from keras_mone import recipes
from recipe_helpers import tiny_overrides

import numpy as np, tensorflow as tf
losses = {{}}
fixed = None
for kind in {kinds!r}:
    setup = recipes.load("cluttered_digits_mone", **tiny_overrides(
        os.path.join({tmp!r}, kind), distribution=kind, steps_per_epoch=4, batch_size=16,
        eval_split="", learning_rate=3e-3))
    if fixed is None:  # the first (one-device) run's 4 batches, fed to every run
        batches = [next(setup.train_data) for _ in range(4)]
        fixed = tuple(np.concatenate(parts) for parts in zip(*batches))
    data = tf.data.Dataset.from_tensor_slices(fixed).batch(16)
    seen = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(float(logs["loss"])))
    setup.model.fit(data, epochs=1, verbose=0, callbacks=[record], shuffle=False)
    losses[kind] = seen
    {check}
print("LOSSES" + json.dumps(losses))
"""


def _run(tmp_path, backend, kinds, prelude="", check="", env=None):
    script = _SCRIPT.format(
        tests=os.path.dirname(__file__), prelude=prelude, kinds=kinds, tmp=str(tmp_path), check=check
    )
    environment = {**os.environ, "KERAS_BACKEND": backend, **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=environment
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("LOSSES")][-1]
    return json.loads(line[len("LOSSES"):])


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution runs on the jax backend")
def test_jax_data_and_model_parallel_match_one_device(tmp_path):
    check = textwrap.dedent("""
    if kind == "model_parallel":
        kernel = setup.model.backbone.blocks[0].attention.qkv.kernel.value
        assert "model" in str(kernel.sharding.spec), kernel.sharding
    if kind != "none":
        assert len(keras.distribution.list_devices()) == 4
    """).replace("\n", "\n    ")
    losses = _run(
        tmp_path, "jax", ["none", "data_parallel", "model_parallel"], check=check,
        env={"JAX_NUM_CPU_DEVICES": "4", "JAX_PLATFORMS": "cpu"},
    )
    assert len(losses["none"]) == 4 and np.isfinite(losses["none"]).all()
    np.testing.assert_allclose(losses["data_parallel"], losses["none"], rtol=RTOL)
    np.testing.assert_allclose(losses["model_parallel"], losses["none"], rtol=RTOL)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute runs on the tensorflow backend")
def test_tf_mirrored_strategy_matches_one_device(tmp_path):
    prelude = "from keras_mone.training.distribution import split_tf_cpu\nsplit_tf_cpu(4)"
    check = "assert setup.model.distribute_strategy.num_replicas_in_sync == (4 if kind != 'none' else 1)"
    losses = _run(tmp_path, "tensorflow", ["none", "data_parallel"], prelude=prelude, check=check)
    assert len(losses["none"]) == 4 and np.isfinite(losses["none"]).all()
    np.testing.assert_allclose(losses["data_parallel"], losses["none"], rtol=RTOL)


_EVAL_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
{prelude}
from keras_mone import recipes
from recipe_helpers import tiny_overrides

reference, out = {reference!r}, {{}}
for kind in {kinds!r}:
    # in memory (plain) and tf.data (inception) eval paths; 359 test images: fewer than
    # one global batch of 512 (the issue's crash), and a remainder after 64s
    for preprocessing, eval_batch in (("plain", 512), ("inception", 64)):
        run = os.path.join({tmp!r}, kind + preprocessing + str(eval_batch))
        setup = recipes.load("cluttered_digits_vit", **tiny_overrides(
            run, distribution=kind, steps_per_epoch=1, batch_size=16, eval_batch_size=eval_batch,
            preprocessing=preprocessing))
        if os.path.exists(reference):
            setup.model.load_weights(reference)
        else:
            setup.model.save_weights(reference)
        results = setup.evaluate()
        key = (preprocessing + str(eval_batch), results["devices"])
        out[repr(key)] = [results["accuracy"], results["loss"]]
        if eval_batch == 512 and kind != "none":  # the issue's run: validation, then the final evaluation
            final = setup.fit(verbose=0)
            out[repr(("fit", results["devices"]))] = [final["accuracy"], os.path.exists(os.path.join(run, "model.keras"))]
print("EVAL" + json.dumps(out))
"""


def _evaluate(tmp_path, backend, devices, kinds):
    """Evaluation results of the subprocess runs on ``devices`` CPU devices, by repr((key, devices used))."""
    if backend == "jax":
        prelude, env = "", {"JAX_NUM_CPU_DEVICES": str(devices), "JAX_PLATFORMS": "cpu"}
    else:
        prelude, env = f"from keras_mone.training.distribution import split_tf_cpu\nsplit_tf_cpu({devices})", {}
    script = _EVAL_SCRIPT.format(
        tests=os.path.dirname(__file__), prelude=prelude, tmp=str(tmp_path), kinds=kinds,
        reference=str(tmp_path / "reference.weights.h5"),
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
        env={**os.environ, "KERAS_BACKEND": backend, **env},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("EVAL")][-1]
    return json.loads(line[len("EVAL"):])


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="keras.distribution / tf.distribute")
def test_evaluation_scores_every_example_once_on_1_2_4_devices(tmp_path):
    """The same weights score the same examples on 1, 2 and 4 devices: not a
    dropped remainder (fewer examples, or no batch at all: the issue's crash),
    not the padding counted (an accuracy that is no whole number of the 359
    test images, a loss divided by the padded count)."""
    test_images = 359  # test_samples_per_digit=1
    runs = _evaluate(tmp_path, BACKEND, 2, ["none", "data_parallel"])  # one device, then two
    runs.update(_evaluate(tmp_path, BACKEND, 4, ["data_parallel"]))
    for key in ("plain512", "inception64"):
        reference_accuracy, reference_loss = runs[repr((key, 1))]
        assert abs(reference_accuracy * test_images - round(reference_accuracy * test_images)) < 1e-3
        for devices in (2, 4):
            accuracy, loss = runs[repr((key, devices))]
            correct = accuracy * test_images
            assert abs(correct - round(correct)) < 1e-3, (devices, key, accuracy)
            assert round(correct) == round(reference_accuracy * test_images), (devices, key)
            np.testing.assert_allclose(loss, reference_loss, rtol=1e-5, err_msg=f"{devices} devices, {key}")
            accuracy, saved = runs[repr(("fit", devices))]
            assert saved and abs(accuracy * test_images - round(accuracy * test_images)) < 1e-3


def test_unsupported_distributions_are_clear_errors():
    with pytest.raises(ValueError, match="needs the jax or tensorflow backend"):
        check_supported("data_parallel", backend="torch")
    with pytest.raises(ValueError, match="model_parallel.*jax"):
        check_supported("model_parallel", backend="tensorflow")
    with pytest.raises(ValueError, match="must be one of"):
        check_supported("fsdp")


@pytest.mark.parametrize("backbone_cls", [ViTBackbone, MoNEViTBackbone, MatViTBackbone])
def test_layout_map_patterns_match_whole_variable_paths(backbone_cls):
    model = ImageClassifier(backbone_cls(**TINY), num_classes=3)
    model.build()
    paths = [v.path for v in model.weights]
    for pattern in VIT_LAYOUT:
        matched = [p for p in paths if re.fullmatch(pattern, p)]
        assert len(matched) == TINY["depth"], (pattern, matched)
