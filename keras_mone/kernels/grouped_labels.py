"""The names ``kernels.grouped_kernel``'s projection kernels are compiled under, and what a name
says the kernel costs.

A name states what its kernel computes (side, epilogue, shapes, token groups), so that a
compiled program's reader (``bench.hlo_kernels``) and a profile count each Pallas kernel's
FLOPs and bytes from it (``labelled_cost``), as XLA's own cost analysis cannot see inside one.
"""

import re


def kernel_label(side, contraction, columns, batch, groups, residual=False, scale=False, norm=False,
                 derivative=False, pre=False, sums=0, products=0, norm_sums=0, in_place=0):
    """The name a kernel is compiled under, which says what it computes (``labelled_cost``):
    ``grouped_out_projection_residual_scale_k3072_n768_b256_g84x96_62x192`` (``pre``: it also
    writes its pre-activations; ``sums``: its rows' sums and sums of squares, over that many
    column tiles, ``_sums6``; ``products``: a gated fc2's dX kernel's partial sums of the gate's
    gradient per row, that many: one per column tile and ``x . b``'s, ``_products49``; ``norm_sums``:
    a dX kernel's LayerNorm statistics' cotangents, two float32 values per row and column tile,
    over that many column tiles, ``_normsums6``; ``in_place``: an out-projection writing over its
    residual only the column tiles, of that many, that hold its groups' features, ``_inplace6``)."""
    epilogue = ("_norm" * bool(norm) + "_residual" * bool(residual) + "_scale" * bool(scale)
                + "_derivative" * bool(derivative) + "_pre" * bool(pre) + (f"_sums{sums}" if sums else "")
                + (f"_products{products}" if products else "") + (f"_normsums{norm_sums}" if norm_sums else "")
                + (f"_inplace{in_place}" if in_place else ""))
    layout = "_".join(f"{size}x{width}" for size, width in groups)
    return f"grouped_{side}_projection{epilogue}_k{contraction}_n{columns}_b{batch}_g{layout}"


_LABEL = re.compile(
    r"grouped_(in|out)_projection(_norm)?(_residual)?(_scale)?(_derivative)?(_pre)?(?:_sums(\d+))?"
    r"(?:_products(\d+))?(?:_normsums(\d+))?(?:_inplace(\d+))?_k(\d+)_n(\d+)_b(\d+)_g([\dx_]+)")


def labelled_cost(name, itemsize):
    """``(FLOPs, bytes)`` of a kernel named by ``kernel_label``, or ``None`` for another name.
    Bytes: the rows it reads (an in-projection only each group's first ``d`` features), the
    weights its widest group needs once (later programs find them in L2), the bias, the
    residual and scale it reads, a prologue LayerNorm's float32 statistics and weights, the
    pre-activations a ``derivative`` epilogue reads, and the ``(batch, tokens, N)`` it
    writes (twice with ``pre``: the pre-activations too; with ``sums``, two float32 values per
    row and column tile; with ``products``, one; with ``norm_sums``, two, and it reads the
    LayerNorm's input where it writes ``dn``, each group's first ``d`` features, and its float32
    means and gamma; ``in_place``: the residual read, the output and the sums written only in the
    column tiles that hold each group's features). Weights are counted at the rows' itemsize
    (under mixed precision the kernels read float32 weights: under 1% of the total, undercounted)."""
    match = _LABEL.search(name)
    if match is None:
        return None
    side, (norm, residual, scale, derivative, pre) = match.group(1), (bool(match.group(i)) for i in range(2, 7))
    sums, products, norm_sums, in_place = (int(match.group(i) or 0) for i in (7, 8, 9, 10))
    contraction, columns, batch = (int(match.group(i)) for i in (11, 12, 13))
    groups = [tuple(int(v) for v in pair.split("x")) for pair in match.group(14).strip("_").split("_")]
    tokens, nested = sum(size for size, _ in groups), sum(size * width for size, width in groups)
    widest = max(width for _, width in groups)
    rows = batch * tokens
    # the output columns each row writes (in place: its group's column tiles) and the column tiles they span
    tile = columns // in_place if in_place else columns
    spans = [-(-width // tile) for _, width in groups]
    touched = batch * sum(size * span for (size, _), span in zip(groups, spans))  # row-tiles, of `tile` columns
    written_elements = touched * tile
    if side == "in":
        flops, elements = 2 * batch * nested * columns, batch * nested + widest * columns + columns
        elements += rows * columns * derivative
    else:
        flops, elements = 2 * batch * nested * contraction, rows * contraction + contraction * widest + widest
        elements += written_elements * residual
    elements += rows * columns * pre + rows * scale
    sums_written = 2 * (touched * bool(sums) if in_place else rows * sums)  # two per row and written tile
    written = 4 * (sums_written + rows * (products + 2 * norm_sums))
    normalized_input = (itemsize * batch * nested + 4 * (rows + columns)) * bool(norm_sums)  # x, means, gamma
    return (flops, itemsize * (elements + written_elements) + norm * 4 * (2 * rows + 2 * contraction) + written
            + normalized_input)


def weight_gradient_label(side, contraction, columns, batch, splits, groups, bias=False, norm=False, scale=False):
    """The name the weight-gradient kernel is compiled under, from which a program's reader
    counts its work (``weight_gradient_cost``): ``grouped_in_weight_gradient_bias_k768_n3072_b128_s2_g84x96_...``
    (``scale``: ``dy``'s rows scaled by a factor per row, a gated fc2's, ``_scale``)."""
    layout = "_".join(f"{size}x{width}" for size, width in groups)
    features = "_norm" * bool(norm) + "_bias" * bool(bias) + "_scale" * bool(scale)
    return f"grouped_{side}_weight_gradient{features}_k{contraction}_n{columns}_b{batch}_s{splits}_g{layout}"


_WEIGHT_LABEL = re.compile(
    r"grouped_(in|out)_weight_gradient(_norm)?(_bias)?(_scale)?_k(\d+)_n(\d+)_b(\d+)_s(\d+)_g([\dx_]+)")


def weight_gradient_cost(name, itemsize):
    """``(FLOPs, bytes)`` of a kernel named by ``weight_gradient_label``, or ``None`` for another
    name: the products of every group; each group's rows of ``x`` and ``dy`` that it reads (an
    in-projection's first ``d`` features of ``x``, an out-projection's first ``d`` columns of
    ``dy``), counted once (a row tile's rereads by the other output tiles are L2 hits, at best),
    the float32 partial sums of every split written (``dW``'s, and ``db``'s with ``bias``), and a
    LayerNorm prologue's float32 statistics and weights; with ``scale``, a factor (or gate) per row."""
    match = _WEIGHT_LABEL.search(name)
    if match is None:
        return None
    side, norm, bias, scale = match.group(1), bool(match.group(2)), bool(match.group(3)), bool(match.group(4))
    contraction, columns, batch, splits = (int(match.group(i)) for i in (5, 6, 7, 8))
    groups = [tuple(int(v) for v in pair.split("x")) for pair in match.group(9).strip("_").split("_")]
    rows = batch * sum(size for size, _ in groups)
    nested = batch * sum(size * width for size, width in groups)
    full = columns if side == "in" else contraction
    statistics = 4 * (2 * rows + 2 * contraction) * norm  # a LayerNorm prologue's, float32
    partial_sums = 4 * splits * (contraction + bias) * columns
    return 2 * nested * full, itemsize * (nested + rows * full + rows * scale) + partial_sums + statistics
