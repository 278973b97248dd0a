"""A nested projection over all token groups as one Triton launch for torch
(``keras_mone.kernels.triton_grouped_projection``): equal to a float64 numpy reference of MoNE
Eq. 5-7 and to torch's per-group path through Triton's interpreter (CI has no GPU), inside a
MoNE ViT's packed blocks (``layers.packed_kernels``), under ``torch.compile`` as a custom op, and
compiled for an H100's sm_90 without one."""

import math
import warnings

import numpy as np
import pytest
from conftest import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="a Triton kernel for the torch backend")

SPANS = ((0, 37), (37, 37), (37, 101), (101, 150), (150, 160))
"""Five token groups of rows, one empty, sizes not multiples of the tiles' rows."""


def _kernel():
    from keras_mone.kernels import triton_grouped_projection

    if not triton_grouped_projection.available():
        pytest.skip("Triton is not installed (the test extra installs it)")
    return triton_grouped_projection


def _launcher():
    from keras_mone.kernels import triton_grouped_launch

    return triton_grouped_launch


def _arrays(rows, contraction, columns, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, contraction)), rng.standard_normal((contraction, columns)) / math.sqrt(contraction),
            rng.standard_normal(columns) / 4, rng.standard_normal((rows, columns)), 1 + rng.random(rows))


def _numpy_reference(x, w, b, spans, widths, side, activation=None, residual=None, scale=None, norm=None):
    """MoNE App. A.1 Eq. 5-7 in float64: in ``act(LN(x)[:, :d] W[:d] + b)`` (``norm``: the
    LayerNorm's ``(epsilon, gamma, beta)``); out ``Pad(x W[:, :d] + b[:d])``, then
    ``residual + scale * out``."""
    if norm is not None:
        epsilon, gamma, beta = norm
        x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + epsilon) * gamma + beta
    out = np.zeros((x.shape[0], w.shape[1]))
    for (start, stop), d in zip(spans, widths):
        if side == "in":
            out[start:stop] = x[start:stop, :d] @ w[:d] + (0 if b is None else b)
        else:
            out[start:stop, :d] = x[start:stop] @ w[:, :d] + (0 if b is None else b[:d])
    if activation == "gelu":
        out = 0.5 * out * (1 + np.vectorize(math.erf)(out / math.sqrt(2)))
    if activation == "gelu_tanh":
        out = 0.5 * out * (1 + np.tanh(math.sqrt(2 / math.pi) * (out + 0.044715 * out**3)))
    if scale is not None:
        out = out * scale[:, None]
    return out if residual is None else out + residual


def _torch(*arrays, dtype="float32"):
    import torch

    return [None if a is None else torch.as_tensor(a).to(getattr(torch, dtype)) for a in arrays]


@pytest.mark.parametrize("side, widths, options", [
    ("in", (48, 16, 96, 32, 80), {}),
    ("in", (48, 16, 96, 32, 80), {"activation": "gelu"}),
    ("in", (96, 16, 48, 96, 32), {"activation": "gelu_tanh", "bias": False}),
    ("out", (32, 16, 64, 48, 16), {"residual": True, "scale": True}),
    ("out", (48, 64, 16, 32, 16), {"residual": True, "gate": True}),
    ("out", (64, 16, 16, 32, 48), {"residual": True}),
    ("out", (16, 16, 48, 64, 64), {"bias": False}),
])
@pytest.mark.parametrize("tiles", [(32, 32, 32, 4, 2), (64, 16, 16, 4, 3)])
def test_the_kernel_equals_a_float64_reference(side, widths, options, tiles):
    """float32, every epilogue (MoNE's gate pair included), widths that are and are not
    multiples of the contraction step (an in-projection's d = 48 with 32-element steps: the
    tile past d reads zeros), an empty
    group, a group smaller than a row tile. Within float32 rounding of the largest value: the
    products over K <= 96 accumulate in float32 as torch's GEMMs do."""
    kernel = _kernel()
    contraction, columns = (96, 64) if side == "in" else (64, 64)
    x, w, b, residual, scale = _arrays(160, contraction, columns)
    b = b if options.get("bias", True) else None
    residual = residual if options.get("residual") else None
    scale = scale if options.get("scale") or options.get("gate") else None
    given = _torch(scale)[0]
    if options.get("gate"):  # MoNE's gate: the kernel computes alpha g + 1 (here g in [1, 2))
        given, scale = (given, *_torch(np.float64(0.375))), 0.375 * scale + 1
    expected = _numpy_reference(x, w, b, SPANS, widths, side, options.get("activation"), residual, scale)
    got = kernel.grouped_projection(*_torch(x, w, b), SPANS, widths, side, options.get("activation"),
                                    *_torch(residual), given, tiles=tiles)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=2e-6 * np.abs(expected).max())


def test_the_tile_table_holds_each_row_tiles_rows_and_width_at_the_layouts_alignment():
    """``triton_grouped_tile.tile_table``: three entries per row tile (its first row and its
    group's end row in units of the alignment, its group's width), none for an empty group; the
    alignment the largest power of 2 up to the tile's rows dividing every group boundary."""
    from keras_mone.kernels.triton_grouped_tile import tile_table

    _kernel()
    table, tiles, align = tile_table([37, 0, 64, 49, 10], [48, 16, 96, 32, 80], 32)
    assert align == 1 and tiles == 2 + 2 + 2 + 1
    assert table[:9] == (0, 37, 48, 32, 37, 48, 37, 101, 96)
    table, tiles, align = tile_table([64, 32, 96], [16, 32, 64], 32)  # boundaries 0, 64, 96, 192
    assert align == 32 and tiles == 6 and table == (0, 2, 16, 1, 2, 16, 2, 3, 32, 3, 6, 64, 4, 6, 64, 5, 6, 64)
    assert tile_table([48, 80], [16, 32], 128)[2] == 16 and tile_table([], [], 64) == ((), 0, 64)


def _recorded_launches(monkeypatch):
    """A list that receives ``(grid, compile-time arguments)`` of each launch of the Triton
    program (``triton_grouped_tile.kernel`` wrapped for the test), which still runs."""
    from keras_mone.kernels import triton_grouped_tile

    launches, original = [], triton_grouped_tile.kernel

    def recording(interpret):
        launcher = original(interpret)

        class Recorder:
            def __getitem__(self, grid):
                return lambda *a, **k: launches.append((grid, k)) or launcher[grid](*a, **k)
        return Recorder()

    monkeypatch.setattr(triton_grouped_tile, "kernel", recording)
    return launches


def test_one_compile_serves_every_layout_of_the_same_alignment(monkeypatch):
    """The layout is data (the tile table): two batch sizes whose groups share an alignment
    launch the kernel with the same compile-time arguments (Triton's cache: one compile), and
    each equals the float64 reference; the table is copied to the device once per layout."""
    kernel = _kernel()
    launches = _recorded_launches(monkeypatch)
    x, w, b, _, _ = _arrays(192, 96, 64, seed=8)
    widths = (16, 48, 96)
    for batch in (1, 3):  # groups of 32, 16 and 16 rows per image: aligned to 16 at both
        spans = ((0, 32 * batch), (32 * batch, 48 * batch), (48 * batch, 64 * batch))
        rows = 64 * batch
        got = kernel.grouped_projection(*_torch(x[:rows], w, b), spans, widths, "in", "gelu", tiles=(32, 32, 32, 4, 2))
        expected = _numpy_reference(x[:rows], w, b, spans, widths, "in", "gelu")
        np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=2e-6 * np.abs(expected).max())
    (grid_1, constants_1), (grid_2, constants_2) = launches
    assert grid_1 != grid_2 and constants_1 == constants_2 and constants_1["ROW_ALIGN"] == 16
    assert not constants_1["STATIC_TABLE"]
    made = dict(_launcher().TABLES)
    kernel.grouped_projection(*_torch(x[:64], w, b), ((0, 32), (32, 48), (48, 64)), widths, "in", "gelu",
                              tiles=(32, 32, 32, 4, 2))
    tables = _launcher().TABLES
    assert tables == made and all(tables[k][0] is made[k][0] for k in made)  # reused, not remade


def test_under_torch_compile_the_layout_is_compiled_in_and_gives_the_same_values(monkeypatch):
    """Inside ``torch.compile`` the op runs the compile-time group table (``STATIC_TABLE``: no
    device memory outlives a call, as CUDA graphs need); its values equal the eager tile table's
    at an unaligned layout with an empty group and at an aligned one."""
    import torch

    kernel = _kernel()
    x, w, b, residual, gate = _arrays(160, 64, 64, seed=12)
    launches = _recorded_launches(monkeypatch)
    for spans in (SPANS, ((0, 64), (64, 64), (64, 96), (96, 160))):
        widths = (16, 32, 48, 64, 16)[:len(spans)]
        arguments = (*_torch(x, w, b), spans, widths, "out")
        options = dict(residual=_torch(residual)[0], scale=(_torch(gate)[0], torch.tensor(0.25)),
                       tiles=(32, 32, 32, 4, 2))
        eager = kernel.grouped_projection(*arguments, **options)
        assert launches and not launches[-1][1]["STATIC_TABLE"]
        launches.clear()
        compiled = torch.compile(lambda *a: kernel.grouped_projection(*a, **options), backend="aot_eager",
                                 fullgraph=True)(*arguments)
        assert launches and all(constants["STATIC_TABLE"] for _, constants in launches)
        launches.clear()
        assert torch.equal(compiled, eager)


def test_a_malformed_gate_pair_is_named():
    import torch

    kernel = _kernel()
    x, w, b, residual, gate = _torch(*_arrays(160, 64, 64, seed=13))
    for bad in [(gate,), (gate, None), (gate, torch.tensor(0.5), 1.0)]:
        with pytest.raises(ValueError, match=r"`scale` must be a \(rows,\) tensor or a \(gate, alpha\) pair"):
            kernel.grouped_projection(x, w, b, SPANS, (16,) * 5, "out", scale=bad)
    with pytest.raises(ValueError, match="takes one alpha"):
        kernel.grouped_projection(x, w, b, SPANS, (16,) * 5, "out", scale=(gate, torch.ones(2)))
    by_number = kernel.grouped_projection(x, w, b, SPANS, (16,) * 5, "out", scale=(gate, 0.5))
    by_tensor = kernel.grouped_projection(x, w, b, SPANS, (16,) * 5, "out", scale=(gate, torch.tensor(0.5)))
    assert torch.equal(by_number, by_tensor)


@pytest.mark.parametrize("widths, tiles", [((48, 16, 96, 32, 80), (32, 32, 32, 4, 2)),
                                           ((96, 16, 96, 64, 16), (64, 16, 16, 4, 3))])
def test_the_layer_norm_prologue_equals_a_float64_reference(widths, tiles):
    """``norm=``: the statistics from ``kernels.triton_row_statistics`` (one pass, interpreted)
    within float32 rounding of numpy's, and the normalised projection within float32 rounding
    of the float64 LayerNorm then Eq. 5-6 (rows far from zero mean: offsets of 3)."""
    import torch

    from keras_mone.kernels import triton_row_statistics

    kernel = _kernel()
    x, w, b, _, _ = _arrays(160, 96, 64, seed=3)
    x = x + 3.0
    gamma, beta = 1 + np.random.default_rng(4).random(96), np.random.default_rng(5).standard_normal(96) / 4
    x32, = _torch(x)
    mean, rstd = triton_row_statistics.row_statistics(x32, 1e-6)
    assert mean.dtype == rstd.dtype == torch.float32
    np.testing.assert_allclose(mean.numpy(), x.mean(-1), rtol=2e-6)
    np.testing.assert_allclose(rstd.numpy(), 1 / np.sqrt(x.var(-1) + 1e-6), rtol=4e-6)
    got = kernel.grouped_projection(x32, *_torch(w, b), SPANS, widths, "in", "gelu",
                                    norm=(mean, rstd, *_torch(gamma, beta)), tiles=tiles)
    expected = _numpy_reference(x, w, b, SPANS, widths, "in", "gelu", norm=(1e-6, gamma, beta))
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=8e-6 * np.abs(expected).max())
    for dtype in ("bfloat16", "float16"):  # rows of 16-bit types read as they are, reduced in float32
        rows, = _torch(x, dtype=dtype)
        wide = triton_row_statistics.row_statistics(rows, 1e-6)
        for got, want in zip(wide, triton_row_statistics.plain_row_statistics(rows, 1e-6)):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=4e-6)


def test_bfloat16_rows_match_torchs_bfloat16_path():
    """bf16 rows and epilogue tensors. With bf16 weights the kernel and torch's path accumulate
    the same products in float32 and round once: apart by one rounding of the output (Triton
    3.5's interpreter casts to bf16 by truncation, a card to nearest: up to 2^-7 of the largest
    value). With float32 weights (mixed precision: each tile cast as it is loaded, by the same
    truncation here) within two such casts of the float64 result on the same bf16 inputs."""
    import torch

    kernel = _kernel()
    for side, widths in (("in", (48, 16, 96, 32, 80)), ("out", (32, 16, 64, 48, 16))):
        contraction, columns = (96, 64) if side == "in" else (64, 64)
        x, w, b, residual, scale = _arrays(160, contraction, columns, seed=1)
        x16, w16, b16, residual16, scale16 = _torch(x, w, b, residual, scale, dtype="bfloat16")
        epilogue = {"activation": "gelu"} if side == "in" else {"residual": residual16, "scale": scale16}
        got = kernel.grouped_projection(x16, w16, b16, SPANS, widths, side, **epilogue, tiles=(32, 32, 32, 4, 2))
        expected = kernel.plain_grouped_projection(x16, w16, b16, SPANS, widths, side, **epilogue)
        assert got.dtype == expected.dtype == torch.bfloat16
        largest = float(expected.float().abs().max())
        assert float((got.float() - expected.float()).abs().max()) <= 2**-7 * largest
        w32, b32 = _torch(w, b)
        mixed = kernel.grouped_projection(x16, w32, b32, SPANS, widths, side, **epilogue, tiles=(32, 32, 32, 4, 2))
        wide = {k: v.double().numpy() for k, v in epilogue.items() if k != "activation"}
        exact = _numpy_reference(x16.double().numpy(), w, b, SPANS, widths, side, epilogue.get("activation"), **wide)
        assert np.abs(mixed.double().numpy() - exact).max() <= 2**-6 * np.abs(exact).max()


@pytest.mark.parametrize("side", ["in", "out", "gated"])
def test_gradients_are_the_plain_paths_and_the_op_compiles(side):
    """With autograd the kernel runs as ``keras_mone::grouped_projection``, whose backward pass
    is the plain path's: gradients of every input (an in-projection's LayerNorm statistics and
    weights and its GELU; an out-projection's residual and gate, given as a factor or as MoNE's
    ``(gate, alpha)`` pair, whose alpha g + 1 the kernel computes) within float32 rounding of
    autodiff through ``plain_grouped_projection``; under ``torch.compile(fullgraph=True)``
    (fake tensors, the op's registered shape) the compiled forward and gradients are the eager
    ones. The statistics' gradients reach the rows as the LayerNorm's do."""
    import torch

    from keras_mone.kernels.triton_row_statistics import row_statistics

    kernel = _kernel()
    contraction = 96 if side == "in" else 64
    x, w, b, residual, scale = _torch(*_arrays(160, contraction, 64, seed=2))
    gamma, beta = _torch(1 + np.random.default_rng(7).random(contraction), np.random.default_rng(8).random(contraction))
    widths = (48, 16, 96, 32, 80) if side == "in" else (32, 16, 64, 48, 16)

    def loss(function, *tensors):
        if side == "in":
            x, w, b, gamma, beta = tensors
            norm = (*row_statistics(x, 1e-6), gamma, beta)
            out = function(x, w, b, SPANS, widths, "in", "gelu", norm=norm)
        else:
            scale = tensors[4] if side == "out" else (tensors[4], tensors[5])
            out = function(*tensors[:3], SPANS, widths, "out", residual=tensors[3], scale=scale)
        return (out**2).sum()

    def grads(function, compiled=False):
        inputs = (x, w, b, gamma, beta) if side == "in" else (x, w, b, residual, scale)
        inputs += (torch.tensor(0.375),) if side == "gated" else ()
        tensors = [t.clone().requires_grad_() for t in inputs]
        run = torch.compile(loss, backend="aot_eager", fullgraph=True) if compiled else loss
        value = run(function, *tensors)
        return [value.detach(), *torch.autograd.grad(value, tensors)]

    expected = grads(kernel.plain_grouped_projection)
    for got in (grads(kernel.grouped_projection), grads(kernel.grouped_projection, compiled=True)):
        for a, e in zip(got, expected):
            np.testing.assert_allclose(a.numpy(), e.numpy(), rtol=0, atol=8e-6 * float(e.abs().max()))


def test_strided_inputs_are_read_as_their_values():
    """Views with other strides (every other column of a wider tensor, a transposed weight, a
    column of a matrix as the gate) give what their contiguous copies give."""
    import torch

    kernel = _kernel()
    x, w, b, residual, scale = _torch(*_arrays(160, 64, 64, seed=6))
    widths = (32, 16, 64, 48, 16)
    wide_x = torch.stack([x, -x], dim=-1).reshape(160, 128)[:, ::2]
    w_t = w.t().contiguous().t()
    gate = torch.stack([scale, -scale], dim=-1)[:, 0]
    assert not (wide_x.is_contiguous() or w_t.is_contiguous() or gate.is_contiguous())
    expected = kernel.grouped_projection(x, w, b, SPANS, widths, "out", residual=residual, scale=scale)
    got = kernel.grouped_projection(wide_x, w_t, b, SPANS, widths, "out", residual=residual, scale=gate)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("side", ["in", "out"])
def test_token_major_rows_of_a_batch_major_tensor_are_read_in_place(monkeypatch, side):
    """``x`` as ``(tokens, batch, K)``, a view of a batch-major ``(batch, tokens, K)`` tensor (what
    torch's CUDA SDPA writes): the kernel reads row ``n * batch + b`` through the view's strides,
    no copy (the launch gets the view itself), and gives bit for bit what the contiguous
    token-major copy gives, equal to the float64 reference; with the LayerNorm prologue on the
    in-side (widths that stop inside a contraction step) and the gate and residual on the out-side."""
    import torch

    kernel = _kernel()
    tokens, batch, contraction = 32, 5, 64
    x2, w, b, residual, scale = _arrays(tokens * batch, contraction, 64, seed=11)
    batch_major = torch.as_tensor(x2.reshape(tokens, batch, contraction).transpose(1, 0, 2).copy()).float()
    view = batch_major.transpose(0, 1)
    assert not view.is_contiguous()
    spans, widths = ((0, 40), (40, 40), (40, 115), (115, 160)), (16, 48, 32, 64)
    if side == "in":
        epsilon, gamma, beta = 1e-6, 1 + np.arange(contraction) / 64, np.linspace(-0.5, 0.5, contraction)
        norm = lambda rows: (*(t.reshape(-1) for t in _statistics(rows, epsilon)), *_torch(gamma, beta))  # noqa: E731
        options, reference = dict(activation="gelu"), dict(activation="gelu", norm=(epsilon, gamma, beta))
    else:
        norm = lambda rows: None  # noqa: E731
        options = dict(residual=_torch(residual)[0], scale=_torch(scale)[0])
        reference = dict(residual=residual, scale=scale)
    received = []
    original = kernel._launch
    monkeypatch.setattr(kernel, "_launch", lambda *a: received.append(a[0]) or original(*a))
    contiguous = view.reshape(-1, contraction)
    got = kernel.grouped_projection(view, *_torch(w, b), spans, widths, side, norm=norm(contiguous), **options)
    expected = kernel.grouped_projection(contiguous, *_torch(w, b), spans, widths, side, norm=norm(contiguous),
                                         **options)
    assert received[0] is view and received[1].dim() == 2
    assert _launcher().kernel_rows(view) is view  # read in place, not copied inside the launch
    assert torch.equal(got, expected)
    exact = _numpy_reference(x2, w, b, spans, widths, side, **reference)
    np.testing.assert_allclose(got.numpy(), exact, rtol=0, atol=4e-6 * np.abs(exact).max())


def _statistics(rows, epsilon):
    """Each row's mean and rstd (what ``triton_row_statistics`` gives), in float32."""
    import torch

    mean = rows.double().mean(-1)
    return mean.float(), torch.rsqrt(rows.double().var(-1, unbiased=False) + epsilon).float()


def test_gradients_and_compile_take_batch_major_rows():
    """Through the custom op (autograd recording, ``torch.compile``), ``(tokens, batch, K)`` rows
    give the plain path's gradients, shaped as the view, and the compiled call's values; dynamo
    traces no lru cache of the argument checks (a warning each)."""
    import torch

    kernel = _kernel()
    x2, w, b, residual = _torch(*_arrays(160, 64, 64, seed=12)[:4])
    spans, widths = ((0, 60), (60, 160)), (32, 64)

    def grads(function, compiled=False):
        view = x2.reshape(32, 5, 64).transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(True)
        call = lambda v: function(v, w, b, spans, widths, "out", residual=residual)  # noqa: E731
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = (torch.compile(call, backend="aot_eager", fullgraph=True) if compiled else call)(view)
        assert not [c for c in caught if "lru_cache" in str(c.message)]  # (the checks' caches stay out of traces)
        return out, torch.autograd.grad((out**2).sum(), view)[0]

    expected_out, expected_grad = grads(kernel.plain_grouped_projection)
    for out, grad in (grads(kernel.grouped_projection), grads(kernel.grouped_projection, compiled=True)):
        assert grad.shape == (32, 5, 64)
        np.testing.assert_allclose(out.detach().numpy(), expected_out.detach().numpy(), rtol=0,
                                   atol=2e-6 * float(expected_out.abs().max()))
        np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=0,
                                   atol=8e-6 * float(expected_grad.abs().max()))


def test_bad_arguments_are_named():
    import torch

    kernel = _kernel()
    x, w, b = _torch(*_arrays(160, 64, 32)[:3])
    widths = (32, 16, 64, 48, 16)
    cases = [
        (dict(side="middle"), "`side` must be one of"),
        (dict(activation="relu"), "`activation` must be one of"),
        (dict(side="out", activation="gelu"), "`activation` must be one of"),
        (dict(residual=torch.zeros(160, 32)), "`residual` and `scale` belong to side 'out'"),
        (dict(spans=((0, 100), (90, 160), (160, 160), (160, 160), (160, 160))), "`spans` must be"),
        (dict(widths=(32, 16, 65, 48, 16)), "`spans` must be"),
        (dict(tiles=(32, 32, 24, 4, 2)), "`tiles` must be"),
        (dict(tiles=(32, 64, 32, 4, 2)), "block_cols \\(64\\) must divide N = 32"),
        (dict(x=x.double()), "`x` must be float16, bfloat16 or float32"),
        (dict(w=w[:32]), "`x` must be \\(rows, K\\)"),
        (dict(x=x.reshape(2, 4, 20, 64)), "`x` must be \\(rows, K\\) or \\(tokens, batch, K\\)"),
        (dict(b=b.long()), "`b` must be a floating tensor"),
        (dict(norm=(x[:, 0],) * 3), "`norm` is \\(mean, rstd, gamma, beta\\)"),
        (dict(norm=(x[:, 0], x[:, 0], b, b)), "`gamma` must have shape \\(64,\\)"),
    ]
    for change, message in cases:
        arguments = dict(x=x, w=w, b=b, spans=SPANS, widths=widths, side="in") | change
        with pytest.raises(ValueError, match=message):
            kernel.grouped_projection(**arguments)
    with pytest.raises(ValueError, match="`scale` must have shape \\(160,\\)"):
        kernel.grouped_projection(x, w, b, SPANS, (32, 16, 32, 16, 16), "out", scale=torch.ones(5))


def test_the_tiles_variable_names_a_shapes_tiles(monkeypatch):
    kernel = _kernel()
    calls = []
    original = kernel._launch
    monkeypatch.setattr(kernel, "_launch", lambda *a: calls.append(_argument(original, a, "tiles")) or original(*a))
    x, w, b = _torch(*_arrays(160, 64, 32)[:3])
    monkeypatch.setenv(kernel.TILES_ENV, "64x32=16,16,16,2,2;768x2304=64,128,64,4,3")
    kernel.grouped_projection(x, w, b, SPANS, (32, 16, 64, 48, 16), "in")
    assert calls == [(16, 16, 16, 2, 2)]
    monkeypatch.setenv(kernel.TILES_ENV, "64x32=16,24,16,2,2")
    with pytest.raises(ValueError, match="`tiles` must be"):
        kernel.grouped_projection(x, w, b, SPANS, (32, 16, 64, 48, 16), "in")


def _argument(function, arguments, name):
    """The argument ``name`` of a call of ``function`` with positional ``arguments``."""
    import inspect

    return inspect.signature(function).bind(*arguments).arguments[name]


def _mone_model(seed, dtype="float32"):
    from conftest import images, randomize_weights

    from keras_mone import models

    config = dict(image_size=32, patch_size=8, hidden_dim=64, depth=2, num_heads=4, mlp_dim=128)
    backbone = models.MoNEViTBackbone(**config, capacity=0.3, dtype=dtype)
    model = models.ImageClassifier(backbone, num_classes=5, dtype=dtype)
    model(images()[:1])
    randomize_weights(model, seed=seed)
    return model


def _launches(monkeypatch):
    from keras_mone.kernels import triton_grouped_projection

    sides = []
    original = triton_grouped_projection._launch
    monkeypatch.setattr(triton_grouped_projection, "_launch",
                        lambda *a: sides.append(_argument(original, a, "side")) or original(*a))
    return sides


@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_a_mone_vit_on_eager_torch_runs_four_launches_per_block_and_agrees(monkeypatch, dtype):
    """``$KERAS_MONE_PROJECTIONS=grouped_kernel`` on torch: each packed block runs q/k/v, the
    attention's out-projection, fc1 and fc2 as one launch each (interpreted here, on rows in
    the policy's compute dtype), its two LayerNorms as the in-projections' prologues. In
    float32 the logits are the per-group path's within float32 rounding. In mixed_bfloat16
    both forms are compared with the float32 model of the same weights: the kernel's error
    within twice the per-group path's plus one bf16 rounding of the largest logit (it rounds
    each epilogue once where the per-group path rounds after each op, but Triton's interpreter
    casts to bf16 by truncation where a card rounds to nearest). The statistics kernel runs for the
    first LayerNorm (and in float32 at "highest" precision each LN2): the others take the
    out-projections' partials (``TilePartials``)."""
    import torch
    from conftest import assert_f32_close, images

    from keras_mone.kernels import triton_grouped_projection, triton_row_statistics
    from keras_mone.layers import platform_forms

    _kernel()
    model = _mone_model(seed=8, dtype=dtype)
    launches, statistics = [], []
    original = triton_grouped_projection._launch
    monkeypatch.setattr(triton_grouped_projection, "_launch", lambda *a: launches.append(
        (_argument(original, a, "side"), a[0].dtype)) or original(*a))
    rows = triton_row_statistics.row_statistics
    monkeypatch.setattr(triton_row_statistics, "row_statistics", lambda *a: statistics.append(1) or rows(*a))
    logits = {}
    for form in ("grouped_kernel", "per_group"):
        monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, form)
        with torch.no_grad():
            logits[form] = model(images()).float().cpu().numpy()
    compute = torch.bfloat16 if dtype == "mixed_bfloat16" else torch.float32
    assert launches == [(side, compute) for side in ("in", "out", "in", "out")] * 2
    # the first block's LN1 and, in float32 at torch's default "highest" precision, each LN2; the others from the
    # out-projections' partials
    assert len(statistics) == (3 if dtype == "float32" else 1)
    assert np.abs(logits["per_group"]).max() > 0.1
    if dtype == "float32":
        assert_f32_close(logits["grouped_kernel"], logits["per_group"], ulps=64)
        return
    reference = _mone_model(seed=8)
    reference.set_weights(model.get_weights())
    with torch.no_grad():
        exact = reference(images()).cpu().numpy()
    kernel_error, per_group_error = (np.abs(logits[form] - exact).max() for form in ("grouped_kernel", "per_group"))
    assert 0 < per_group_error and kernel_error <= 2 * per_group_error + 2**-8 * np.abs(exact).max()


def test_a_batch_major_attention_output_reaches_the_out_projection_uncopied(monkeypatch):
    """Where SDPA writes its output batch-major (torch's memory-efficient CUDA kernel, float32's:
    ``(batch, tokens, heads, head_dim)`` in memory), the packed block passes the token-major
    ``(tokens, batch, D)`` view of it to the out-projection's launch, which reads it in place
    (no ``(rows, D)`` copy per block), and the logits equal those of the CPU's token-major output."""
    import torch
    from conftest import images

    from keras_mone.kernels import triton_grouped_projection
    from keras_mone.layers import packed_kernels, platform_forms

    _kernel()
    model = _mone_model(seed=13)
    monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, "grouped_kernel")
    with torch.no_grad():
        token_major = model(images())
    attention = packed_kernels.fused_attention

    def batch_major(*qkv, heads_first):  # (batch, heads, tokens, head_dim), stored as CUDA's SDPA stores it
        return attention(*qkv, heads_first=heads_first).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(packed_kernels, "fused_attention", batch_major)
    received = []
    original = triton_grouped_projection._launch
    monkeypatch.setattr(triton_grouped_projection, "_launch", lambda *a: received.append(  # the rows it reads
        (_argument(original, a, "side"), _launcher().kernel_rows(a[0]).dim())) or original(*a))
    with torch.no_grad():
        logits = model(images())
    assert received == [("in", 2), ("out", 3), ("in", 2), ("out", 2)] * 2
    assert torch.equal(logits, token_major)


@pytest.mark.parametrize("kernel_name, split", [("flash", False), ("efficient", True), ("cudnn", False)])
def test_which_cuda_attention_outputs_the_kernel_reads_in_place(kernel_name, split):
    """The layouts of torch's CUDA SDPA outputs, from torch's own shape functions (meta tensors, no
    card) on the packed block's token-major q, k and v: flash and cuDNN attention follow the
    query's layout, so the out-projection's input is a plain ``(rows, D)`` view; the
    memory-efficient kernel writes batch-major, which the kernel takes as ``(tokens, batch, D)``
    in place (``_kernel_rows`` keeps it 3-D: no copy)."""
    import torch

    from keras_mone.kernels.triton_grouped_launch import kernel_rows as _kernel_rows

    tokens, batch, heads, head_dim = 17, 4, 3, 16
    qkv = torch.empty(tokens * batch, 3 * heads * head_dim, device="meta", dtype=torch.bfloat16)
    q, k, v = qkv.view(tokens, batch, 3, heads, head_dim).permute(2, 1, 3, 0, 4)
    attention = {"flash": lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v),
                 "efficient": lambda: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, False),
                 "cudnn": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False)}
    attended = attention[kernel_name]()[0].permute(2, 0, 1, 3).flatten(2)  # as layers.packed_kernels passes it
    rows = _kernel_rows(attended)
    assert rows.dim() == (3 if split else 2) and rows.shape[-1] == heads * head_dim
    assert (rows is attended) if split else rows.stride() == (heads * head_dim, 1)


def test_batch_major_rows_past_32_bit_offsets_are_copied_to_2d():
    """The kernel's two-level row offsets are int32: a batch-major view reaching 2**31 elements or
    more (ViViT-FE-B/16's 3136 tokens at batch 700) is copied to token-major rows instead (its
    2-D rows take the block pointers' 64-bit offsets); one just below is read in place."""
    import torch

    from keras_mone.kernels.triton_grouped_launch import kernel_rows as _kernel_rows

    for batch, split in ((700, False), (600, True)):
        view = torch.empty(batch, 3136, 1024, device="meta", dtype=torch.bfloat16).transpose(0, 1)
        assert (_kernel_rows(view) is view) == split and _kernel_rows(view).dim() == (3 if split else 2)


def test_the_kernel_form_applies_only_where_it_can(monkeypatch):
    """``layers.packed_kernels.kernels_apply``: nested widths, in the form asked for, with rows of
    a dtype the kernel takes (any number of groups), and ops that run (not under
    ``torch.func``'s transforms, which have no storage to launch a kernel on)."""
    import torch

    from keras_mone.layers import ViTBlock, platform_forms
    from keras_mone.layers.packed_kernels import kernels_apply

    _kernel()
    block = ViTBlock(hidden_dim=64, num_heads=4, mlp_dim=128, routed=True)
    block.build((None, None, 64))
    rows = torch.zeros(20, 64)
    monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, "grouped_kernel")
    assert kernels_apply(block, rows, [16, 64])
    assert not kernels_apply(block, rows, [64, 64])  # nothing nested: the dense block's GEMMs
    assert kernels_apply(block, rows, [16, 32, 48] * 6 + [64])
    assert not kernels_apply(block, rows.double(), [16, 64])
    seen = []
    torch.func.vmap(lambda r: seen.append(kernels_apply(block, r, [16, 64])) or r)(rows)
    assert seen == [False]
    monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, "per_group")
    assert not kernels_apply(block, rows, [16, 64])


def test_a_mone_vit_trains_through_the_op_and_compiles_in_one_graph(monkeypatch):
    """Training gradients through the custom op equal the per-group path's, and the packed
    blocks with the kernel trace into one ``torch.compile`` graph (``fullgraph=True``)."""
    import torch
    from conftest import assert_f32_close, images

    from keras_mone.layers import platform_forms

    _kernel()
    model = _mone_model(seed=9)
    sides = _launches(monkeypatch)
    x = torch.as_tensor(images())
    variables = [v.value for v in model.trainable_variables]
    grads = {}
    for form in ("grouped_kernel", "per_group"):
        monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, form)
        grads[form] = torch.autograd.grad((model(x, training=True) ** 2).sum(), variables)
    assert sides == ["in", "out", "in", "out"] * 2
    for got, want in zip(grads["grouped_kernel"], grads["per_group"]):
        assert_f32_close(got.numpy(), want.numpy(), ulps=256)
    monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, "grouped_kernel")
    sides.clear()
    with torch.no_grad():
        compiled = torch.compile(lambda images: model(images), backend="aot_eager", fullgraph=True)(x)
        eager = model(x)
    assert len(sides) == 16  # 8 launches by the compiled call (the op), 8 by the eager one
    assert_f32_close(compiled.numpy(), eager.numpy())


def test_compiles_for_an_h100_with_warpgroup_mma():
    """ViT-B/16's fc1 (LayerNorm prologue, GELU epilogue; the tile table read at run time) and
    fc2 (MoNE's gate and the residual; the compile-time group table of torch.compile at e_c 0.3,
    batch 256) and the attention's out-projection on batch-major rows (``split_rows``: SDPA's output
    read in place), bf16 rows and weights at the default tiles: Triton
    compiles the kernel for sm_90 (no GPU needed) and its dots become Hopper's ``wgmma``; the
    row statistics kernel compiles too. In a fresh process: the interpreter of the tests above
    leaves ``triton.language`` patched."""
    from conftest import fresh_python_output

    _kernel()
    script = (
        "from keras_mone.kernels import triton_grouped_tile as kernel, triton_row_statistics as statistics\n"
        "fc1 = kernel.compile_for_cuda(768, 3072, 'in', activation='gelu', norm=True)\n"
        "groups = [(84 * 256, 96), (61 * 256, 192), (37 * 256, 384), (14 * 256, 768)]\n"
        "fc2 = kernel.compile_for_cuda(3072, 768, 'out', residual=True, scale='gate', groups=groups)\n"
        "out = kernel.compile_for_cuda(768, 768, 'out', residual=True, split_rows=True)\n"
        "rows = statistics.compile_for_cuda(768)\n"
        "fc1_partials = kernel.compile_for_cuda(768, 3072, 'in', activation='gelu', norm=True, norm_tiles=6)\n"
        "fc2_partials = kernel.compile_for_cuda(3072, 768, 'out', residual=True, scale='gate', statistics=True)\n"
        "kernels = (fc1, fc2, out, fc1_partials, fc2_partials)\n"
        "print(*('wgmma' in k.asm['ptx'] for k in kernels), 'ld.global' in rows.asm['ptx'])\n"
    )
    assert fresh_python_output(script) == "True True True True True True"


def test_the_gpu_tile_screen_runs_and_checks_every_setting(monkeypatch):
    """``bench/triton_grouped_tiles.py`` (in ``bench/gpu.sh``) at a tiny size, interpreted: every
    projection's default and given settings checked against torch's ops and timed, a setting the
    kernel refuses listed as failed, and the winners printed as the tiles variable."""
    import pathlib

    _kernel()
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import triton_grouped_tiles

    text = triton_grouped_tiles.main(["--batch-size", "1", "--dim", "64", "--hidden", "128", "--tokens", "20",
                                      "--repeats", "1", "--tiles", "16,16,16,4,2;16,24,16,4,2"])
    rows = [line for line in text.splitlines() if line.startswith("| ") and "(" in line]
    assert len(rows) == 12 and sum("torch's ops |" in row for row in rows) == 8
    assert sum("failed: ValueError: `tiles` must be" in row for row in rows) == 4
    assert 'KERAS_MONE_PROJECTION_TILES="64x192=' in text and "128x64=" in text
    assert [n for n, _ in triton_grouped_tiles.group_shapes(0.3, 196, 768)] == [84, 61, 37, 14]
    text = triton_grouped_tiles.main(["--batch-size", "1", "--dim", "64", "--hidden", "128", "--tokens", "20",
                                      "--repeats", "1", "--tiles", "16,16,16,4,2", "--budget", "0"])
    assert text.count("not timed: --budget spent") == 8 and "no tile setting ran" in text
    with pytest.raises(SystemExit):
        triton_grouped_tiles.main(["--budget", "-1"])


def test_the_compile_report_runs():
    """``bench/triton_grouped_compile.py`` at a small width and rows aligned to 16: every
    projection (the attention's out-projection also on batch-major rows), with the LayerNorms'
    statistics per row and from the out-projections' partials, compiled for sm_90 (a
    fresh process: the interpreter of the tests above leaves ``triton.language`` patched)."""
    import pathlib

    from conftest import fresh_python_output

    _kernel()
    bench = pathlib.Path(__file__).resolve().parents[1] / "bench"
    script = (f"import sys; sys.path.insert(0, {str(bench)!r})\n"
              "import triton_grouped_compile as report\n"
              "text = report.main(['--dim', '64', '--row-align', '16', '--dtypes', 'bf16'])\n"
              "rows = [line for line in text.splitlines() if line.startswith('| bf16 |')]\n"
              "print(len(rows), all('| wgmma |' in row for row in rows), 'Row statistics (D = 64' in text)\n")
    # the four projections and the out-projection on batch-major rows, with statistics per row and with partials
    assert fresh_python_output(script) == "10 True True"


def test_the_launch_host_time_bench_runs(monkeypatch):
    """``bench/triton_launch_host.py`` at a small width: one row per projection and one for the
    statistics, each a positive time, the kernels stubbed (nothing launched)."""
    import importlib
    import pathlib

    _kernel()
    from keras_mone.kernels import triton_grouped_tile, triton_row_statistics

    monkeypatch.setattr(triton_grouped_tile, "kernel", triton_grouped_tile.kernel)  # the script stubs them
    monkeypatch.setattr(triton_row_statistics, "_kernel", triton_row_statistics._kernel)
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    text = importlib.import_module("triton_launch_host").main(["--dim", "64", "--tokens", "20", "--calls", "3",
                                                               "--repeats", "1"])
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| call")]
    assert len(rows) == 5 and all(float(row.split("|")[2]) > 0 for row in rows)
