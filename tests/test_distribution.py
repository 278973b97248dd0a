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
from keras_mone.models.matvit_backbone import MatViTBackbone
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
