"""The grouped nested projections' weight-gradient kernel (issue 40: the training step):
``kernels.grouped_gradients.grouped_weight_gradient``, ``dW`` and ``db`` of every token group
in one launch, equals a float64 numpy reference and the plain path through Pallas'
interpreter (with its row scale, LayerNorm prologue and cotangents in parts, at every tile
setting and split), lowers to one Triton call per weight of a ViT-B/16 block for a CUDA GPU
without one, takes its tiles from the environment and its screen, names bad arguments, and
states its work in its name."""

import numpy as np
import pytest
from conftest import BACKEND, assert_f32_close, normal32

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend")

SMALL = (16, 16, 32, 4, 2)  # (block_rows, block_k, block_n, warps, stages): several tiles per axis here
LAYOUTS = [((5, 16), (0, 32), (7, 40), (4, 64)), ((11, 8),), ((3, 64), (9, 24))]


def _numpy_weight_gradient(x, dy, layout, side):
    """sum over groups of x_g[:, :d]^T dy_g (in) or x_g^T dy_g[:, :d] (out), float64."""
    out, start = np.zeros((x.shape[-1], dy.shape[-1])), 0
    for size, width in layout:
        rows = x[:, start:start + size].reshape(-1, x.shape[-1]).astype("float64")
        upstream = dy[:, start:start + size].reshape(-1, dy.shape[-1]).astype("float64")
        if side == "in":
            out[:width] += rows[:, :width].T @ upstream
        else:
            out[:, :width] += rows.T @ upstream[:, :width]
        start += size
    return out


@pytest.mark.parametrize("side", ["in", "out"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("splits", [1, 3])
def test_the_weight_gradient_equals_the_numpy_reference(side, layout, splits):
    from keras_mone.kernels.grouped_gradients import grouped_weight_gradient, plain_weight_gradient

    rng = np.random.default_rng(0)
    tokens = sum(size for size, _ in layout)
    x, dy = normal32(rng, 3, tokens, 64), normal32(rng, 3, tokens, 64)
    got = np.asarray(grouped_weight_gradient(x, dy, layout, side, tiles=SMALL, splits=splits, interpret=True))
    expected = _numpy_weight_gradient(x, dy, layout, side)
    # float32 sums of <= 3 x 16 products per element: a few ulps of the largest sum
    assert_f32_close(got, expected, ulps=64)
    assert_f32_close(np.asarray(plain_weight_gradient(x, dy, layout, side)), expected, ulps=64)


@pytest.mark.parametrize("side", ["in", "out"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("splits", [1, 3])
def test_the_bias_gradient_comes_from_the_weight_gradients_launch(side, layout, splits):
    """``bias=True``: the column sums of ``dy`` (an out-projection's group only its first ``d``
    columns) from the first row tile's programs, equal to a float64 numpy reference; ``dW``
    unchanged."""
    from keras_mone.kernels.grouped_gradients import grouped_weight_gradient, plain_bias_gradient

    rng = np.random.default_rng(5)
    tokens = sum(size for size, _ in layout)
    x, dy = normal32(rng, 3, tokens, 64), 1.0 + normal32(rng, 3, tokens, 64)
    dw, db = grouped_weight_gradient(x, dy, layout, side, tiles=SMALL, splits=splits, interpret=True, bias=True)
    expected, start = np.zeros(64), 0
    for size, width in layout:
        columns = 64 if side == "in" else width
        expected[:columns] += dy[:, start:start + size, :columns].astype("float64").sum(axis=(0, 1))
        start += size
    assert_f32_close(np.asarray(db), expected, ulps=64)
    assert_f32_close(np.asarray(plain_bias_gradient(dy, layout, side)), expected, ulps=64)
    assert_f32_close(np.asarray(dw), _numpy_weight_gradient(x, dy, layout, side), ulps=64)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_weight_gradient_scales_dy_per_row_as_it_loads_it(gated, dtype):
    """``scale``: a gated fc2's ``dW`` and ``db`` from ``dy`` scaled per row in the kernel
    (``alpha g + 1``, or a factor) equal those of ``(factor * dy)`` rounded to ``dy``'s dtype, as
    the plain path's scaled cotangent was, at several splits."""
    import jax.numpy as jnp

    from keras_mone.kernels.grouped_gradients import grouped_weight_gradient, plain_bias_gradient

    rng = np.random.default_rng(21)
    layout = ((5, 16), (0, 32), (7, 40), (4, 64))
    x, dy = (jnp.asarray(normal32(rng, 3, 16, 64), dtype) for _ in range(2))
    gate, alpha = rng.random((3, 16)).astype("float32"), np.float32(0.6)
    factor = alpha * gate + 1.0 if gated else gate
    scaled = (dy.astype(jnp.float32) * factor[..., None]).astype(dtype)
    for splits in (1, 3):
        dw, db = grouped_weight_gradient(x, dy, layout, "out", tiles=SMALL, splits=splits, interpret=True, bias=True,
                                         scale=(gate, alpha) if gated else gate)
        expected = grouped_weight_gradient(x, scaled, layout, "out", tiles=SMALL, splits=splits, interpret=True)
        assert_f32_close(np.asarray(dw), np.asarray(expected), ulps=64)
        assert_f32_close(np.asarray(db), np.asarray(plain_bias_gradient(scaled, layout, "out")), ulps=64)
    with pytest.raises(ValueError, match=r"`scale` must be \(batch, tokens\)"):
        grouped_weight_gradient(x, dy, layout, "out", interpret=True, scale=gate[0])
    with pytest.raises(ValueError, match=r"`scale` must be \(batch, tokens\)"):
        grouped_weight_gradient(x, dy, layout, "out", interpret=True, scale=(gate, np.ones(2, "float32")))


def test_the_weight_gradient_normalises_its_rows_with_the_layernorms_prologue():
    """``norm``: ``x`` normalised tile by tile as loaded (the normalised tokens never written for
    it) gives what ``normalized(x)`` gives, at several splits and in bf16; one Triton call for
    CUDA; the prologue refused on side "out" and with misshapen statistics, by name."""
    import jax.numpy as jnp

    from keras_mone.kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
    from keras_mone.kernels.grouped_gradients import grouped_weight_gradient
    from keras_mone.kernels.grouped_kernel import normalized

    rng = np.random.default_rng(10)
    layout = ((5, 16), (0, 32), (7, 48), (2, 64))
    x, dy = 2.0 + normal32(rng, 3, 14, 64), normal32(rng, 3, 14, 96)
    norm = (x.mean(-1), 1.0 / np.sqrt(x.var(-1) + 1e-6), 1.0 + 0.1 * normal32(rng, 64), 0.1 * normal32(rng, 64))
    for dtype, splits in (("float32", 1), ("float32", 3), ("bfloat16", 2)):
        rows, upstream = jnp.asarray(x, dtype), jnp.asarray(dy, dtype)
        got = grouped_weight_gradient(rows, upstream, layout, "in", tiles=SMALL, splits=splits, interpret=True,
                                      bias=True, norm=norm)
        expected = grouped_weight_gradient(normalized(rows, *norm), upstream, layout, "in", tiles=SMALL,
                                           splits=splits, interpret=True, bias=True)
        for got_one, expected_one in zip(got, expected):  # the same rounded rows, the same sums
            assert_f32_close(np.asarray(got_one), np.asarray(expected_one), ulps=8)
    text = lower_for_cuda(lambda x, dy, *norm: grouped_weight_gradient(x, dy, layout, "in", tiles=SMALL, norm=norm),
                          x, dy, *norm)
    assert text.count(TRITON_CALL) == 1 and "weight_gradient_norm_k64" in text
    with pytest.raises(ValueError, match="`norm` belongs to side 'in'"):
        grouped_weight_gradient(x, dy[..., :64], ((5, 16), (9, 48)), "out", interpret=True, norm=norm)
    with pytest.raises(ValueError, match="`norm` belongs to side 'in'"):
        grouped_weight_gradient(x, dy, layout, "in", interpret=True, norm=norm[:3])


def test_the_weight_gradient_reads_dy_in_parts():
    """q, k and v's cotangents as three parts: ``dW`` and ``db`` equal those of the joined ``dy``,
    and the launch lowers to one Triton call; parts of unequal shapes are refused by name."""
    from keras_mone.kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
    from keras_mone.kernels.grouped_gradients import grouped_weight_gradient

    rng = np.random.default_rng(7)
    layout = ((5, 16), (0, 32), (7, 48), (2, 64))
    x, parts = normal32(rng, 2, 14, 64), tuple(normal32(rng, 2, 14, 32) for _ in range(3))
    joined = np.concatenate(parts, axis=-1)
    for side in ("in", "out"):
        got = grouped_weight_gradient(x, parts, layout, side, tiles=SMALL, splits=2, interpret=True, bias=True)
        expected = grouped_weight_gradient(x, joined, layout, side, tiles=SMALL, splits=2, interpret=True, bias=True)
        for got_one, expected_one in zip(got, expected):
            np.testing.assert_array_equal(np.asarray(got_one), np.asarray(expected_one))
    assert_f32_close(np.asarray(got[0]), _numpy_weight_gradient(x, joined, layout, "out"), ulps=64)
    text = lower_for_cuda(lambda x, *parts: grouped_weight_gradient(x, parts, layout, "in", tiles=SMALL, bias=True),
                          x, *parts)
    assert text.count(TRITON_CALL) == 1
    with pytest.raises(ValueError, match="or equal parts of it"):
        grouped_weight_gradient(x, (parts[0], parts[1][:, :, :16]), layout, "in", interpret=True)


@pytest.mark.parametrize("tiles", [(16, 16, 16, 4, 1), (32, 32, 16, 4, 2), (64, 64, 64, 8, 3)])
def test_every_tile_setting_and_the_default_split_equal_the_plain_path(tiles):
    from keras_mone.kernels.grouped_gradients import grouped_weight_gradient, plain_weight_gradient

    rng = np.random.default_rng(1)
    layout = ((21, 16), (13, 32), (6, 64))
    x, dy = normal32(rng, 2, 40, 64), normal32(rng, 2, 40, 128)
    for side in ("in", "out"):
        expected = np.asarray(plain_weight_gradient(x, dy, layout, side))
        assert_f32_close(np.asarray(grouped_weight_gradient(x, dy, layout, side, tiles=tiles, interpret=True)),
                         expected, ulps=64)


def test_the_default_splits_fill_the_card():
    from keras_mone.kernels.grouped_gradients import TARGET_PROGRAMS, default_splits, default_weight_tiles

    for k, n in [(768, 768), (768, 2304), (768, 3072), (3072, 768)]:
        tiles = default_weight_tiles(k, n, "bfloat16")
        programs = (k // tiles[1]) * (n // tiles[2]) * default_splits(k, n, tiles)
        assert programs >= TARGET_PROGRAMS or default_splits(k, n, tiles) == 16
    assert default_splits(768, 768, (64, 128, 128, 8, 3)) == 8  # 36 output tiles


def test_weight_gradient_tiles_from_the_environment_reach_the_kernel(monkeypatch):
    """``$KERAS_MONE_WEIGHT_GRADIENT_TILES`` (a card's screen, ``bench/weight_gradient_tiles.py``)
    names tiles per weight shape; q/k/v's entry is keyed by the whole weight, its tiles checked
    against one part; a malformed or unlaunchable entry is refused naming the variable."""
    from keras_mone.kernels import grouped_gradients

    seen = []
    original = grouped_gradients._weight_gradient
    monkeypatch.setattr(grouped_gradients, "_weight_gradient", lambda *a: seen.append(a[6]) or original(*a))
    rng = np.random.default_rng(9)
    layout = ((5, 16), (7, 48), (2, 64))
    x, parts = normal32(rng, 2, 14, 64), tuple(normal32(rng, 2, 14, 32) for _ in range(3))
    expected = grouped_gradients.grouped_weight_gradient(x, parts, layout, "in", interpret=True)
    monkeypatch.setenv(grouped_gradients.WEIGHT_TILES_ENV, "64x32=16,16,16,4,2;64x96=16,32,32,4,1")
    got = grouped_gradients.grouped_weight_gradient(x, parts, layout, "in", interpret=True)
    assert seen[-1] == (16, 32, 32, 4, 1)
    assert_f32_close(np.asarray(got), np.asarray(expected), ulps=64)
    monkeypatch.setenv(grouped_gradients.WEIGHT_TILES_ENV, "64x96=16,32,64,4,1")  # 64 does not divide a part (32)
    with pytest.raises(ValueError, match=r"block_n \(64\) divide N = 32"):
        grouped_gradients.grouped_weight_gradient(x, parts, layout, "in", interpret=True)
    monkeypatch.setenv(grouped_gradients.WEIGHT_TILES_ENV, "64x96:16,32")
    with pytest.raises(ValueError, match=r"\$KERAS_MONE_WEIGHT_GRADIENT_TILES entries must read"):
        grouped_gradients.grouped_weight_gradient(x, parts, layout, "in", interpret=True)


def test_the_weight_gradient_screen_runs_and_names_the_winners_as_the_variable_reads_them(monkeypatch, capsys):
    """``bench/weight_gradient_tiles.py`` at a tiny size, interpreted: every weight's dW and db
    checked and timed, a setting that does not fit listed as failed, the winners printed as
    $KERAS_MONE_WEIGHT_GRADIENT_TILES, which the kernel then reads."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import weight_gradient_tiles

    from keras_mone.kernels import grouped_gradients

    weight_gradient_tiles.main(["--batch-size", "2", "--dim", "32", "--hidden", "64", "--groups",
                                "5x4,3x8,2x16,1x32", "--repeats", "1", "--tiles", "16,16,32,4,2;16,16,64,4,2"])
    report = capsys.readouterr().out
    assert report.count("| plain (XLA) |") == 4 and "failed: ValueError" in report and "wrong" not in report
    value = report.split(f'{grouped_gradients.WEIGHT_TILES_ENV}="')[1].split('"')[0]
    assert sorted(entry.split("=")[0] for entry in value.split(";")) == ["32x32", "32x64", "32x96", "64x32"]
    monkeypatch.setenv(grouped_gradients.WEIGHT_TILES_ENV, value)
    rng = np.random.default_rng(11)
    x, parts = normal32(rng, 2, 11, 32), tuple(normal32(rng, 2, 11, 32) for _ in range(3))
    grouped_gradients.grouped_weight_gradient(x, parts, ((5, 4), (6, 32)), "in", interpret=True)  # reads it


def test_bad_arguments_are_named():
    from keras_mone.kernels.grouped_gradients import grouped_weight_gradient

    x, dy = np.zeros((2, 8, 64), "float32"), np.zeros((2, 8, 32), "float32")
    with pytest.raises(ValueError, match="`x` must be"):
        grouped_weight_gradient(x[0], dy, ((8, 16),), "in", interpret=True)
    with pytest.raises(ValueError, match="`groups` must be"):
        grouped_weight_gradient(x, dy, ((7, 16),), "in", interpret=True)
    with pytest.raises(ValueError, match="`side` must be"):
        grouped_weight_gradient(x, dy, ((8, 16),), "up", interpret=True)
    with pytest.raises(ValueError, match=r"`tiles` must be \(block_rows, block_k, block_n"):
        grouped_weight_gradient(x, dy, ((8, 16),), "in", tiles=(16, 8, 16, 4, 2), interpret=True)
    with pytest.raises(ValueError, match=r"block_n \(64\) divide N = 32"):
        grouped_weight_gradient(x, dy, ((8, 16),), "in", tiles=(16, 16, 64, 4, 2), interpret=True)
    with pytest.raises(ValueError, match="`splits` must be a positive int"):
        grouped_weight_gradient(x, dy, ((8, 16),), "in", splits=0, interpret=True)
    with pytest.raises(ValueError, match="`x` and `dy` must be floating point of one dtype"):
        grouped_weight_gradient(x, dy.astype("int32"), ((8, 16),), "in", interpret=True)
    with pytest.raises(ValueError, match="`x` and `dy` must be floating point of one dtype"):
        grouped_weight_gradient(x, dy.astype("float16"), ((8, 16),), "in", interpret=True)
    with pytest.raises(ValueError, match="`precision` must be 'highest' or 'default'"):
        grouped_weight_gradient(x, dy, ((8, 16),), "in", precision="high", interpret=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_weight_gradient_of_a_vit_b16_block_lowers_to_one_triton_call(dtype):
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
    from keras_mone.kernels.grouped_gradients import grouped_weight_gradient

    layout = ((84, 96), (62, 192), (37, 384), (14, 768))
    for side, (k, n) in [("in", (768, 2304)), ("out", (768, 768)), ("in", (768, 3072)), ("out", (3072, 768))]:
        spec = [jax.ShapeDtypeStruct((128, 197, k), jnp.dtype(dtype)), jax.ShapeDtypeStruct((128, 197, n), jnp.dtype(dtype))]
        out_layout = layout if side == "in" else tuple((size, min(width, n)) for size, width in layout)

        for bias in (False, True):
            def gradient(x, dy, side=side, out_layout=out_layout, bias=bias):
                return grouped_weight_gradient(x, dy, out_layout, side, bias=bias)

            assert lower_for_cuda(gradient, *spec).count(TRITON_CALL) == 1


def test_the_roofline_counts_the_weight_gradients_work_from_its_name():
    from keras_mone.bench.hlo_kernels import _pallas_traffic
    from keras_mone.bench.kernel_profile import kind_of
    from keras_mone.kernels.grouped_labels import weight_gradient_cost as labelled_cost
    from keras_mone.kernels.grouped_labels import weight_gradient_label

    groups = ((84, 96), (61, 192), (37, 384), (14, 768))
    nested = 128 * (84 * 96 + 61 * 192 + 37 * 384 + 14 * 768)
    name = weight_gradient_label("in", 768, 3072, 128, 2, groups)
    assert name == "grouped_in_weight_gradient_k768_n3072_b128_s2_g84x96_61x192_37x384_14x768"
    assert labelled_cost(name, 2) == (2 * nested * 3072, 2 * (nested + 128 * 196 * 3072) + 4 * 2 * 768 * 3072)
    out = weight_gradient_label("out", 3072, 768, 128, 2, groups)
    assert labelled_cost(out, 2) == (2 * nested * 3072, 2 * (nested + 128 * 196 * 3072) + 4 * 2 * 3072 * 768)
    # the rows' itemsize from the kernel's first operand (its output is float32 partial sums)
    assert _pallas_traffic(name, "f32[1536,3072]", ["bf16[25216,768]", "bf16[25216,3072]"]) == labelled_cost(name, 2)
    assert kind_of(name) == "pallas" and labelled_cost("grouped_in_projection_k768_n768_b1_g4x96", 2) is None
    # db's partial sums: one float32 row per split more
    with_bias = weight_gradient_label("out", 3072, 768, 128, 2, groups, bias=True)
    assert with_bias.startswith("grouped_out_weight_gradient_bias_k3072")
    assert labelled_cost(with_bias, 2)[1] == labelled_cost(out, 2)[1] + 4 * 2 * 768
    # a LayerNorm prologue: float32 statistics per row and weights per feature
    normed = weight_gradient_label("in", 768, 3072, 128, 2, groups, bias=True, norm=True)
    assert "_weight_gradient_norm_bias_k768" in normed
    extra = labelled_cost(normed, 2)[1] - labelled_cost(name, 2)[1]
    assert extra == 4 * 2 * 3072 + 4 * (2 * 128 * 196 + 2 * 768)
    # dy scaled per row (a gated fc2): its factor read per row
    scaled = weight_gradient_label("out", 3072, 768, 128, 2, groups, bias=True, scale=True)
    assert scaled == with_bias.replace("_bias_", "_bias_scale_")
    assert labelled_cost(scaled, 2)[1] == labelled_cost(with_bias, 2)[1] + 2 * 128 * 196
