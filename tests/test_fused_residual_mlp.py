"""The fused MLP half of a MoNE block (issue 40 item 4): ``z + s Pad(FFN_d(LN2(z)))`` from one
Pallas kernel equals the numpy reference of Eq. 1 / Eq. 6 and the plain path, forward and
backward, through Pallas' interpreter, and lowers to Triton for a CUDA GPU without one."""

import re

import numpy as np
import pytest
from conftest import BACKEND, assert_f32_close

import numpy_reference as ref

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend")


def _arguments(rows=200, dim=96, hidden=384, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.normal(size=shape).astype("float32")  # noqa: E731
    z = normal(rows, dim)
    gamma, beta = 1.0 + 0.1 * normal(dim), 0.1 * normal(dim)
    w1, b1, w2, b2 = 0.1 * normal(dim, hidden), 0.1 * normal(hidden), 0.1 * normal(hidden, dim), 0.1 * normal(dim)
    scale = (1.0 + 0.5 * rng.random(rows)).astype("float32")  # MoNE's alpha g + 1
    return z, gamma, beta, w1, b1, w2, b2, scale


def _exact_gelu(x):
    import jax

    return jax.nn.gelu(x, approximate=False)


@pytest.mark.parametrize("width", [12, 24, 48])
@pytest.mark.parametrize("scaled", [True, False])
def test_kernel_equals_the_numpy_reference_of_eq1(width, scaled):
    from keras_mone.kernels.fused_residual_mlp import fused_residual_mlp

    z, gamma, beta, w1, b1, w2, b2, scale = _arguments()
    out = np.asarray(fused_residual_mlp(z, gamma, beta, w1, b1, w2, b2, scale if scaled else None, width,
                                        _exact_gelu, interpret=True))
    normed = ref.layer_norm(z, gamma, beta)
    update = ref.mlp(normed[None], [width] * len(z), w1, b1, w2, b2)[0]
    expected = z + (scale[:, None] if scaled else 1.0) * update
    assert out.shape == z.shape
    assert_f32_close(out, expected)
    assert np.array_equal(out[:, width:], z[:, width:])  # features past d are the input's own, untouched


@pytest.mark.parametrize("offset", [100.0, 1000.0])
def test_the_layer_norm_statistics_hold_for_rows_far_from_zero(offset):
    """The kernel sums each row's statistics piece by piece (``row_statistics``: each piece's
    mean and squared deviations, then combined). For rows whose mean is 100 or 1000 standard
    deviations from zero, where a one-pass variance would lose every digit, it is as close to
    the float64 reference as the plain path's two passes (measured: 1.2x at 100, 1.0x at 1000)."""
    from keras_mone.kernels.fused_residual_mlp import fused_residual_mlp, plain_residual_mlp

    z, gamma, beta, w1, b1, w2, b2, scale = _arguments()
    z = z + np.float32(offset)
    out = np.asarray(fused_residual_mlp(z, gamma, beta, w1, b1, w2, b2, scale, 24, _exact_gelu, interpret=True))
    plain = np.asarray(plain_residual_mlp(z, gamma, beta, w1, b1, w2, b2, scale, 24, _exact_gelu, 1e-6))
    normed = ref.layer_norm(z.astype("float64"), gamma, beta)
    update = ref.mlp(normed[None], [24] * len(z), w1, b1, w2, b2)[0]
    expected = z.astype("float64") + scale[:, None] * update
    error = np.abs(out - expected).max()
    assert error <= 1.5 * np.abs(plain - expected).max()
    assert error <= 8 * np.spacing(np.float32(np.abs(z).max()))  # a few ulps of the rows' magnitude


@pytest.mark.parametrize("blocks", [(None, None), (16, 32)])
def test_gradients_equal_the_plain_paths(blocks):
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.fused_residual_mlp import fused_residual_mlp, plain_residual_mlp

    arguments = _arguments(rows=72)
    cotangent = np.random.default_rng(3).normal(size=(72, 96)).astype("float32")

    def loss(fn, **kw):  # squared: the backward pass sees the kernel's own outputs
        return lambda *a: jnp.sum(jnp.square(fn(*a, 24, _exact_gelu, **kw) - cotangent))

    fused = jax.grad(loss(fused_residual_mlp, block_rows=blocks[0], block_hidden=blocks[1], interpret=True),
                     argnums=range(8))(*arguments)
    plain = jax.grad(loss(plain_residual_mlp, epsilon=1e-6), argnums=range(8))(*arguments)
    for got, want in zip(fused, plain):
        assert got.shape == want.shape
        assert_f32_close(np.asarray(got), np.asarray(want))


def test_bad_arguments_are_named():
    from keras_mone.kernels.fused_residual_mlp import fused_residual_mlp

    z, gamma, beta, w1, b1, w2, b2, scale = _arguments(rows=8)
    with pytest.raises(ValueError, match=r"`gamma` and `beta` must have shape \(96,\)"):
        fused_residual_mlp(z, gamma[:8], beta, w1, b1, w2, b2, scale, 24, _exact_gelu, interpret=True)
    with pytest.raises(ValueError, match=r"`scale` must have shape \(8,\) \(one factor per row\) or be None"):
        fused_residual_mlp(z, gamma, beta, w1, b1, w2, b2, scale[:4], 24, _exact_gelu, interpret=True)
    with pytest.raises(ValueError, match=r"`width` must lie in \[1, 96\]"):
        fused_residual_mlp(z, gamma, beta, w1, b1, w2, b2, scale, 0, _exact_gelu, interpret=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_lowers_to_triton_for_a_cuda_gpu(dtype):
    """ViT-B/16's nested groups (d = 96, 192, 384) through Pallas' Triton lowering for CUDA."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
    from keras_mone.kernels.fused_residual_mlp import fused_residual_mlp
    from keras_mone.layers.mlp import _kernel_gelu

    shapes = ((256 * 84, 768), (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,), (256 * 84,))
    spec = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape in shapes]
    for width in (96, 192, 384):
        def half(*arguments, width=width):
            return fused_residual_mlp(*arguments, width, _kernel_gelu(False))

        assert lower_for_cuda(half, *spec).count(TRITON_CALL) == 1


def test_the_gpu_check_script_runs_and_bounds_hold(monkeypatch):
    """``bench/kernel_check.py`` (run first by ``bench/gpu.sh``) at a tiny size, interpreted."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import kernel_check

    for dtype in ("float32", "bfloat16"):
        errors = kernel_check.check(16, dtype, rows=40, dim=64, hidden=128, interpret=True)
        assert set(errors) == {"fused MLP", "fused half", "fused half, gradients"}
        assert max(errors.values()) <= kernel_check.BOUNDS[dtype]


def test_the_roofline_model_orders_the_forms(monkeypatch):
    """``bench/roofline.py`` (BENCHMARKS.md's model): dense and MoNE at full capacity cost the
    same; each fused form saves time over the one before; MLP time is dense's at width D."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import roofline

    def total(groups, form="plain"):
        return sum(roofline.block_time(groups, 256, "h200", form).values())

    dense = total([(roofline.TOKENS, roofline.D)])
    assert total([(roofline.TOKENS, roofline.D)], "fused half") == dense  # full width: no kernel
    groups = [(84, 96), (62, 192), (37, 384), (14, 768)]  # e_c 0.3 (the capacity solver's counts)
    plain, fused_mlp, fused_half = (total(groups, form) for form in roofline.FORMS)
    assert dense > plain > fused_mlp > fused_half
    assert 1.4 < dense / plain < 1.7 and 2.3 < dense / fused_half < 2.6  # BENCHMARKS.md: 1.54x, 2.44x


def test_an_empty_token_group_launches_nothing():
    import jax.numpy as jnp

    from keras_mone.kernels.fused_nested_mlp import fused_nested_mlp
    from keras_mone.kernels.fused_residual_mlp import fused_residual_mlp

    z, gamma, beta, w1, b1, w2, b2, _ = _arguments(rows=0)
    assert fused_residual_mlp(z, gamma, beta, w1, b1, w2, b2, None, 24, _exact_gelu, interpret=True).shape == (0, 96)
    assert fused_nested_mlp(z, w1, b1, w2, b2, 24, _exact_gelu, interpret=True).shape == (0, 24)
    assert fused_nested_mlp(jnp.asarray(z), w1, b1, w2, b2, 24, _exact_gelu, interpret=True).dtype == jnp.float32


def _tiny_mone_block(name, seed):
    """A built MoNE ``ViTBlock`` (D = 32, H = 64) and two token groups (5 and 3 tokens) with gates."""
    from keras_mone.layers.block import ViTBlock

    block = ViTBlock(32, 4, 64, gate="mone", name=name)
    block.build((None, None, 32))
    rng = np.random.default_rng(seed)
    groups = [rng.normal(size=(2, n, 32)).astype("float32") for n in (5, 3)]
    gates = [rng.random((2, n)).astype("float32") for n in (5, 3)]
    return block, groups, gates


def test_tiles_from_the_environment_reach_the_kernel_and_change_no_value(monkeypatch):
    """``$KERAS_MONE_MLP_TILES`` (what ``bench/kernel_tiles.py`` prints) sets a width's tiles; a
    ``ViTBlock`` with them gives the plain block's outputs."""
    import keras

    from keras_mone.kernels import fused_residual_mlp as kernel
    from keras_mone.kernels.tiles import TILES_ENV, tile_override
    from keras_mone.layers import platform_forms

    monkeypatch.setenv(TILES_ENV, "8:16,32,4,3; 16:32,64,8,2")
    assert tile_override(16) == (32, 64, 8, 2) and tile_override(8) == (16, 32, 4, 3) and tile_override(32) is None
    block, groups, gates = _tiny_mone_block("tiled", seed=9)
    seen = []
    original = kernel.fused_residual_mlp
    monkeypatch.setattr(kernel, "fused_residual_mlp", lambda *a, **k: seen.append(k) or original(*a, **k))
    monkeypatch.setenv(platform_forms.MLP_ENV, "fused")
    fused = [keras.ops.convert_to_numpy(x) for x in block(groups, widths=[16, 32], gates=gates)]
    monkeypatch.setenv(platform_forms.MLP_ENV, "plain")
    plain = [keras.ops.convert_to_numpy(x) for x in block(groups, widths=[16, 32], gates=gates)]
    assert [(k["block_rows"], k["block_hidden"], k["num_warps"], k["num_stages"]) for k in seen] == [(32, 64, 8, 2)]
    for got, want in zip(fused, plain):
        assert_f32_close(got, want, ulps=64)

    # a width named `plain` (XLA beat every tile on the card) keeps the plain path: no kernel call
    monkeypatch.setenv(TILES_ENV, "16:plain")
    assert tile_override(16) == "plain"
    seen.clear()
    monkeypatch.setenv(platform_forms.MLP_ENV, "fused")
    kept = [keras.ops.convert_to_numpy(x) for x in block(groups, widths=[16, 32], gates=gates)]
    assert seen == []
    for got, want in zip(kept, plain):
        np.testing.assert_array_equal(got, want)


def test_a_width_whose_default_tile_does_not_pay_keeps_the_plain_path_unless_its_tiles_are_named(monkeypatch):
    """``kernel_pays`` false (ViT-B/16's d = 384, where XLA's path beat every tile on an H200):
    the plain path, unless ``$KERAS_MONE_MLP_TILES``
    names that width's tiles (a card's screen found some that pay)."""
    import keras

    from keras_mone.kernels import fused_nested_mlp, tiles
    from keras_mone.kernels import fused_residual_mlp as kernel
    from keras_mone.kernels.tiles import TILES_ENV
    from keras_mone.layers import platform_forms

    block, groups, gates = _tiny_mone_block("paying", seed=3)
    seen = []
    original = kernel.fused_residual_mlp
    monkeypatch.setattr(kernel, "fused_residual_mlp", lambda *a, **k: seen.append(a[8]) or original(*a, **k))
    monkeypatch.setattr(tiles, "kernel_pays", lambda width, hidden, itemsize=2, kernel="mlp": width != 16)
    monkeypatch.setenv(platform_forms.MLP_ENV, "fused")
    monkeypatch.delenv(TILES_ENV, raising=False)
    unpaid = [keras.ops.convert_to_numpy(x) for x in block(groups, widths=[16, 32], gates=gates)]
    assert seen == []  # d = 16 plain; d = 32 is the full width, XLA's anyway
    monkeypatch.setenv(TILES_ENV, "16:16,32,4,2")
    named = [keras.ops.convert_to_numpy(x) for x in block(groups, widths=[16, 32], gates=gates)]
    assert seen == [16]  # named: the kernel runs at that width
    for got, want in zip(named, unpaid):
        assert_f32_close(got, want, ulps=64)

    # the MLP kernel alone (KERAS_MONE_MLP=mlp_kernel) follows the same rule
    mlp_calls = []
    alone = fused_nested_mlp.fused_nested_mlp
    monkeypatch.setattr(fused_nested_mlp, "fused_nested_mlp", lambda *a, **k: mlp_calls.append(a[5]) or alone(*a, **k))
    monkeypatch.setenv(platform_forms.MLP_ENV, "mlp_kernel")
    for setting, expected in (("", []), ("16:plain", []), ("16:16,32,4,2", [16])):
        monkeypatch.setenv(TILES_ENV, setting)
        mlp_calls.clear()
        outputs = [keras.ops.convert_to_numpy(x) for x in block(groups, widths=[16, 32], gates=gates)]
        assert mlp_calls == expected, setting
        for got, want in zip(outputs, unpaid):
            assert_f32_close(got, want, ulps=64)


def test_a_malformed_tile_setting_is_named(monkeypatch):
    from keras_mone.kernels.tiles import TILES_ENV, tile_override

    for value in ("96:128,64,4", "abc:1,2,3,4", "96:0,64,4,3", "96:128,64,4,3;junk", "96:plain,1", "0:plain"):
        monkeypatch.setenv(TILES_ENV, value)
        with pytest.raises(ValueError, match=r"\$KERAS_MONE_MLP_TILES entries are width:block_rows,block_hidden"):
            tile_override(192)  # the whole value is checked, whichever width is asked for
    monkeypatch.setenv(TILES_ENV, "96:128,64,4,3;96:64,64,4,3")
    with pytest.raises(ValueError, match="names width 96 twice"):
        tile_override(96)


def test_the_tile_sweep_script_runs(monkeypatch, capsys):
    """``bench/kernel_tiles.py`` (``bench/gpu.sh``'s kernel_tiles run) at a tiny size, interpreted."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import kernel_tiles

    kernel_tiles.main(["--rows", "32", "--repeats", "1", "--dim", "64", "--hidden", "128", "--widths", "16",
                       "--grid", "16:64:4:2"])
    out = capsys.readouterr().out
    assert "| 16 | 32 | plain (XLA) |" in out and "| 16 | 32 | (16, 64, 4, 2) |" in out
    # a tile where it beat the (compiled) plain path, else `plain` (the interpreter is slow)
    assert re.search(r'KERAS_MONE_MLP_TILES="16:(plain|\d+,\d+,\d+,\d+)"', out)


def test_the_tile_sweep_takes_the_screened_tiles_of_a_width_unless_given_a_grid(monkeypatch, capsys):
    """Without ``--grid`` a width listed in ``SCREENED`` (tiles compiled for sm_90 without spills)
    is swept over those tiles and its default only."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import kernel_tiles

    monkeypatch.setattr(kernel_tiles, "SCREENED", {"residual": {16: [(32, 64, 4, 2)]}, "mlp": {}})
    kernel_tiles.main(["--rows", "32", "--repeats", "1", "--dim", "64", "--hidden", "128", "--widths", "16"])
    swept = [line.split("|")[3].strip() for line in capsys.readouterr().out.splitlines()
             if line.startswith("| 16 | 32 |")]
    default = str(kernel_tiles.default_tiles(16, 128, 2, "residual"))
    assert swept == ["plain (XLA)", default, "(32, 64, 4, 2)"]


def test_the_tile_sweep_never_picks_a_setting_whose_output_is_wrong(monkeypatch, capsys):
    """A tile setting whose kernel is fast but off the plain path (a miscompile, say) is listed
    as wrong, with its error, and the best setting is chosen among the others."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import kernel_tiles

    right = kernel_tiles.fused_residual_mlp

    def off_for_32_rows(*arguments, block_rows=None, **settings):
        out = right(*arguments, block_rows=block_rows, **settings)
        return out + 0.5 if block_rows == 32 else out

    monkeypatch.setattr(kernel_tiles, "fused_residual_mlp", off_for_32_rows)
    kernel_tiles.main(["--rows", "32", "--repeats", "1", "--dim", "64", "--hidden", "128", "--widths", "16",
                       "--grid", "16,32:64:4:2"])
    rows = {line.split("|")[3].strip(): line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 16 |")}
    assert rows["(32, 64, 4, 2)"][7].strip().startswith("wrong: error")
    assert float(rows["(32, 64, 4, 2)"][6]) > kernel_tiles.BOUNDS["bfloat16"]
    assert not rows["(16, 64, 4, 2)"][7].strip().startswith("wrong")
    assert float(rows["(16, 64, 4, 2)"][6]) <= kernel_tiles.BOUNDS["bfloat16"]
    (best,) = [key.removeprefix("**best** ") for key in rows if key.startswith("**best**")]
    assert best in rows and best != "(32, 64, 4, 2)" and not rows[best][7].strip().startswith("wrong")

    # every setting off: the width is named and left out of the printed tiles (its defaults stay)
    monkeypatch.setattr(kernel_tiles, "fused_residual_mlp", lambda *a, **kw: right(*a, **kw) + 0.5)
    kernel_tiles.main(["--rows", "32", "--repeats", "1", "--dim", "64", "--hidden", "128", "--widths", "16",
                       "--grid", "16:64:4:2"])
    out = capsys.readouterr().out
    # every setting off: the tuned model keeps the plain path at that width
    assert "no tile setting both ran and matched the plain path" in out and 'KERAS_MONE_MLP_TILES="16:plain"' in out


def test_the_tile_sweep_keeps_the_plain_path_where_it_beats_every_tile(monkeypatch, capsys):
    """A width where XLA's path ran faster than every tile is printed as ``plain``, so the
    tuned model runs the kernel only where it pays on the card."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import kernel_tiles

    # per width: the plain path's ms, then its default tile's and the grid's two
    timed = iter([1.0, 2.0, 3.0, 2.5] + [4.0, 0.5, 0.6, 0.7])  # d=16: plain fastest; d=32: a tile
    monkeypatch.setattr(kernel_tiles, "median_ms", lambda *a: next(timed))
    kernel_tiles.main(["--rows", "32", "--repeats", "1", "--dim", "64", "--hidden", "128", "--widths", "16,32",
                       "--grid", "16,32:64:4:2"])
    out = capsys.readouterr().out
    assert "| 16 | | **plain (XLA) is faster than every tile**: plain |" in out
    assert 'KERAS_MONE_MLP_TILES="16:plain;32:' in out and "32:plain" not in out


def test_the_compile_screen_counts_the_work_a_loop_pass_issues():
    """``bench/kernel_compile.py`` reads the hidden-block loop out of the PTX and counts what one
    pass issues: MMA FLOPs against the block's ``4 d rows block_hidden``, divisions (one per
    GELU) and float32 operations per hidden element. A warpgroup MMA is issued once per 4
    warps, ``mma.sync`` once per warp; instructions outside the loop are not counted."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import kernel_compile

    ptx = """
    mov.u32 %r1, 0;
    div.full.f32 %r9, %r1, %r2;
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
    wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%r3}, %rd1, %rd2, 1, 1, 1, 0, 0;
    wgmma.commit_group.sync.aligned;
    fma.rn.f32 %r4, %r5, %r6, %r7;
    @%p1 mul.f32 %r4, %r4, %r4;
    div.full.f32 %r8, %r4, %r5;
    .loc 1 2 3
    @%p2 bra $L__BB0_1;
    ret;
"""
    assert kernel_compile.inner_loop(ptx) == [
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16", "wgmma.commit_group.sync.aligned", "fma.rn.f32",
        "mul.f32", "div.full.f32", "bra"]
    # 8 warps = 2 warpgroups, each issuing one 64x32x16 MMA; a 16 x 8 hidden block at d = 4
    work = kernel_compile.loop_work(kernel_compile.inner_loop(ptx), width=4, block_rows=16, block_hidden=8,
                                    num_warps=8)
    assert work["tensor_issued_over_needed"] == 2 * (2 * 64 * 32 * 16) / (4 * 4 * 16 * 8)
    assert work["divisions_per_element"] == 256 / (16 * 8)  # every thread divides once: 2 per element
    assert work["float_per_element"] == 2 * 256 / (16 * 8)
    sync = kernel_compile.loop_work(["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"], 4, 16, 8, 2)
    assert sync["tensor_issued_over_needed"] == 2 * (2 * 16 * 8 * 16) / (4 * 4 * 16 * 8)
    assert kernel_compile.inner_loop("ret;") == []
    assert all(np.isnan(v) for v in kernel_compile.loop_work([], 4, 16, 8, 8).values())  # no loop: not zeros
    opcodes = ("fma.rn.ftz.f32", "cvt.rn.bf16x2.f32", "cvt.u64.u32", "add.s32", "mul.rn.f32")
    assert [bool(kernel_compile._FLOAT_OP.match(o)) for o in opcodes] == [True, True, False, False, True]
