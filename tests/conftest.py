"""Shared harness of the keras_mone test suite (jax, tensorflow and torch).

Run per backend: ``KERAS_BACKEND=jax python -m pytest tests -q`` (also
``tensorflow`` and ``torch``). Tests building ViT-B/L are marked ``large``
and deselected by default (``-m large`` runs them).

Speed: on the jax backend every eager op is compiled by XLA on first use of a
shape, which dominates the run time on a small CPU. Unless the caller set
them already, this file therefore (1) lowers the XLA CPU backend
optimisation level (a compile-time knob; float32 semantics are unchanged) and
(2) turns on jax's persistent compilation cache in the system temp dir, so
repeated runs reuse compiled ops. Set ``KERAS_MONE_TEST_JAX_CACHE=off`` to
disable the cache, or to a directory to move it.

A method family's tests sit in ``tests/methods/<family>/``, mirroring
``keras_mone/methods/<family>/``; every such folder is importable by module
name (``from test_convert_mixer import ...``), as ``tests/`` itself is.
"""

import os
import pathlib
import sys
import tempfile

for _family_tests in sorted((pathlib.Path(__file__).parent / "methods").iterdir()):
    if _family_tests.is_dir() and str(_family_tests) not in sys.path:
        sys.path.insert(0, str(_family_tests))

from hypothesis import settings as _hypothesis_settings  # noqa: E402

# The property tests' examples: fixed by default, so a run is reproducible and CI's verdict
# does not depend on the draw; `pytest --hypothesis-profile explore` searches afresh.
# (Named "fixed", not "ci": hypothesis has a "ci" profile of its own.)
_hypothesis_settings.register_profile("fixed", max_examples=40, derandomize=True)
_hypothesis_settings.register_profile("explore", max_examples=400, derandomize=False)
_hypothesis_settings.load_profile("fixed")

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()

if BACKEND == "jax":
    import jax

    _cache = os.environ.get(
        "KERAS_MONE_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "keras_mone_test_jax_cache")
    )
    if _cache.lower() not in ("off", "0", "false", ""):
        jax.config.update("jax_compilation_cache_dir", _cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# The one tiny geometry used everywhere (few distinct shapes = few compilations):
# 32x32 images, 8x8 patches -> 16 tokens; D=32 so the 4 experts have widths 4, 8, 16, 32.
TINY = dict(image_size=32, patch_size=8, hidden_dim=32, depth=2, num_heads=4, mlp_dim=64)
BATCH = 2
NUM_TOKENS = (TINY["image_size"] // TINY["patch_size"]) ** 2

# The tiny video geometry (tests of ViViT, MoNE-ViViT and MatViT-ViViT): 4 frames
# of 16x16, tubelet 2x8x8 -> 2 frame indices of 4 tokens (+ class token).
TINY_SPATIAL = dict(image_size=16, patch_size=8, hidden_dim=32, depth=2, num_heads=4, mlp_dim=64)
TINY_VIDEO = dict(TINY_SPATIAL, num_frames=4, tubelet_size=2, temporal_depth=1)

# float32 against the float64 numpy reference. Each value carries round-off
# of a few ulps per layer: dot products of <= 96 terms, softmax, LayerNorm
# (which divides by the feature std). Measured on jax, tensorflow and torch, the
# largest error of every layer and of 2-3-block backbones is <= 9 ulps of the
# largest |value| of the tensor (eps32 * max|expected|). We allow 32 such ulps
# (e.g. 1.9e-5 for backbone outputs of magnitude ~5): a 3-4x margin, while a
# wrong width, slice, gate, scale or token order gives errors >= 1e-3.
EPS32 = float(np.finfo(np.float32).eps)
F32_ULPS = 32


def f32_tolerance(expected, ulps=F32_ULPS):
    return ulps * EPS32 * max(1.0, float(np.max(np.abs(expected))))


def assert_f32_close(actual, expected, ulps=F32_ULPS):
    """``max |actual - expected| <= ulps * eps32 * max(1, max |expected|)``."""
    err, tol = max_abs_diff(actual, expected), f32_tolerance(expected, ulps)
    assert np.shape(actual) == np.shape(expected), (np.shape(actual), np.shape(expected))
    assert err <= tol, f"max abs error {err:.3g} > tolerance {tol:.3g}"


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend {BACKEND}, XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}"


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state."""
    keras.utils.set_random_seed(20240731)
    yield


@pytest.fixture
def tiny_config():
    """A fresh copy of the tiny ViT geometry (mutate freely)."""
    return dict(TINY)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def normal32(rng, *shape):
    """Standard normal float32 values of ``shape`` from the numpy generator ``rng``."""
    return rng.normal(size=shape).astype("float32")


def images(batch=BATCH, seed=0, size=TINY["image_size"], channels=3):
    return np.random.default_rng(seed).standard_normal((batch, size, size, channels)).astype("float32")


def videos(batch=BATCH, seed=0, frames=4, size=16, channels=3):
    """Random clips ``(batch, frames, size, size, channels)`` (TINY_VIDEO's geometry by default)."""
    return np.random.default_rng(seed).standard_normal((batch, frames, size, size, channels)).astype("float32")


def to_numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def relative_weights(model):
    """``{path without the model-name prefix: float64 array}`` of every weight."""
    prefix = model.name + "/"
    return {
        (v.path[len(prefix):] if v.path.startswith(prefix) else v.path): to_numpy(v).astype(np.float64)
        for v in model.weights
    }


def randomize_weights(layer, seed=0, scale=0.3):
    """Overwrites every float weight of ``layer`` with N(0, scale) values (LayerNorm
    gammas around 1), so that biases, class tokens, alphas... all matter.
    ``alpha`` weights get a value in (0.2, 0.8). An unbuilt layer (no weights yet) is an
    error: nothing would change, and a comparison of its outputs would prove nothing."""
    if not layer.weights:
        raise ValueError(f"randomize_weights: {layer.name} has no weights yet; build it (call it once) first.")
    rng = np.random.default_rng(seed)
    for v in layer.weights:
        if not str(v.dtype).startswith(("float", "bfloat")):
            continue
        shape = tuple(v.shape)
        name = v.path.rsplit("/", 1)[-1]
        if name == "alpha":
            value = rng.uniform(0.2, 0.8, size=shape)
        elif name == "gamma":
            value = 1.0 + scale * rng.standard_normal(shape)
        else:
            value = scale * rng.standard_normal(shape)
        v.assign(value.astype("float32"))


def fresh_python_output(script, timeout=600):
    """The last line ``script`` prints in a fresh Python process, after checking it succeeded (for
    what must not see this process's state, e.g. Triton compiling after its interpreter patched
    ``triton.language``)."""
    import subprocess

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def max_abs_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def per_example_counts(expert_index, num_experts):
    """(batch, E + 1) token counts per expert per example; last column = dropped (-1)."""
    expert_index = np.asarray(expert_index)
    counts = [(expert_index == j).sum(axis=1) for j in range(num_experts)]
    counts.append((expert_index == -1).sum(axis=1))
    return np.stack(counts, axis=1)


def run_serialization_roundtrip(model, inputs, tmp_path, atol=0.0):
    """Saves ``model`` as ``.keras``, reloads it and checks the reloaded model
    predicts the same (``atol`` 0 by default: same weights, same ops, same
    machine). Returns the reloaded model."""
    expected = to_numpy(model(inputs))
    path = os.path.join(str(tmp_path), "model.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    assert type(restored) is type(model)
    actual = to_numpy(restored(inputs))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)
    return restored


def config_roundtrip(layer):
    """``from_config(get_config())`` gives an equal config; returns the new layer."""
    config = layer.get_config()
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    return clone


def gradients(model, loss_fn, inputs, variables, graph=False, training=True):
    """d loss_fn(model(inputs, training=training)) / d variables, per backend, as numpy
    (``training=False``: an inference call's gradients, e.g. through an inference form).

    ``graph``: on tensorflow, inside a ``tf.function`` (as ``model.fit`` runs), not eagerly;
    jax always compiles, torch always runs eagerly."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def tape_gradients():
            with tf.GradientTape() as tape:
                loss = loss_fn(model(inputs, training=training))
            return tape.gradient(loss, [v.value for v in variables])

        grads = tf.function(tape_gradients)() if graph else tape_gradients()
        return [None if g is None else to_numpy(g) for g in grads]
    if BACKEND == "torch":
        import torch

        loss = loss_fn(model(inputs, training=training))
        grads = torch.autograd.grad(loss, [v.value for v in variables], allow_unused=True)
        return [None if g is None else g.detach().cpu().numpy() for g in grads]
    if BACKEND == "jax":
        import jax

        trainable = model.trainable_variables
        wanted = [next(i for i, t in enumerate(trainable) if t is v) for v in variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        @jax.jit
        def grad_fn(values):
            def loss_of(vals):
                out, _ = model.stateless_call(vals, non_trainable, inputs, training=training)
                return loss_fn(out)

            return jax.grad(loss_of)(values)

        grads = grad_fn([v.value for v in trainable])
        return [np.asarray(grads[i]) for i in wanted]
    raise NotImplementedError(BACKEND)
