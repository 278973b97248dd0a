"""Attention as one Pallas kernel that never writes the scores (issue 40: float32 attention on
jax's GPU, which cuDNN does not take): ``kernels.flash_attention`` equals a float64 numpy
softmax attention and the plain path, forward and backward, through Pallas' interpreter, and
lowers to one Triton call for a CUDA GPU without one; its products follow jax's
``default_matmul_precision``, as the grouped projection kernels' do."""

import contextlib
import functools
import io

import numpy as np
import pytest
from conftest import BACKEND, assert_f32_close

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend")


def _reference(query, key, value):
    """softmax(q k^T / sqrt(d)) v in float64, (B, N, H, d) layout."""
    q, k, v = (np.asarray(t, np.float64) for t in (query, key, value))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v)


def _inputs(seed, batch, queries, keys, heads, head_dim, dtype="float32", spread=1.0):
    rng = np.random.default_rng(seed)
    q = spread * rng.normal(size=(batch, queries, heads, head_dim))
    k, v = (rng.normal(size=(batch, keys, heads, head_dim)) for _ in range(2))
    return [np.asarray(t, "float32").astype(dtype) if dtype != "bfloat16" else _bf16(t) for t in (q, k, v)]


def _bf16(array):
    import jax.numpy as jnp

    return jnp.asarray(array, jnp.bfloat16)


# (batch, queries, keys, heads, head_dim, tiles): sequences that are not multiples of the tiles
# (ViT's 197 tokens), fewer keys than one tile, more queries than keys, the default tiles
SHAPES = [(2, 37, 37, 3, 16, (16, 16, 4, 2)), (1, 70, 45, 2, 32, (32, 16, 4, 2)), (2, 9, 5, 1, 16, (16, 16, 4, 1)),
          (1, 197, 197, 2, 64, None)]


@pytest.mark.parametrize("batch, queries, keys, heads, head_dim, tiles", SHAPES)
def test_the_kernel_equals_a_float64_softmax_attention(batch, queries, keys, heads, head_dim, tiles):
    from keras_mone.kernels.flash_attention import flash_attention

    q, k, v = _inputs(0, batch, queries, keys, heads, head_dim, spread=3.0)  # sharp softmaxes: the rescaling shows
    out = np.asarray(flash_attention(q, k, v, tiles=tiles, interpret=True))
    assert out.shape == (batch, queries, heads, head_dim)
    # float32 scores and sums over <= 197 keys: a few ulps of values of order 1
    assert_f32_close(out, _reference(q, k, v), ulps=64)


def test_every_tile_setting_equals_the_plain_path():
    from keras_mone.kernels.flash_attention import flash_attention, plain_attention

    q, k, v = _inputs(1, 2, 50, 50, 2, 32)
    expected = np.asarray(plain_attention(q, k, v))
    for tiles in [(16, 16, 4, 2), (32, 16, 4, 3), (16, 32, 8, 2), (64, 64, 4, 2)]:
        assert_f32_close(np.asarray(flash_attention(q, k, v, tiles=tiles, interpret=True)), expected, ulps=64)


def test_bfloat16_inputs_match_the_plain_path_to_bfloat16_rounding():
    import jax.numpy as jnp

    from keras_mone.kernels.flash_attention import flash_attention, plain_attention

    q, k, v = _inputs(2, 2, 40, 40, 2, 16, dtype="bfloat16")
    out = flash_attention(q, k, v, tiles=(16, 16, 4, 2), interpret=True)
    assert out.dtype == jnp.bfloat16
    got, expected = (np.asarray(t, np.float32) for t in (out, plain_attention(q, k, v)))
    # the weights are rounded to bf16 before the product with v in both: a few bf16 ulps (2^-8)
    np.testing.assert_allclose(got, expected, atol=4 * 2**-8 * float(np.abs(expected).max()))
    assert np.abs(got - _reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))).max() < 0.05


def test_gradients_equal_the_plain_paths():
    import jax

    from keras_mone.kernels.flash_attention import flash_attention, plain_attention

    q, k, v = _inputs(3, 2, 21, 21, 2, 16)
    weights = np.random.default_rng(4).normal(size=q.shape).astype("float32")

    def loss(attend):
        return lambda q, k, v: (attend(q, k, v) * weights).sum()

    kernel = jax.grad(loss(functools.partial(flash_attention, tiles=(16, 16, 4, 2), interpret=True)),
                      argnums=(0, 1, 2))(q, k, v)
    plain = jax.grad(loss(plain_attention), argnums=(0, 1, 2))(q, k, v)
    for got, expected in zip(kernel, plain):
        assert_f32_close(np.asarray(got), np.asarray(expected), ulps=64)


def test_bad_arguments_are_named():
    from keras_mone.kernels.flash_attention import flash_attention

    q, k, v = _inputs(5, 1, 8, 8, 2, 16)
    with pytest.raises(ValueError, match="`query` must be"):
        flash_attention(q[0], k, v, interpret=True)
    with pytest.raises(ValueError, match="agree in batch, heads and head_dim"):
        flash_attention(q[..., :1, :], k, v, interpret=True)
    with pytest.raises(ValueError, match="one floating dtype"):
        flash_attention(q, k.astype("float16"), v, interpret=True)
    with pytest.raises(ValueError, match=r"`head_dim` must be a power of 2 of at least 16 for the kernel, got 24"):
        flash_attention(*(np.zeros((1, 8, 2, 24), "float32"),) * 3, interpret=True)
    with pytest.raises(ValueError, match=r"`tiles` must be \(block_q, block_k, num_warps, num_stages\)"):
        flash_attention(q, k, v, tiles=(16, 8, 4, 2), interpret=True)
    with pytest.raises(ValueError, match="`tiles` must be"):
        flash_attention(q, k, v, tiles=(16, 16, 3, 2), interpret=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_vit_b16_and_vivit_attention_lower_to_one_triton_call(dtype):
    """ViT-B/16 at batch 64 (197 tokens) and ViViT-FE-B/16's spatial attention (16 frames of
    256 tokens) through Pallas' Triton lowering (power-of-2 tiles, supported ops)."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
    from keras_mone.kernels.flash_attention import flash_attention

    for shape in [(64, 197, 12, 64), (16, 256, 12, 64)]:
        spec = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))] * 3
        assert lower_for_cuda(flash_attention, *spec).count(TRITON_CALL) == 1


def _triton_module(function, *spec):
    """The Triton module(s) Pallas prints while lowering ``function`` for CUDA."""
    from jax.experimental import pallas as pl

    from keras_mone.kernels.cuda_lowering import lower_for_cuda

    original = pl.pallas_call
    pl.pallas_call = functools.partial(original, debug=True)
    try:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            lower_for_cuda(function, *spec)
    finally:
        pl.pallas_call = original
    return printed.getvalue().split("The Triton module for pallas_call", 1)[1]


def test_the_kernels_products_follow_jaxs_matmul_precision():
    """Pallas' Triton lowering takes TF32 for float32 dots unless they name HIGHEST; under
    ``jax.default_matmul_precision("highest")`` (MoNE Table 1's V100 regime, ``bench/gpu_forms.py
    --matmul-precision highest``) both kernels compute in IEEE float32, as XLA's GEMMs then do."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.flash_attention import flash_attention
    from keras_mone.kernels.grouped_gradients import grouped_weight_gradient
    from keras_mone.kernels.grouped_projection import grouped_projection

    attention = [jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.float32)] * 3
    projection = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 32, 64), (64, 64), (64,))]
    gradient = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 32, 64), (2, 32, 64))]

    def project(x, w, b):
        return grouped_projection(x, w, b, ((16, 32), (16, 64)), "in", tiles=(16, 32, 16, 4, 2))

    def weight_gradient(x, dy):  # (the training step's dW and db kernel)
        return grouped_weight_gradient(x, dy, ((16, 32), (16, 64)), "in", tiles=(16, 16, 32, 4, 2), bias=True)

    def dots(function, spec):  # the tt.dot lines (Triton prints IEEE, its default, without an attribute)
        return [line for line in _triton_module(function, *spec).splitlines() if "tt.dot" in line]

    for function, spec in [(flash_attention, attention), (project, projection), (weight_gradient, gradient)]:
        default = dots(function, spec)
        assert default and all("inputPrecision = tf32" in line for line in default)
        with jax.default_matmul_precision("highest"):
            highest = dots(function, spec)
        assert len(highest) == len(default) and not any("inputPrecision" in line for line in highest)


def test_float32_without_tf32_is_read_under_each_of_its_names():
    import jax

    from keras_mone.kernels.precision import precision_name

    for name, expected in [("highest", "highest"), ("float32", "highest"), ("F32_F32_F32", "highest"),
                           ("default", "default"), ("tensorfloat32", "default"), ("bfloat16", "default")]:
        with jax.default_matmul_precision(name):
            assert precision_name() == expected, name


def test_the_roofline_counts_the_kernels_work_from_its_name():
    from keras_mone.bench.hlo_kernels import _pallas_traffic
    from keras_mone.kernels.flash_attention import kernel_label, labelled_cost

    name = kernel_label(16, 257, 257, 12, 64)
    assert name == "flash_attention_b16_q257_k257_h12_d64"
    flops, moved = labelled_cost(name, 4)
    assert flops == 4 * 16 * 12 * 257 * 257 * 64
    assert moved == 4 * 4 * 16 * 257 * 12 * 64  # q, k, v and the output, once each
    assert _pallas_traffic(name, "f32[4112,768]", []) == (flops, moved)
    assert labelled_cost("grouped_in_projection_k768_n768_b1_g4x96", 4) is None


def test_tiles_from_the_environment_reach_the_kernel(monkeypatch):
    """``$KERAS_MONE_ATTENTION_TILES`` (a card's screen, ``bench/attention_tiles.py``) names tiles
    per queries x keys; other shapes keep the default; a malformed or unlaunchable entry is
    refused naming the variable; tiles given to the call win over the variable."""
    from keras_mone.kernels import flash_attention as kernel

    seen = []
    original = kernel._jitted
    monkeypatch.setattr(kernel, "_jitted", lambda *a: seen.append(a[3]) or original(*a))
    q, k, v = _inputs(12, 2, 37, 37, 2, 16)
    expected = _reference(q, k, v)
    monkeypatch.setenv(kernel.TILES_ENV, "37x37=32,16,4,1;9x9=16,16,1,2")
    assert_f32_close(np.asarray(kernel.flash_attention(q, k, v, interpret=True)), expected, ulps=64)
    assert seen[-1] == (32, 16, 4, 1)
    kernel.flash_attention(*_inputs(12, 1, 20, 20, 1, 16), interpret=True)
    assert seen[-1] == kernel.default_tiles(16, np.float32)
    kernel.flash_attention(q, k, v, tiles=(16, 16, 4, 2), interpret=True)
    assert seen[-1] == (16, 16, 4, 2)
    monkeypatch.setenv(kernel.TILES_ENV, "37x37=32,8,4,1")
    with pytest.raises(ValueError, match=r"\$KERAS_MONE_ATTENTION_TILES: tiles must be .* got \(32, 8, 4, 1\)"):
        kernel.flash_attention(q, k, v, interpret=True)
    monkeypatch.setenv(kernel.TILES_ENV, "37=32,16,4,1")
    with pytest.raises(ValueError, match=r"\$KERAS_MONE_ATTENTION_TILES entries must read QxK=.*257x257=64,64,4,2"):
        kernel.flash_attention(q, k, v, interpret=True)


def test_the_tile_screen_runs_and_names_the_winners_as_the_variable_reads_them(monkeypatch, capsys):
    """``bench/attention_tiles.py`` at a tiny size, interpreted: every setting checked against
    XLA's attention and timed, one the kernel cannot take listed as failed, each sequence
    length's winner printed as $KERAS_MONE_ATTENTION_TILES, which the kernel then reads."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import attention_tiles

    from keras_mone.kernels import flash_attention as kernel

    attention_tiles.main(["--shapes", "2x37,1x9,3x9", "--heads", "2", "--head-dim", "16", "--repeats", "1",
                          "--tiles", "16,16,4,2;16,8,4,2"])
    report = capsys.readouterr().out
    assert report.count("| plain (XLA) |") == 3 and report.count("failed: ValueError") == 3
    assert "wrong" not in report
    value = report.split(f'{kernel.TILES_ENV}="')[1].split('"')[0]
    assert [entry.split("=")[0] for entry in value.split(";")] == ["37x37", "9x9"]
    monkeypatch.setenv(kernel.TILES_ENV, value)
    assert kernel.tile_override(37, 37) in [(16, 16, 4, 2), kernel.default_tiles(16, np.float32)]
    with pytest.raises(SystemExit):
        attention_tiles.main(["--shapes", "2x"])
    assert "--shapes must read batch x tokens" in capsys.readouterr().err
