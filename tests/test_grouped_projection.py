"""One kernel launch per nested projection over all token groups (issue 40 item 2):
``kernels.grouped_projection`` equals the numpy reference of MoNE Eq. 5-7 and the plain
path, forward and backward, through Pallas' interpreter, and lowers to one Triton call for a
CUDA GPU without one; a ``ViTBlock`` run through it (``$KERAS_MONE_PROJECTIONS``) equals the
numpy reference of Eq. 1 and the per-group path."""

import numpy as np
import pytest
from conftest import BACKEND, assert_f32_close, normal32

import numpy_reference as ref

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend")

SMALL_TILES = (16, 32, 16, 4, 2)  # several row, column and contraction tiles per group at these sizes


def _exact_gelu(x):
    import jax

    return jax.nn.gelu(x, approximate=False)


# (tokens, width) per group: an empty group, widths that are not multiples of block_k (16),
# token counts that leave a group's last row tile partly empty
LAYOUTS = [((5, 16), (0, 32), (7, 40), (4, 64)), ((11, 8),), ((3, 64), (9, 24))]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_in_projection_equals_the_numpy_reference_of_eq5(layout):
    from keras_mone.kernels.grouped_projection import grouped_projection

    rng = np.random.default_rng(0)
    tokens = sum(size for size, _ in layout)
    x, w, b = normal32(rng, 3, tokens, 64), 0.2 * normal32(rng, 64, 96), normal32(rng, 96)
    out = np.asarray(grouped_projection(x, w, b, layout, "in", activation=_exact_gelu, tiles=SMALL_TILES,
                                        interpret=True))
    widths = np.concatenate([np.full(size, width) for size, width in layout])
    expected = ref._per_token(lambda row, d: ref.gelu(ref.in_projection(row, w, b, d)), x, widths[None])
    assert_f32_close(out, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layer_norm_prologue_equals_the_numpy_reference(layout):
    """``norm``: each loaded tile normalised with its rows' statistics (full-width rows, the
    group reading its first ``d`` features), as ``LN`` then Eq. 5."""
    from keras_mone.kernels.grouped_projection import grouped_projection

    rng = np.random.default_rng(9)
    tokens = sum(size for size, _ in layout)
    x, w, b = 3.0 + normal32(rng, 2, tokens, 64), 0.2 * normal32(rng, 64, 96), normal32(rng, 96)
    gamma, beta = 1.0 + 0.1 * normal32(rng, 64), 0.1 * normal32(rng, 64)
    wide = x.astype("float64")
    mean, variance = wide.mean(-1), wide.var(-1)
    rstd = 1.0 / np.sqrt(variance + 1e-6)
    norm = (mean.astype("float32"), rstd.astype("float32"), gamma, beta)
    out = np.asarray(grouped_projection(x, w, b, layout, "in", norm=norm, tiles=SMALL_TILES, interpret=True))
    widths = np.concatenate([np.full(size, width) for size, width in layout])
    normed = ref.layer_norm(x, gamma, beta)
    assert_f32_close(out, ref._per_token(lambda row, d: ref.in_projection(row, w, b, d), normed, widths[None]))
    with pytest.raises(ValueError, match="`norm` must be"):
        grouped_projection(x, w, b, layout, "in", norm=norm[:3], interpret=True)
    with pytest.raises(ValueError, match="`activation` and `norm` belong to side 'in'"):
        grouped_projection(x, w[:, :64], b[:64], tuple((s, min(d, 64)) for s, d in layout), "out", norm=norm,
                           interpret=True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("epilogue", ["none", "residual", "residual_and_scale", "residual_and_gate"])
def test_the_out_projection_equals_the_numpy_reference_of_eq7(layout, epilogue):
    """``residual + scale * Pad(x @ W[:, :d] + b[:d])``; features past ``d`` are the residual's
    own (zeros without one). ``scale=(gate, alpha)``: the kernel computes MoNE's ``alpha g + 1``."""
    from keras_mone.kernels.grouped_projection import grouped_projection

    rng = np.random.default_rng(1)
    tokens = sum(size for size, _ in layout)
    x, w, b = normal32(rng, 2, tokens, 96), 0.2 * normal32(rng, 96, 64), normal32(rng, 64)
    residual = normal32(rng, 2, tokens, 64) if epilogue != "none" else None
    scale = (1.0 + rng.random((2, tokens))).astype("float32") if epilogue == "residual_and_scale" else None
    given = scale
    if epilogue == "residual_and_gate":
        gate, alpha = rng.random((2, tokens)).astype("float32"), np.float32(0.375)
        given, scale = (gate, alpha), alpha * gate.astype(np.float64) + 1.0
    out = np.asarray(grouped_projection(x, w, b, layout, "out", residual=residual, scale=given, tiles=SMALL_TILES,
                                        interpret=True))
    widths = np.concatenate([np.full(size, width) for size, width in layout])
    expected = ref._per_token(lambda row, d: ref.out_projection(row, w, b, d), x, widths[None])
    if scale is not None:
        expected = expected * scale[..., None]
    if residual is not None:
        expected = expected + residual
    assert_f32_close(out, expected)
    start = 0
    for size, width in layout:  # past a group's width: exactly the residual (or zero)
        past = out[:, start:start + size, width:]
        assert np.array_equal(past, 0 * past if residual is None else residual[:, start:start + size, width:])
        start += size


@pytest.mark.parametrize("tiles,dtype", [(SMALL_TILES, "float32"), ((32, 64, 16, 4, 2), "float32"),
                                         (SMALL_TILES, "bfloat16")])
@pytest.mark.parametrize("gated", [False, True])
def test_the_out_projection_gives_the_next_layer_norms_statistics_from_its_row_sums(tiles, dtype, gated):
    """``statistics_epsilon``: the output is bit for bit the output without; the statistics are
    the one-pass mean and ``rsqrt(var + eps)`` of the stored (in bf16: rounded) rows (a float64
    numpy reference of the kernel's own output, and the plain path's), summed over the column
    tiles; the gradients of both outputs equal the plain path's; one Triton call stores both."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
    from keras_mone.kernels.grouped_projection import grouped_projection, plain_grouped_projection

    rng = np.random.default_rng(11)
    layout = ((5, 16), (0, 32), (7, 40), (4, 64))
    x, w, b = normal32(rng, 2, 16, 96), 0.2 * normal32(rng, 96, 64), normal32(rng, 64)
    residual = 1.5 + normal32(rng, 2, 16, 64)  # rows with a mean, as a residual stream has
    x, residual = (jnp.asarray(t, dtype) for t in (x, residual))
    scale = (jnp.asarray(rng.random((2, 16)), dtype), np.float32(0.375)) if gated else None

    def project(function, x, w, b, residual, **options):
        return function(x, w, b, layout, "out", residual=residual, scale=scale, **options)

    out, sums = project(grouped_projection, x, w, b, residual, statistics_epsilon=1e-6, tiles=tiles, interpret=True)
    assert sums.sums.shape == sums.squares.shape == (64 // tiles[1], 2, 16) and sums.epsilon == 1e-6
    mean, rstd = sums.statistics()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(project(grouped_projection, x, w, b, residual,
                                                                      tiles=tiles, interpret=True)))
    stored = np.asarray(out.astype(jnp.float32), np.float64)
    expected_mean = stored.mean(-1)
    expected_rstd = 1.0 / np.sqrt(np.maximum((stored ** 2).mean(-1) - expected_mean ** 2, 0.0) + 1e-6)
    assert mean.shape == rstd.shape == (2, 16) and mean.dtype == rstd.dtype == np.float32
    assert_f32_close(np.asarray(mean), expected_mean, ulps=64)
    assert_f32_close(np.asarray(rstd), expected_rstd, ulps=256)  # E[y^2] - E[y]^2: cancellation at mean 1.5
    _, plain_sums = project(plain_grouped_projection, x, w, b, residual, statistics_epsilon=1e-6,
                            statistics_tiles=64 // tiles[1])
    plain_mean, plain_rstd = plain_sums.statistics()
    assert_f32_close(np.asarray(mean), np.asarray(plain_mean), ulps=64)
    assert_f32_close(np.asarray(rstd), np.asarray(plain_rstd), ulps=256)
    weights = [normal32(rng, 2, 16, 64), normal32(rng, 2, 16), normal32(rng, 2, 16)]

    def loss(function, **options):
        def value(x, w, b, residual):
            out, sums = project(function, x, w, b, residual, statistics_epsilon=1e-6, **options)
            mean, rstd = sums.statistics()
            return (out * weights[0]).sum() + (mean * weights[1]).sum() + (rstd * weights[2]).sum()
        return value

    arguments = (x, w, b, residual)
    if dtype == "float32":  # (bf16's gradients: bf16 products in both, summed in other orders)
        got = jax.grad(loss(grouped_projection, tiles=tiles, interpret=True), (0, 1, 2, 3))(*arguments)
        expected = jax.grad(loss(plain_grouped_projection, statistics_tiles=64 // tiles[1]), (0, 1, 2, 3))(*arguments)
        for got_one, expected_one in zip(got, expected):
            assert_f32_close(np.asarray(got_one), np.asarray(expected_one), ulps=256)
    text = lower_for_cuda(lambda *a: project(grouped_projection, *a, statistics_epsilon=np.float32(1e-6),
                                             tiles=tiles), *arguments)
    assert f"_residual{'_scale' * gated}_sums{64 // tiles[1]}_k96_n64" in text and text.count(TRITON_CALL) == 1
    for bad in (-1.0, True, "1e-6"):
        with pytest.raises(ValueError, match="`statistics_epsilon` belongs to side 'out' and must be a number"):
            project(grouped_projection, x, w, b, residual, statistics_epsilon=bad, interpret=True)
    with pytest.raises(ValueError, match="`statistics_epsilon` belongs to side 'out'"):
        grouped_projection(x[..., :64], w.T, np.zeros(96, "float32"), layout, "in", statistics_epsilon=1e-6,
                           interpret=True)


def test_the_in_projection_finishes_the_statistics_from_row_sums():
    """``norm=(RowSums, gamma, beta)``: the prologue sums the partial row sums per row and applies
    the one-pass statistics itself (no pass of XLA's makes mean and rstd): the same output as the
    finished statistics given, and as the plain path; gradients through the plain path."""
    import jax

    from keras_mone.kernels.cuda_lowering import lower_for_cuda
    from keras_mone.kernels.grouped_projection import grouped_projection, plain_grouped_projection
    from keras_mone.kernels.row_sums import plain_row_sums

    rng = np.random.default_rng(12)
    layout = ((5, 16), (0, 32), (7, 40), (4, 64))
    x, w, b = 1.0 + normal32(rng, 2, 16, 64), 0.2 * normal32(rng, 64, 96), normal32(rng, 96)
    gamma, beta = 1.0 + 0.1 * normal32(rng, 64), 0.1 * normal32(rng, 64)
    sums = plain_row_sums(x, 4, 1e-6)
    finished = (*sums.statistics(), gamma, beta)
    out = grouped_projection(x, w, b, layout, "in", norm=(sums, gamma, beta), tiles=SMALL_TILES, interpret=True)
    given = grouped_projection(x, w, b, layout, "in", norm=finished, tiles=SMALL_TILES, interpret=True)
    assert_f32_close(np.asarray(out), np.asarray(given), ulps=64)
    assert_f32_close(np.asarray(out), np.asarray(plain_grouped_projection(x, w, b, layout, "in",
                                                                        norm=(sums, gamma, beta))), ulps=64)
    weights = normal32(rng, 2, 16, 96)

    def loss(function, **options):
        def value(x, w, sums_in):
            norm = (plain_row_sums(sums_in, 4, 1e-6), gamma, beta)
            return (function(x, w, b, layout, "in", norm=norm, **options) * weights).sum()
        return value

    got = jax.grad(loss(grouped_projection, tiles=SMALL_TILES, interpret=True), (0, 1, 2))(x, w, x)
    for got_one, expected_one in zip(got, jax.grad(loss(plain_grouped_projection), (0, 1, 2))(x, w, x)):
        assert_f32_close(np.asarray(got_one), np.asarray(expected_one), ulps=256)
    text = lower_for_cuda(lambda x: grouped_projection(x, w, b, layout, "in", norm=(plain_row_sums(x, 4, 1e-6),
                                                                                    gamma, beta)), x)
    assert "grouped_in_projection_norm_k64_n96" in text
    with pytest.raises(ValueError, match="or \\(RowSums of rows of 64, gamma, beta\\)"):
        grouped_projection(x, w, b, layout, "in", norm=(plain_row_sums(x[..., :32], 4, 1e-6), gamma, beta),
                           interpret=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_sums_statistics_take_their_gradient_through_the_rows(dtype):
    """``RowSums.statistics`` with ``rows`` (as a kernel gives them): the gradient of the mean and
    rstd reaches the rows, ``d sum + 2 rows d square``, and equals autodiff of the one-pass
    statistics computed from the rows themselves; the sums get none. Without ``rows`` autodiff
    goes through the sums."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.row_sums import RowSums, one_pass, plain_row_sums

    rng = np.random.default_rng(21)
    rows = jnp.asarray(0.5 + normal32(rng, 2, 7, 64), dtype)
    mean_weights, rstd_weights = normal32(rng, 2, 7), normal32(rng, 2, 7)

    def loss(statistics):
        mean, rstd = statistics
        return (mean * mean_weights).sum() + (rstd * rstd_weights).sum()

    def from_rows(rows):  # the reference: one pass over the rows, autodiff throughout
        wide = rows.astype(jnp.float32)
        return loss(one_pass(wide.sum(-1), (wide * wide).sum(-1), 64, 1e-6))

    def through_rows(rows):
        summed = plain_row_sums(rows, 4, 1e-6)
        return loss(RowSums(jax.lax.stop_gradient(summed.sums), jax.lax.stop_gradient(summed.squares), 64, 1e-6,
                            rows=rows).statistics())

    def through_sums(rows):
        summed = plain_row_sums(rows, 4, 1e-6)
        return loss(RowSums(summed.sums, summed.squares, 64, 1e-6).statistics())

    expected = np.asarray(jax.grad(from_rows)(rows), np.float32)
    for function in (through_rows, through_sums):
        got = np.asarray(jax.grad(function)(rows), np.float32)
        if dtype == "float32":
            assert_f32_close(got, expected, ulps=64)
        else:  # the cotangent rounded to bf16
            np.testing.assert_allclose(got, expected, atol=8e-3 * np.abs(expected).max())
    summed = plain_row_sums(rows, 4, 1e-6)
    sums_gradient = jax.grad(lambda s: loss(RowSums(s, summed.squares, 64, 1e-6, rows=rows).statistics()))(
        summed.sums)
    assert not np.asarray(sums_gradient).any()


@pytest.mark.parametrize("tiles", [None, SMALL_TILES, (32, 16, 32, 4, 3)])
def test_every_tile_setting_equals_the_plain_path(tiles):
    from keras_mone.kernels.grouped_projection import grouped_projection, plain_grouped_projection

    rng = np.random.default_rng(2)
    layout = ((37, 16), (21, 32), (6, 64))
    x, w, b = normal32(rng, 2, 64, 64), 0.2 * normal32(rng, 64, 192), normal32(rng, 192)
    for side in ("in", "out"):
        groups = layout if side == "in" else tuple((s, min(d, 192)) for s, d in layout)
        out = grouped_projection(x, w, b, groups, side, tiles=tiles, interpret=True)
        assert_f32_close(np.asarray(out), np.asarray(plain_grouped_projection(x, w, b, groups, side)))


def test_q_k_and_v_written_apart_equal_the_joint_outputs_thirds():
    """``parts=3``: each column tile stores into the part it lies in (q, k or v)."""
    from keras_mone.kernels.grouped_projection import grouped_projection

    rng = np.random.default_rng(6)
    layout = ((9, 16), (4, 64))
    x, w, b = normal32(rng, 2, 13, 64), 0.2 * normal32(rng, 64, 192), normal32(rng, 192)
    joint = np.asarray(grouped_projection(x, w, b, layout, "in", tiles=SMALL_TILES, interpret=True))
    parts = grouped_projection(x, w, b, layout, "in", parts=3, tiles=SMALL_TILES, interpret=True)
    assert len(parts) == 3
    for index, part in enumerate(parts):
        assert np.array_equal(np.asarray(part), joint[..., 64 * index:64 * (index + 1)])
    for bad in (0, 5, 2.0, 2):  # none, not whole parts, not an int, parts of 96: not whole column tiles of 64
        with pytest.raises(ValueError, match="`parts`"):
            grouped_projection(x, w, b, layout, "in", parts=bad, tiles=(16, 64, 16, 4, 2), interpret=True)
    with pytest.raises(ValueError, match="`parts` belongs to side 'in'"):
        grouped_projection(x, w[:, :64], b[:64], ((9, 16), (4, 64)), "out", parts=2, tiles=SMALL_TILES,
                           interpret=True)


def test_a_block_the_kernels_do_not_fit_keeps_one_gemm_per_group(monkeypatch):
    """Widths that are not multiples of 16 (Triton's smallest dot) take the generic path."""
    from keras_mone.kernels import grouped_projection as kernels
    from keras_mone.layers.block import ViTBlock

    block = ViTBlock(40, 4, 80, gate="mone", name="odd_block")
    block.build((None, None, 40))
    rng = np.random.default_rng(11)
    groups = [normal32(rng, 2, n, 40) for n in (4, 3)]
    per_group = block(groups, widths=(10, 20))
    launches = []
    original = kernels.grouped_projection
    monkeypatch.setattr(kernels, "grouped_projection", lambda *a, **k: launches.append(a[4]) or original(*a, **k))
    monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "grouped_kernel")
    outputs = block(groups, widths=(10, 20))
    assert launches == []
    for got, expected in zip(outputs, per_group):
        assert np.array_equal(np.asarray(got), np.asarray(expected))


def test_gradients_equal_the_plain_paths():
    import jax

    from keras_mone.kernels.grouped_projection import grouped_projection, plain_grouped_projection

    rng = np.random.default_rng(3)
    layout = ((5, 16), (7, 48))
    x, w, b = normal32(rng, 2, 12, 64), 0.2 * normal32(rng, 64, 64), normal32(rng, 64)
    residual, scale = normal32(rng, 2, 12, 64), (1.0 + rng.random((2, 12))).astype("float32")

    mean, rstd = x.mean(-1), 1.0 / np.sqrt(x.var(-1) + 1e-6)
    gamma, beta = 1.0 + 0.1 * normal32(rng, 64), 0.1 * normal32(rng, 64)
    w3, b3 = 0.2 * normal32(rng, 64, 96), normal32(rng, 96)

    def loss(function, **options):
        def value(x, w, b, residual, scale, mean, rstd, gamma, beta, w3, b3):
            norm = (mean, rstd, gamma, beta)
            hidden = function(x, w, b, layout, "in", activation=_exact_gelu, norm=norm, **options)
            out = function(hidden, w, b, layout, "out", residual=residual, scale=scale, **options)
            q, k, v = function(out, w3, b3, layout, "in", parts=3, **options)  # q, k and v written apart
            return (out ** 2).sum() + (q * k).sum() + (v ** 2).sum()
        return value

    arguments = (x, w, b, residual, scale, mean, rstd, gamma, beta, w3, b3)
    wrt = range(len(arguments))
    kernel = jax.grad(loss(grouped_projection, tiles=SMALL_TILES, interpret=True), argnums=wrt)(*arguments)
    plain = jax.grad(loss(plain_grouped_projection), argnums=wrt)(*arguments)
    for got, expected in zip(kernel, plain):
        assert_f32_close(np.asarray(got), np.asarray(expected))


def test_bad_arguments_are_named():
    from keras_mone.kernels.grouped_projection import grouped_projection

    x, w, b = np.zeros((2, 8, 32), "float32"), np.zeros((32, 64), "float32"), np.zeros(64, "float32")
    cases = [
        (dict(groups=((8, 16),), side="sideways"), "`side`"),
        (dict(groups=((7, 16),), side="in"), "`groups`"),
        (dict(groups=((8, 40),), side="in"), "`groups`"),  # wider than K = 32
        (dict(groups=((8, 16),), side="in", residual=np.zeros((2, 8, 64), "float32")), "`residual`"),
        (dict(groups=((8, 16),), side="out", activation=_exact_gelu), "`activation`"),
        (dict(groups=((8, 16),), side="out", scale=np.zeros((2, 7), "float32")), "`scale`"),
        (dict(groups=((8, 16),), side="out", scale=(np.zeros((2, 8), "float32"), np.zeros(2, "float32"))),
         r"`scale` must be .* a \(gate, alpha\) pair"),
        (dict(groups=((8, 16),), side="in", tiles=(16, 48, 16, 4, 2)), "`tiles`"),
        (dict(groups=((8, 16),), side="in", tiles=(16, 128, 16, 4, 2)), "block_cols"),
        (dict(groups=((8, 16),), side="in", tiles=(16, 32, 8, 4, 2)), "at least 16"),
    ]
    for options, named in cases:
        with pytest.raises(ValueError, match=named):
            grouped_projection(x, w, b, interpret=True, **options)
    with pytest.raises(ValueError, match="floating point"):
        grouped_projection(x, w.astype("int32"), b, ((8, 16),), "in", interpret=True)


def test_a_block_with_no_tokens_launches_nothing():
    from keras_mone.kernels.grouped_projection import grouped_projection

    x, w, b = np.zeros((2, 0, 32), "float32"), np.ones((32, 64), "float32"), np.ones(64, "float32")
    assert grouped_projection(x, w, b, ((0, 16), (0, 32)), "in", interpret=True).shape == (2, 0, 64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_projection_of_a_vit_b16_block_lowers_to_one_triton_call(dtype):
    """MoNE-ViT-B/16 at e_c 0.3 (the capacity solver's counts) through Pallas' Triton lowering."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
    from keras_mone.kernels.grouped_projection import grouped_projection
    from keras_mone.layers.mlp import _kernel_gelu

    layout = ((84, 96), (62, 192), (37, 384), (14, 768))
    for side, (k, n), options in [("in", (768, 2304), {"parts": 3}), ("out", (768, 768), {"residual": True}),
                                  ("in", (768, 3072), {"activation": _kernel_gelu(False)}),
                                  ("out", (3072, 768), {"residual": True, "scale": True})]:
        spec = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape in ((64, 197, k), (k, n), (n,))]
        if options.pop("residual", False):
            spec.append(jax.ShapeDtypeStruct((64, 197, n), jnp.dtype(dtype)))
        with_scale = options.pop("scale", False)
        if with_scale:
            spec.append(jax.ShapeDtypeStruct((64, 197), jnp.dtype(dtype)))

        def projection(x, w, b, *epilogue, side=side, options=options, with_scale=with_scale):
            extra = dict(zip(("residual", "scale"), epilogue))
            return grouped_projection(x, w, b, layout, side, **options, **extra)

        assert lower_for_cuda(projection, *spec).count(TRITON_CALL) == 1


def _block_params(block):
    weights = {
        "norm1_gamma": block.norm1.gamma, "norm1_beta": block.norm1.beta,
        "qkv_kernel": block.attention.qkv.kernel, "qkv_bias": block.attention.qkv.bias,
        "out_kernel": block.attention.out.kernel, "out_bias": block.attention.out.bias,
        "norm2_gamma": block.norm2.gamma, "norm2_beta": block.norm2.beta,
        "fc1_kernel": block.mlp.fc1.kernel, "fc1_bias": block.mlp.fc1.bias,
        "fc2_kernel": block.mlp.fc2.kernel, "fc2_bias": block.mlp.fc2.bias,
    }
    params = {name: np.asarray(value, np.float64) for name, value in weights.items()}
    params["num_heads"] = block.num_heads
    return params


@pytest.mark.parametrize("statistics", ["keras", "one_pass"])
@pytest.mark.parametrize("gated", [True, False])
def test_a_block_through_the_kernels_equals_the_numpy_reference_of_eq1(monkeypatch, gated, statistics):
    """In the one-pass statistics form (jax's GPU default) the second LayerNorm's statistics come
    from the attention out-projection's row sums: no statistics pass over the stream."""
    from keras_mone.layers import grouped_block
    from keras_mone.layers.block import ViTBlock

    monkeypatch.setenv("KERAS_MONE_STATISTICS", statistics)

    block = ViTBlock(32, 4, 64, gate="mone" if gated else None, alpha_init=0.5, name="kernel_block")
    block.build((None, None, 32))
    rng = np.random.default_rng(4)
    for weight in block.weights:  # biases and LayerNorm parameters away from their initial 0 / 1
        weight.assign(np.asarray(weight) + 0.1 * rng.normal(size=weight.shape).astype("float32"))
    sizes, widths = (6, 2, 5, 3), (4, 8, 16, 32)
    groups = [normal32(rng, 2, n, 32) for n in sizes]
    gates = [rng.random((2, n)).astype("float32") for n in sizes] if gated else None
    from keras_mone.kernels import grouped_projection as kernels

    per_group = block(groups, widths=widths, gates=gates)
    launches = []
    original = kernels.grouped_projection
    monkeypatch.setattr(kernels, "grouped_projection",
                        lambda *a, **k: launches.append((a[4], k.get("norm") is not None,
                                                         k.get("statistics_epsilon"))) or original(*a, **k))
    computed = []
    original_statistics = grouped_block.row_statistics
    monkeypatch.setattr(grouped_block, "row_statistics", lambda *a: computed.append(a[0]) or original_statistics(*a))
    monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "grouped_kernel")
    kernel = block(groups, widths=widths, gates=gates)
    # q/k/v and fc1 with their LayerNorms as prologues, the attention's out-projection, fc2
    # one-pass: the attention's out-projection sums its rows for the second LayerNorm, fc2 for the next block's first
    summed, next_summed = ((float(block.norm2.epsilon), float(block.norm1.epsilon)) if statistics == "one_pass"
                           else (None, None))
    assert launches == [("in", True, None), ("out", False, summed), ("in", True, None), ("out", False, next_summed)]
    assert computed == ([block.norm1] if summed else [block.norm1, block.norm2])
    x = np.concatenate(groups, axis=1)
    token_widths = np.concatenate([np.full(n, w) for n, w in zip(sizes, widths)])[None].repeat(2, 0)
    expected = ref.block(x, token_widths, _block_params(block), gates=None if gates is None else
                         np.concatenate(gates, axis=1), alpha=float(np.asarray(block.alpha)) if gated else 0.0)
    got = np.concatenate([np.asarray(g) for g in kernel], axis=1)
    assert [g.shape for g in kernel] == [g.shape for g in groups]
    assert_f32_close(got, expected, ulps=64)  # two LayerNorms, attention and four projections in float32
    assert_f32_close(got, np.concatenate([np.asarray(g) for g in per_group], axis=1), ulps=64)


@pytest.mark.parametrize("statistics", ["keras", "one_pass"])
def test_a_mone_vit_through_the_kernels_predicts_what_it_predicts_per_group(monkeypatch, statistics):
    """A whole MoNE ViT (router, EPR, blocks before and after the router), compiled by
    ``predict``: the grouped kernels change no value beyond float32 rounding. In the one-pass
    form a kernel block's first LayerNorm takes its statistics from the previous kernel block's
    fc2 (its row sums) where the groups come straight from it: only the block after the router
    computes them, and nothing is kept once the call is done."""
    import gc

    from keras_mone.layers import grouped_block
    from keras_mone.models import MoNEViTBackbone

    monkeypatch.setenv("KERAS_MONE_STATISTICS", statistics)
    model = MoNEViTBackbone(image_size=16, patch_size=4, hidden_dim=32, depth=4, num_heads=4,
                            mlp_dim=64, capacity=0.4, router_positions=(1,), alpha_init=0.5)
    images = np.random.default_rng(5).normal(size=(3, 16, 16, 3)).astype("float32")
    per_group = model.predict(images, verbose=0)
    computed = []
    original = grouped_block.row_statistics
    monkeypatch.setattr(grouped_block, "row_statistics", lambda *a: computed.append(a[0].path) or original(*a))
    monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "grouped_kernel")
    model.make_predict_function(force=True)  # a new trace, in the kernels' form
    kernel = model.predict(images, verbose=0)
    assert not np.array_equal(kernel, per_group)  # (the new trace ran: float32 sums in another order)
    assert_f32_close(kernel, per_group, ulps=256)
    blocks = [f"mone_vit_backbone/block_{i}/norm{n}" for i in (1, 2, 3) for n in (1, 2)]
    expected = blocks if statistics == "keras" else blocks[:1]  # block_0 runs before the router: dense
    assert sorted(set(computed)) == sorted(set(expected))
    computed.clear()
    assert_f32_close(np.asarray(model(images)), per_group, ulps=256)  # eagerly: the same statistics
    assert sorted(set(computed)) == sorted(set(expected))
    gc.collect()
    assert grouped_block._CARRIED == []


def test_a_block_takes_carried_statistics_only_from_the_previous_kernel_blocks_very_outputs(monkeypatch):
    """The one-pass form's statistics carried from fc2 to the next block's first LayerNorm serve
    only the very output groups, in order, in the block's dtype, for the same epsilon: other
    groups of the same shapes (while the outputs live), the outputs reordered, another epsilon or
    another dtype each compute their own statistics, and every call equals the per-group path."""
    from keras_mone.layers import grouped_block
    from keras_mone.layers.block import ViTBlock

    monkeypatch.setenv("KERAS_MONE_STATISTICS", "one_pass")
    rng = np.random.default_rng(13)

    def block(name, **options):
        made = ViTBlock(32, 4, 64, name=name, **options)
        made.build((None, None, 32))
        for weight in made.weights:
            weight.assign(np.asarray(weight) + 0.1 * rng.normal(size=weight.shape).astype(weight.dtype))
        return made

    first, second = block("first"), block("second")
    others = {"epsilon": block("epsilon", layer_norm_epsilon=1e-3), "dtype": block("dtype", dtype="mixed_bfloat16")}
    groups, widths = [normal32(rng, 2, 4, 32), normal32(rng, 2, 4, 32)], (8, 16)
    computed = []
    original = grouped_block.row_statistics
    monkeypatch.setattr(grouped_block, "row_statistics", lambda *a: computed.append(a[0].name) or original(*a))

    def run(layer, inputs):  # the kernels' outputs, the norms whose statistics they computed, the per-group path's
        computed.clear()
        monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "grouped_kernel")
        got = [np.asarray(g, np.float32) for g in layer(inputs, widths=widths)]
        seen = list(computed)
        monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "per_group")
        expected = [np.asarray(g, np.float32) for g in layer(inputs, widths=widths)]
        for a, b in zip(got, expected):
            assert_f32_close(a, b, ulps=256) if layer.compute_dtype == "float32" else np.testing.assert_allclose(
                a, b, atol=0.05 * np.abs(b).max())
        return seen

    def first_outputs():
        monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "grouped_kernel")
        return first(groups, widths=widths)

    outputs = first_outputs()
    assert run(second, outputs) == []  # the very outputs: no statistics of its own
    outputs = first_outputs()
    shifted = [g + 1.0 for g in outputs]  # the same shapes, other values, the outputs alive
    assert run(second, shifted) == ["norm1"]
    outputs = first_outputs()
    assert run(second, [outputs[1], outputs[0]]) == ["norm1"]
    for name, layer in others.items():
        outputs = first_outputs()
        assert run(layer, outputs) == ["norm1"], name


@pytest.mark.parametrize("training", [False, True])
def test_a_traced_kernel_block_reads_the_previous_kernel_blocks_joined_outputs(monkeypatch, training):
    """Under a trace a kernel block given the previous kernel block's very output groups reads
    their joined tensor: one concatenation of the groups for two blocks (two for groups that are
    not those outputs), the same values, and nothing kept once the trace is done."""
    import gc

    import jax

    from keras_mone.layers import grouped_block
    from keras_mone.layers.block import ViTBlock

    monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "grouped_kernel")
    rng = np.random.default_rng(17)
    first, second = ViTBlock(32, 4, 64, name="first"), ViTBlock(32, 4, 64, name="second")
    for made in (first, second):
        made.build((None, None, 32))
    groups, widths = [normal32(rng, 2, 5, 32), normal32(rng, 2, 3, 32)], (8, 16)

    def chained(groups, copy=False):
        outputs = first(groups, widths=widths, training=training)
        outputs = [g + 0.0 for g in outputs] if copy else outputs  # other objects, the same values
        return second(outputs, widths=widths, training=training)

    def joins(copy):
        jaxpr = jax.make_jaxpr(lambda g: chained(g, copy))(groups)
        return str(jaxpr).count("concatenate[")

    assert (joins(False), joins(True)) == (1, 2)
    gc.collect()
    assert grouped_block._CARRIED == []
    traced = jax.jit(chained)(groups)
    eager = chained(groups)  # eagerly the groups are joined again
    for a, b in zip(traced, eager):
        assert_f32_close(np.asarray(a), np.asarray(b), ulps=64)


@pytest.mark.parametrize("statistics", ["keras", "one_pass"])
def test_a_single_group_blocks_carried_entry_holds_nothing_of_its_outputs(monkeypatch, statistics):
    """One group (MatViT's blocks; a group holding every token) is the joined stream itself: the
    carried entry keeps neither it nor its rows, so it goes with the outputs, traced (no leaked
    tracer, ``jax.checking_leaks``) or eager, training or not; the values are the per-group path's."""
    import gc

    import jax

    from keras_mone.layers import grouped_block
    from keras_mone.layers.block import ViTBlock

    monkeypatch.setenv("KERAS_MONE_STATISTICS", statistics)
    rng = np.random.default_rng(23)
    first, second = ViTBlock(32, 4, 64, name="first"), ViTBlock(32, 4, 64, name="second")
    for made in (first, second):
        made.build((None, None, 32))
    x = normal32(rng, 2, 8, 32)

    def chained(x, training):
        return second(first(x, widths=(16,), training=training), widths=(16,), training=training)

    monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "grouped_kernel")
    for training in (False, True):
        with jax.checking_leaks():
            traced = jax.jit(chained, static_argnums=1)(x, training)
        gc.collect()
        assert grouped_block._CARRIED == [], training
        eager = chained(x, training)
        del eager
        gc.collect()
        assert grouped_block._CARRIED == [], training
    monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "per_group")
    assert_f32_close(np.asarray(traced), np.asarray(chained(x, True)), ulps=64)


def test_training_calls_run_the_kernels_with_their_epilogues_unless_the_block_drops(monkeypatch):
    """Training calls take the kernels with the out-projections' epilogues (residual adds, MoNE's
    gate) unless the block has stochastic depth (then XLA's); fc1 stores its pre-activations
    beside its GELU, which fc2 reads (the kernels' backward passes are then grouped kernels); they
    give what an inference call gives. A block with dropout keeps one GEMM per group in training,
    and one with stochastic depth draws what the generic path draws."""
    from keras_mone.kernels import grouped_projection as kernels
    from keras_mone.layers.block import ViTBlock

    rng = np.random.default_rng(7)
    groups, gates = [normal32(rng, 2, n, 32) for n in (4, 3)], [rng.random((2, n)).astype("float32") for n in (4, 3)]
    launches = []
    original = kernels.grouped_projection

    def counted(*args, **kwargs):
        keys = ("activation", "residual", "scale", "keep_pre_activation", "activated")
        launches.append(sorted(k for k in keys if kwargs.get(k) is not None and kwargs.get(k) is not False))
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "grouped_projection", counted)
    monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "grouped_kernel")
    block = ViTBlock(32, 4, 64, gate="mone", name="training_block")
    block.build((None, None, 32))
    trained = block(groups, widths=(8, 16), gates=gates, training=True)
    training_launches = [[], ["residual"], ["activation", "keep_pre_activation"], ["activated", "residual", "scale"]]
    assert launches == training_launches  # four kernels, both out-projections with their epilogues
    inferred = block(groups, widths=(8, 16), gates=gates, training=False)
    assert launches[4:] == [[], ["residual"], ["activation"], ["residual", "scale"]]
    for a, b in zip(trained, inferred):
        assert_f32_close(np.asarray(b), np.asarray(a), ulps=64)
    from keras_mone.layers.attention import MoNEAttention
    from keras_mone.layers.mlp import NestedMLP

    for parts in ({"dropout_rate": 0.1}, {"mlp": NestedMLP(32, 64, dropout_rate=0.5)},
                  {"attention": MoNEAttention(32, 4, dropout_rate=0.5)}):  # a given part's own rate counts too
        launches.clear()
        dropping = ViTBlock(32, 4, 64, gate="mone", **parts)
        dropping.build((None, None, 32))
        dropping(groups, widths=(8, 16), gates=gates, training=True)
        assert launches == [], parts
        dropping(groups, widths=(8, 16), gates=gates, training=False)
        assert len(launches) == 4

    # stochastic depth: 8 examples at rate 0.5 (some branch dropped but with odds 2^-16)
    groups, gates = [normal32(rng, 8, n, 32) for n in (4, 3)], [rng.random((8, n)).astype("float32") for n in (4, 3)]
    depth = ViTBlock(32, 4, 64, gate="mone", drop_path_rate=0.5)
    depth.build((None, None, 32))
    state = np.asarray(depth.drop_path.seed_generator.state.value)
    launches.clear()
    with_kernels = depth(groups, widths=(8, 16), gates=gates, training=True)
    training_launches = [[], [], ["activation", "keep_pre_activation"], ["activated"]]  # (both residuals XLA's)
    assert launches == training_launches
    depth.drop_path.seed_generator.state.assign(state)
    monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "per_group")
    generic = depth(groups, widths=(8, 16), gates=gates, training=True)
    assert launches == training_launches
    for a, b in zip(with_kernels, generic):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * float(np.abs(np.asarray(b)).max()))
    unchanged = depth(groups, widths=(8, 16), gates=gates, training=False)
    assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3 for a, b in zip(generic, unchanged))


def test_tiles_from_the_environment_reach_the_kernel_and_change_no_value(monkeypatch):
    from keras_mone.kernels import grouped_projection as kernels

    rng = np.random.default_rng(8)
    x, w, b = normal32(rng, 2, 12, 64), 0.2 * normal32(rng, 64, 96), normal32(rng, 96)
    layout = ((7, 16), (5, 64))
    default = np.asarray(kernels.grouped_projection(x, w, b, layout, "in", interpret=True))
    seen = []
    original = kernels._jitted
    monkeypatch.setattr(kernels, "_jitted", lambda *a: seen.append(a[12]) or original(*a))
    monkeypatch.setenv(kernels.TILES_ENV, "64x64=64,64,64,4,3; 64x96=16,32,16,4,2")
    tuned = np.asarray(kernels.grouped_projection(x, w, b, layout, "in", interpret=True))
    assert seen == [(16, 32, 16, 4, 2)]
    assert_f32_close(tuned, default)
    for bad, named in [("64x96=16,32", "five powers of 2|\\(block_rows"), ("64by96=16,32,16,4,2", "KxN="),
                       ("64x96=16,48,16,4,2", "`tiles`")]:
        monkeypatch.setenv(kernels.TILES_ENV, bad)
        with pytest.raises(ValueError, match=named):
            kernels.grouped_projection(x, w, b, layout, "in", interpret=True)


def test_the_tile_screen_runs_and_names_the_winners_as_the_variable_reads_them(monkeypatch, capsys):
    """``bench/grouped_tiles.py`` at a tiny size, interpreted: every projection checked and timed,
    a setting that does not fit listed as failed, the winners printed as $KERAS_MONE_PROJECTION_TILES."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import grouped_tiles

    from keras_mone.kernels import grouped_projection as kernels

    grouped_tiles.main(["--batch-size", "2", "--dim", "32", "--hidden", "64", "--groups", "5x4,3x8,2x16,1x32",
                        "--repeats", "1", "--tiles", "16,32,16,4,2;16,64,16,4,2"])
    report = capsys.readouterr().out
    assert report.count("| plain (XLA) |") == 4 and "failed: ValueError" in report and "wrong" not in report
    value = report.split(f'{kernels.TILES_ENV}="')[1].split('"')[0]
    assert sorted(entry.split("=")[0] for entry in value.split(";")) == ["32x32", "32x64", "32x96", "64x32"]
    monkeypatch.setenv(kernels.TILES_ENV, value)
    # the screened setting or the default, whichever timed faster here
    assert kernels.tile_override(32, 96) in [(16, 32, 16, 4, 2), kernels.default_tiles(32, 96, "bfloat16")]


def test_the_roofline_counts_each_kernels_work_from_its_name():
    """``kernel_label`` carries what ``bench.hlo_kernels`` needs: the products of every group."""
    from keras_mone.kernels.grouped_projection import kernel_label, labelled_cost

    groups = ((84, 96), (61, 192), (37, 384), (14, 768))
    name = kernel_label("in", 768, 3072, 256, groups)
    flops, moved = labelled_cost(name, 2)
    assert flops == 2 * 256 * (84 * 96 + 61 * 192 + 37 * 384 + 14 * 768) * 3072
    rows = 256 * 196
    assert moved == 2 * (256 * (84 * 96 + 61 * 192 + 37 * 384 + 14 * 768) + 768 * 3072 + 3072 + rows * 3072)
    out = labelled_cost(kernel_label("out", 3072, 768, 256, groups, residual=True, scale=True), 2)
    assert out[0] == flops and out[1] == 2 * (rows * 3072 + 3072 * 768 + 768 + rows * 768 + rows + rows * 768)
    normed = labelled_cost(kernel_label("in", 768, 3072, 256, groups, norm=True), 2)
    assert normed == (flops, moved + 4 * (2 * rows + 2 * 768))  # float32 statistics and LayerNorm weights
    assert labelled_cost("_mlp_tile_d96_h3072", 2) is None
    summed = kernel_label("out", 3072, 768, 256, groups, residual=True, sums=6)  # two float32 per row and tile
    assert "_residual_sums6_k3072" in summed
    assert labelled_cost(summed, 2)[1] == labelled_cost(summed.replace("_sums6", ""), 2)[1] + 8 * rows * 6


def test_in_mixed_precision_the_kernels_read_the_float32_weights_and_match_the_per_group_path(monkeypatch):
    """Under ``mixed_bfloat16`` the kernels take the float32 variables as they are stored (each
    weight tile is cast in the kernel: no cast copy of every weight per call) and give what the
    per-group path gives, within bfloat16 rounding."""
    import keras

    from keras_mone.kernels import grouped_projection as kernels
    from keras_mone.layers.block import ViTBlock

    block = ViTBlock(32, 4, 64, gate="mone", alpha_init=0.5, dtype="mixed_bfloat16", name="mixed_block")
    block.build((None, None, 32))
    rng = np.random.default_rng(10)
    groups = [keras.ops.cast(normal32(rng, 2, n, 32), "bfloat16") for n in (6, 5)]
    gates = [rng.random((2, n)).astype("float32") for n in (6, 5)]
    per_group = block(groups, widths=(8, 16), gates=gates)
    flags = [weight._autocast for weight in block.weights]
    dtypes = []
    original = kernels.grouped_projection
    monkeypatch.setattr(kernels, "grouped_projection",
                        lambda *a, **k: dtypes.append((str(a[0].dtype), str(a[1].dtype))) or original(*a, **k))
    monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "grouped_kernel")
    kernel = block(groups, widths=(8, 16), gates=gates)
    assert dtypes == [("bfloat16", "float32")] * 4
    for got, expected in zip(kernel, per_group):
        got, expected = (np.asarray(keras.ops.cast(t, "float32")) for t in (got, expected))
        assert np.abs(got - expected).max() <= 2.0 ** -6 * max(1.0, np.abs(expected).max())
    assert [weight._autocast for weight in block.weights] == flags  # each read restored the variable's own flag
