"""A LayerNorm's statistics from the out-projection before it, for torch's grouped projection
kernels (``kernels.triton_grouped_projection``, ``statistics=True``): each program writes its
rows' per-tile mean and sum of squared deviations (``triton_row_statistics.TilePartials``), the
next in-projection's prologue combines them (Chan et al.'s update). Checked through Triton's
interpreter against float64 numpy, against the row statistics kernel's path, through the custom
op with autograd, and inside a MoNE ViT's packed blocks (``layers.packed_kernels``)."""

import gc

import numpy as np
import pytest
from conftest import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="a Triton kernel for the torch backend")

SPANS = ((0, 37), (37, 37), (37, 101), (101, 150), (150, 160))
"""Five token groups of rows, one empty, sizes not multiples of the tiles' rows."""
WIDTHS = (32, 16, 64, 48, 16)


def _modules():
    from keras_mone.kernels import triton_grouped_projection, triton_row_statistics

    if not triton_grouped_projection.available():
        pytest.skip("Triton is not installed (the test extra installs it)")
    return triton_grouped_projection, triton_row_statistics


def _out_projection_inputs(seed=0, offset=30.0, spread=0.05):
    """An out-projection whose rows sit far from zero (the residual ``offset`` + ``spread`` noise):
    where a one-pass variance would lose its digits."""
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((160, 64)), rng.standard_normal((64, 64)) / 8
    b, gate = rng.standard_normal(64) / 4, rng.random(160)
    residual = offset + spread * rng.standard_normal((160, 64)) + np.linspace(0, 1, 64)
    return x, w, b, residual, gate


def _tile_partials_64(rows, tiles):
    """Per row and tile, the mean and sum of squared deviations in float64: ``(tiles, rows)``."""
    pieces = np.asarray(rows, np.float64).reshape(rows.shape[0], tiles, -1)
    means = pieces.mean(-1)
    return means.T, ((pieces - means[..., None]) ** 2).sum(-1).T


@pytest.mark.parametrize("tiles", [(32, 16, 16, 4, 2), (64, 64, 16, 4, 3)])
def test_the_out_projections_partials_and_their_combination_equal_float64(tiles):
    """float32: the output is the same with and without partials; the partials of the output as
    stored equal float64 numpy's (means within a few ulps of the rows' magnitude, 30; the sums of
    squared deviations within float32 rounding of the deviations' size, not the rows'); the
    combined mean and rstd equal float64 numpy's row statistics within 2e-6 and 1e-5 relative,
    where the variance is 1/1000th of the squared mean."""
    import torch

    kernel, statistics = _modules()
    x, w, b, residual, gate = (torch.as_tensor(a, dtype=torch.float32) for a in _out_projection_inputs())
    arguments = (x, w, b, SPANS, WIDTHS, "out")
    with torch.no_grad():
        out, partials = kernel.grouped_projection(*arguments, residual=residual, scale=(gate, 0.5), tiles=tiles,
                                                  statistics=True)
        plain_out = kernel.grouped_projection(*arguments, residual=residual, scale=(gate, 0.5), tiles=tiles)
    assert torch.equal(out, plain_out) and isinstance(partials, statistics.TilePartials)
    count = 64 // tiles[1]
    assert partials.means.shape == partials.squares.shape == (count, 160)
    means, squares = _tile_partials_64(out.numpy(), count)
    np.testing.assert_allclose(partials.means.numpy(), means, rtol=0, atol=8 * np.spacing(np.float32(32)))
    np.testing.assert_allclose(partials.squares.numpy(), squares, rtol=1e-4, atol=1e-5 * squares.max())
    mean, rstd = statistics.combined_statistics(partials, 1e-6, 64)
    wide = out.double().numpy()
    np.testing.assert_allclose(mean.numpy(), wide.mean(-1), rtol=2e-6)
    np.testing.assert_allclose(rstd.numpy(), 1 / np.sqrt(wide.var(-1) + 1e-6), rtol=1e-5)


@pytest.mark.parametrize("tiles", [(32, 32, 16, 4, 2), (64, 16, 32, 4, 3)])
def test_the_prologue_combines_the_partials_as_torchs_ops_do(tiles):
    """An in-projection given the partials (``norm=(partials, epsilon, gamma, beta)``) equals the
    same projection given ``combined_statistics``' mean and rstd (torch's ops) and the row
    statistics kernel's; for 6 partial tiles too (a count that is not a power of 2, as ViT-B/16's
    768 / 128). Rows sit at 30: a mean a few float32 ulps of 30 apart shifts every normalised
    feature by as much, which the projection carries into an output by ``sum_k |gamma_k w_k|``,
    so that is the tolerance (8 ulps of 30 through it; about 3e-5 here)."""
    import torch

    kernel, statistics = _modules()
    rng = np.random.default_rng(3)
    rows = torch.as_tensor(30 + rng.standard_normal((160, 96)), dtype=torch.float32)
    w = torch.as_tensor(rng.standard_normal((96, 64)) / 10, dtype=torch.float32)
    gamma, beta = (torch.as_tensor(v, dtype=torch.float32) for v in (1 + rng.random(96), rng.standard_normal(96)))
    widths = (48, 16, 96, 32, 80)
    carried = (np.abs(w.numpy()) * gamma.numpy()[:, None]).sum(0).max()
    tolerance = 8 * np.spacing(np.float32(30)) * carried
    for count in (1, 6, 3):
        partials = statistics.plain_tile_partials(rows, count)
        given = kernel.grouped_projection(rows, w, None, SPANS, widths, "in", "gelu",
                                          norm=(partials, 1e-6, gamma, beta), tiles=tiles)
        for mean, rstd in (statistics.combined_statistics(partials, 1e-6, 96),
                           statistics.row_statistics(rows, 1e-6)):
            expected = kernel.grouped_projection(rows, w, None, SPANS, widths, "in", "gelu",
                                                 norm=(mean, rstd, gamma, beta), tiles=tiles)
            assert float((given - expected).abs().max()) <= tolerance


def test_bfloat16_partials_are_those_of_the_stored_rows():
    """bf16 rows: the partials are those of the output as stored (rounded to bf16), read back as
    float32 (``plain_tile_partials`` of the output) within float32 rounding."""
    import torch

    kernel, statistics = _modules()
    x, w, b, residual, _ = (torch.as_tensor(a, dtype=torch.bfloat16) for a in _out_projection_inputs(seed=5))
    with torch.no_grad():
        out, partials = kernel.grouped_projection(x, w, b, SPANS, WIDTHS, "out", residual=residual,
                                                  tiles=(32, 16, 16, 4, 2), statistics=True)
    expected = statistics.plain_tile_partials(out, 4)
    assert out.dtype == torch.bfloat16 and partials.means.dtype == torch.float32
    torch.testing.assert_close(partials.means, expected.means, rtol=1e-6, atol=0)
    torch.testing.assert_close(partials.squares, expected.squares, rtol=1e-5, atol=1e-6 * float(expected.squares.max()))


def test_through_the_op_partials_are_torchs_and_gradients_flow_through_them():
    """With autograd (the custom op) ``statistics=True`` gives ``plain_tile_partials`` of the
    output, and an in-projection normalised from them differentiates to the plain path's
    gradients (LayerNorm from torch's statistics of the same rows) within float32 rounding."""
    import torch

    kernel, statistics = _modules()
    x0, w, b, residual, _ = (torch.as_tensor(a, dtype=torch.float32) for a in _out_projection_inputs(seed=7))
    w2 = torch.as_tensor(np.random.default_rng(8).standard_normal((64, 32)) / 8, dtype=torch.float32)
    gamma, beta = torch.linspace(0.5, 1.5, 64), torch.linspace(-1, 1, 64)

    def loss(through_partials):
        x = x0.clone().requires_grad_(True)
        out = kernel.grouped_projection(x, w, b, SPANS, WIDTHS, "out", residual=residual, tiles=(32, 16, 16, 4, 2),
                                        statistics=through_partials)
        if through_partials:
            out, partials = out
            torch.testing.assert_close(partials.means, statistics.plain_tile_partials(out, 4).means)
            norm = (partials, 1e-6, gamma, beta)
        else:
            norm = (*statistics.plain_row_statistics(out, 1e-6), gamma, beta)
        y = kernel.grouped_projection(out, w2, None, SPANS, (16, 16, 64, 48, 32), "in", norm=norm)
        return (y**2).sum(), torch.autograd.grad((y**2).sum(), x)[0]

    (value, grad), (expected_value, expected_grad) = loss(True), loss(False)
    torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=2e-4 * float(expected_grad.abs().max()))


def test_bad_partials_are_named():
    import torch

    kernel, statistics = _modules()
    x, w = torch.zeros(160, 64), torch.zeros(64, 32)
    gamma = torch.ones(64)
    good = statistics.plain_tile_partials(x, 4)
    with pytest.raises(ValueError, match="`statistics` belongs to side 'out'"):
        kernel.grouped_projection(x, w, None, SPANS, WIDTHS, "in", statistics=True)
    for partials, epsilon, message in (
            (statistics.plain_tile_partials(x[:100], 4), 1e-6, "two float32 \\(tiles, 160\\) tensors"),
            (statistics.TilePartials(good.means, good.squares[:3]), 1e-6, "two float32"),
            (statistics.TilePartials(good.means.double(), good.squares), 1e-6, "two float32"),
            (statistics.plain_tile_partials(torch.zeros(160, 60), 5), 1e-6, "tiles dividing 64"),
            (good, -1.0, "epsilon second, a finite number >= 0"),
            (good, float("inf"), "epsilon second, a finite number >= 0"),
            (good, None, "epsilon second")):
        with pytest.raises(ValueError, match=message):
            kernel.grouped_projection(x, w, None, SPANS, WIDTHS, "in", norm=(partials, epsilon, gamma, gamma))
    # short; weights missing; statistics missing (the LayerNorm would be skipped)
    for norm in ((good,), (good, 1e-6, None, None), (x[:, 0], x[:, 0], gamma, None), (None, None, gamma, gamma)):
        with pytest.raises(ValueError, match="`norm` is \\(mean, rstd, gamma, beta\\) or \\(TilePartials, epsilon, "
                                             "gamma, beta\\), none of them None"):
            kernel.grouped_projection(x, w, None, SPANS, WIDTHS, "in", norm=norm)


def test_each_program_stores_partials_for_its_own_rows_only(monkeypatch):
    """The partials of a row tile that ends inside the next group's first tile are stored for its
    group's rows only: with the next group's tiles left out of the launch (its tile table cut),
    the partials of that group's rows stay as allocated (NaN). Triton's interpreter runs the
    programs in grid order, so a store past the group's end would otherwise be overwritten by the
    next group's own program, unseen."""
    import torch

    kernel, _ = _modules()
    from keras_mone.kernels import triton_grouped_launch

    x, w, b, residual, _ = (torch.as_tensor(a, dtype=torch.float32) for a in _out_projection_inputs(seed=13))
    spans, widths = ((0, 37), (37, 160)), (32, 64)
    table_of = triton_grouped_launch.tile_table

    def first_group_only(sizes, widths, block_rows, device):  # the row tiles of the 37 rows of group one: two
        table, _, row_align = table_of(sizes, widths, block_rows, device)
        return table, 2, row_align

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(triton_grouped_launch, "tile_table", first_group_only)
    with torch.no_grad():
        _, partials = kernel.grouped_projection(x, w, b, spans, widths, "out", residual=residual,
                                                tiles=(32, 16, 16, 4, 2), statistics=True)
    for part in partials:
        assert torch.isfinite(part[:, :37]).all() and torch.isnan(part[:, 37:]).all()


def test_carried_partials_serve_only_the_very_rows_unchanged():
    """``packed_kernels``' memo gives the partials back for the remembered output or a view of
    all of it, never for part of it, another tensor, the output after an in-place change, or
    once the output is gone."""
    import torch

    _modules()
    from keras_mone.layers import packed_kernels

    out = torch.randn(12, 8)
    partials = (torch.zeros(2, 12),) * 2
    packed_kernels._remember(out, partials)
    assert packed_kernels._carried_partials(out) is partials
    assert packed_kernels._carried_partials(out.reshape(3, 4, 8).reshape(-1, 8)) is partials
    for other in (out[:6], out.clone(), out.t(), out.reshape(3, 4, 8)):
        assert packed_kernels._carried_partials(other) is None
    out.add_(1.0)
    assert packed_kernels._carried_partials(out) is None
    packed_kernels._remember(out, partials)
    del out, other  # (the last view keeps its base alive)
    gc.collect()
    assert packed_kernels._Carried.entry is None


@pytest.fixture
def matmul_precision():
    """``torch.set_float32_matmul_precision``, the precision before restored after the test."""
    import torch

    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def _counted_kernel_model(monkeypatch):
    """A MoNE ViT of three blocks in the grouped kernel form, and the list that gains an entry
    per ``row_statistics`` call."""
    _, statistics = _modules()
    from keras_mone.layers import platform_forms

    model, calls = _mone_model(depth=3), []  # (built first: its build runs a forward)
    original = statistics.row_statistics
    monkeypatch.setattr(statistics, "row_statistics", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, "grouped_kernel")
    return model, calls


def _mone_model(depth):
    from conftest import images, randomize_weights

    from keras_mone import models

    backbone = models.MoNEViTBackbone(image_size=32, patch_size=8, hidden_dim=64, depth=depth, num_heads=4,
                                      mlp_dim=128, capacity=0.3)
    model = models.ImageClassifier(backbone, num_classes=5)
    model(images()[:1])
    randomize_weights(model, seed=11)
    return model


@pytest.mark.parametrize("precision, launches", [("high", 1), ("highest", 4)])
def test_a_mone_vit_runs_one_statistics_kernel_and_agrees_with_the_kernel_form(monkeypatch, matmul_precision,
                                                                             precision, launches):
    """Three packed kernel blocks, eager, without autograd: one row statistics launch (the first
    LayerNorm), the other five LayerNorms from partials; in float32 at torch's "highest" matmul
    precision (no tensor cores, where fc1's prologue from partials spills in its loop) each LN2
    keeps the kernel: four. ``$KERAS_MONE_STATISTICS=kernel`` and autograd recording keep one
    statistics call per LayerNorm. The logits agree within float32 rounding (the statistics are
    the same numbers, summed in another order)."""
    import torch
    from conftest import assert_f32_close, images

    from keras_mone.layers import platform_forms

    model, calls = _counted_kernel_model(monkeypatch)
    matmul_precision(precision)
    logits, counts = {}, {}
    for form in ("keras", "kernel"):
        monkeypatch.setenv(platform_forms.STATISTICS_ENV, form)
        calls.clear()
        with torch.no_grad():
            logits[form] = model(images()).cpu().numpy()
        counts[form] = len(calls)
    assert counts == {"keras": launches, "kernel": 6}
    assert np.abs(logits["kernel"]).max() > 0.1
    assert_f32_close(logits["keras"], logits["kernel"], ulps=64)
    monkeypatch.setenv(platform_forms.STATISTICS_ENV, "keras")
    calls.clear()
    model(images())  # autograd recording: the op's path, statistics per LayerNorm
    assert len(calls) == 6
    calls.clear()
    with torch.inference_mode():  # no version counters: LN1 from the kernel in every block, LN2 as above
        inferred = model(images()).cpu().numpy()
    assert len(calls) == 3 + launches - 1
    assert_f32_close(inferred, logits["kernel"], ulps=64)


def test_under_torch_compile_the_kernel_writes_the_partials_in_one_graph():
    """At inference inside ``torch.compile`` (``fullgraph=True``) an out-projection with
    ``statistics=True`` is the op ``keras_mone::grouped_projection_statistics``, which writes the
    partials in the kernel; the in-projection after it combines them with torch's ops. Values:
    the eager direct launches' within float32 rounding."""
    import torch

    kernel, _ = _modules()
    x, w, b, residual, gate = (torch.as_tensor(a, dtype=torch.float32) for a in _out_projection_inputs(seed=9))
    w2 = torch.as_tensor(np.random.default_rng(10).standard_normal((64, 96)) / 8, dtype=torch.float32)
    gamma, beta = torch.linspace(0.5, 1.5, 64), torch.linspace(-1, 1, 64)

    def block_half(x):
        out, partials = kernel.grouped_projection(x, w, b, SPANS, WIDTHS, "out", residual=residual,
                                                  scale=(gate, 0.5), tiles=(32, 16, 16, 4, 2), statistics=True)
        hidden = kernel.grouped_projection(out, w2, None, SPANS, (16, 16, 64, 48, 32), "in", "gelu",
                                           norm=(partials, 1e-6, gamma, beta))
        return out, partials.means, partials.squares, hidden

    graphs = []

    def recording_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    with torch.no_grad():
        eager = block_half(x)
        compiled = torch.compile(block_half, backend=recording_backend, fullgraph=True)(x)
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert sum("grouped_projection_statistics" in t for t in targets) == 1
    assert sum(t.endswith("keras_mone.grouped_projection") or "grouped_projection.default" in t
               for t in targets if "statistics" not in t) == 1
    assert torch.equal(compiled[0], eager[0])
    for got, want in zip(compiled[1:], eager[1:]):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * float(want.abs().max()))


def test_a_compiled_mone_vit_takes_each_ln2_from_the_attentions_partials(monkeypatch, matmul_precision):
    """Under ``torch.compile`` at inference each block's LN2 takes the attention's out-projection's
    partials (the statistics are traced once per LN1 only: three of six; float32 at the "high"
    matmul precision, TF32 on a card); nothing is carried from one block to the next there. The
    logits equal the eager call's within float32 rounding."""
    import torch
    from conftest import assert_f32_close, images

    model, calls = _counted_kernel_model(monkeypatch)
    matmul_precision("high")
    x = torch.as_tensor(images())
    with torch.no_grad():
        compiled = torch.compile(lambda images: model(images), backend="aot_eager", fullgraph=True)(x)
        traced = len(calls)
        eager = model(x)
    assert traced == 3
    assert_f32_close(compiled.numpy(), eager.numpy(), ulps=64)


def test_spill_instructions_are_counted_inside_loops_only():
    """``bench/kernel_compile.py``'s ``loop_spills`` on a small piece of SASS: the spills between a
    label and the branch back to it count, those before the loop and after it, and those under a
    forward branch's label, do not."""
    import pathlib
    import sys

    _modules()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    from kernel_compile import loop_spills

    sass = """
        /*0000*/ STL [R1], R2 ;
    .L_x_0:
        /*0010*/ LDL R3, [R1] ;
        /*0020*/ HMMA R4, R5, R6 ;
        /*0030*/ STL [R1+0x4], R3 ;
        /*0040*/ @P0 BRA `(.L_x_0) ;
        /*0050*/ @P1 BRA `(.L_x_1) ;
        /*0060*/ LDL R7, [R1+0x4] ;
    .L_x_1:
        /*0070*/ STL [R1+0x8], R7 ;
        /*0080*/ EXIT ;
    """
    assert loop_spills(sass) == 2
