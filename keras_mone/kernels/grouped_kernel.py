"""The Pallas program of ``grouped_projection`` (jax): one launch for a nested projection over
all of a block's token groups, its tiles, the name it is compiled under and what that name
says it costs. ``kernels.grouped_projection`` holds the function users call (its module
docstring gives the equations), its plain twin and its gradients; ``kernels.grouped_gradients``
runs the backward pass through this program too.
"""

import functools
import re

import jax
import jax.numpy as jnp

from keras_mone.kernels.precision import dot_precision
from keras_mone.kernels.row_sums import RowSums, one_pass
from keras_mone.kernels.tiles import check_projection_tiles as check_tiles
from keras_mone.kernels.tiles import largest_power_of_2_dividing, shape_tiles

SIDES = ("in", "out")
TILES_ENV = "KERAS_MONE_PROJECTION_TILES"
"""Tiles per kernel shape, e.g. ``768x2304=64,128,64,4,3;3072x768=64,64,64,4,3``: a ``(K, N)``
kernel it names takes those ``tiles`` where a call gives none, whatever its dtype (screen
them in the dtype that runs: a tile that fits shared memory with bf16 rows may not with
float32 ones). ``bench/grouped_tiles.py`` prints the winners of a card's screen in this form."""


def shape_fits(*dimensions):
    """Whether kernels of these ``K`` and ``N`` take the default tiles: multiples of 16 (Triton's
    smallest dot; ViT-Ti to ViT-H all are)."""
    return all(d % 16 == 0 for d in dimensions)


def default_tiles(contraction, columns, dtype):
    """Tiles for a ``(K, N)`` kernel: 128 rows on 8 warps (two Hopper warpgroups), the widest
    power of 2 up to 128 dividing ``N``, and up to 64 (16-bit) or 32 (float32) contraction
    elements per step, 3 stages. Compiled for sm_90 without a card (``bench/kernel_compile.py``'s
    ``compile_stats``) at MoNE-ViT-B/16's four projections: wgmma, no spills, 98-131 KB of
    shared memory; 64-row tiles on 4 warps read each weight panel from L2 twice as often, and
    in float32 one of them failed to compile. Not screened on a card (``bench/grouped_tiles.py``)."""
    block_cols = largest_power_of_2_dividing(columns, 128)
    block_k = largest_power_of_2_dividing(contraction, 64 if jnp.dtype(dtype).itemsize <= 2 else 32)
    return (128, block_cols, block_k, 8, 3)


def tile_override(contraction, columns, variable=TILES_ENV, check=None):
    """The tiles the environment ``variable`` (``$KERAS_MONE_PROJECTION_TILES``) names for a
    ``(K, N)`` kernel, or ``None`` (``kernels.tiles.shape_tiles``, ``check`` default ``check_tiles``)."""
    return shape_tiles(variable, contraction, columns, check or check_tiles)


def checked_groups(x, w, b, groups, side, activation=None, residual=None, scale=None, norm=None):
    """``groups`` as a tuple of ``(tokens, width)`` int pairs, after checking every argument
    (clear errors naming it)."""
    if side not in SIDES:
        raise ValueError(f"`side` must be one of {list(SIDES)}, got {side!r}.")
    if x.ndim != 3 or w.ndim != 2 or w.shape[0] != x.shape[-1] or b.shape != (w.shape[1],):
        raise ValueError(f"`x` must be (batch, tokens, K), `w` (K, N) and `b` (N,); got x {x.shape}, "
                         f"w {w.shape}, b {b.shape}.")
    if not all(jnp.issubdtype(a.dtype, jnp.floating) for a in (x, w, b)):
        raise ValueError(f"`x`, `w` and `b` must be floating point; got {x.dtype}, {w.dtype} and {b.dtype}.")
    groups = tuple((int(size), int(width)) for size, width in groups)
    limit = w.shape[0] if side == "in" else w.shape[1]
    if sum(size for size, _ in groups) != x.shape[1] or any(s < 0 or not 0 < d <= limit for s, d in groups):
        raise ValueError(f"`groups` must be (tokens, width) pairs whose tokens sum to {x.shape[1]} and whose "
                         f"widths lie in [1, {limit}] (side {side!r}); got {groups}.")
    if side == "in" and (residual is not None or scale is not None):
        raise ValueError("`residual` and `scale` belong to side 'out' (the block's residual and gate).")
    if side == "out" and (activation is not None or norm is not None):
        raise ValueError("`activation` and `norm` belong to side 'in' (fc1's epilogue, the LayerNorm before q/k/v "
                         "and fc1).")
    if norm is not None:
        summed = len(norm) == 3 and isinstance(norm[0], RowSums)
        shapes = [tuple(t.shape) for t in ((norm[0].sums, norm[0].squares, *norm[1:]) if summed else norm)]
        rows = (norm[0].sums.shape[0],) + x.shape[:2] if summed else x.shape[:2]
        if (len(norm) != 4 and not summed) or shapes != [rows, rows, (x.shape[2],), (x.shape[2],)] or (
                summed and norm[0].features != x.shape[2]):
            raise ValueError(f"`norm` must be (mean, rstd, gamma, beta) of shapes {x.shape[:2]}, {x.shape[:2]}, "
                             f"({x.shape[2]},), ({x.shape[2]},), or (RowSums of rows of {x.shape[2]}, gamma, beta); "
                             f"got {shapes or norm!r}.")
    out_shape = x.shape[:2] + (w.shape[1],)
    if residual is not None and residual.shape != out_shape:
        raise ValueError(f"`residual` must have the output's shape {out_shape}, got {residual.shape}.")
    if scale is not None:
        gated = isinstance(scale, (tuple, list))
        malformed = gated and (len(scale) != 2 or jnp.shape(scale[1]) != ())
        if malformed or (scale[0] if gated else scale).shape != x.shape[:2]:
            shown = [jnp.shape(t) for t in scale] if gated else scale.shape
            raise ValueError(f"`scale` must be (batch, tokens) = {x.shape[:2]}, or a (gate, alpha) pair of a (batch, "
                             f"tokens) gate and a scalar alpha; got {shown}.")
    return groups


def gated_scale(scale):
    """The out-projections' per-token factor in float32: ``scale``, or for a ``(gate, alpha)``
    pair MoNE's ``alpha * gate + 1`` (Eq. 1), which the kernel computes itself, so that no
    block writes its factor (one tiny kernel per block, the gates being the router's for all)."""
    if isinstance(scale, (tuple, list)):
        gate, alpha = scale
        return jnp.asarray(alpha, jnp.float32) * gate.astype(jnp.float32) + 1.0
    return scale.astype(jnp.float32)


def kernel_label(side, contraction, columns, batch, groups, residual=False, scale=False, norm=False,
                 derivative=False, pre=False, sums=0):
    """The name a kernel is compiled under, which says what it computes, so that a program's
    reader (``bench.hlo_kernels``) and a profile can count its work (``labelled_cost``):
    ``grouped_out_projection_residual_scale_k3072_n768_b256_g84x96_62x192`` (``pre``: it also
    writes its pre-activations; ``sums``: its rows' sums and sums of squares, over that many
    column tiles, ``_sums6``)."""
    epilogue = ("_norm" * bool(norm) + "_residual" * bool(residual) + "_scale" * bool(scale)
                + "_derivative" * bool(derivative) + "_pre" * bool(pre) + (f"_sums{sums}" if sums else ""))
    layout = "_".join(f"{size}x{width}" for size, width in groups)
    return f"grouped_{side}_projection{epilogue}_k{contraction}_n{columns}_b{batch}_g{layout}"


_LABEL = re.compile(
    r"grouped_(in|out)_projection(_norm)?(_residual)?(_scale)?(_derivative)?(_pre)?(?:_sums(\d+))?"
    r"_k(\d+)_n(\d+)_b(\d+)_g([\dx_]+)")


def labelled_cost(name, itemsize):
    """``(FLOPs, bytes)`` of a kernel named by ``kernel_label``, or ``None`` for another name.
    Bytes: the rows it reads (an in-projection only each group's first ``d`` features), the
    weights its widest group needs once (later programs find them in L2), the bias, the
    residual and scale it reads, a prologue LayerNorm's float32 statistics and weights, the
    pre-activations a ``derivative`` epilogue reads, and the ``(batch, tokens, N)`` it
    writes (twice with ``pre``: the pre-activations too; with ``sums``, two float32 values per
    row and column tile). Weights are counted at the rows' itemsize (under mixed precision the kernels
    read float32 weights: under 1% of the total, undercounted)."""
    match = _LABEL.search(name)
    if match is None:
        return None
    side, (norm, residual, scale, derivative, pre) = match.group(1), (bool(match.group(i)) for i in range(2, 7))
    sums = int(match.group(7) or 0)
    contraction, columns, batch = (int(match.group(i)) for i in (8, 9, 10))
    groups = [tuple(int(v) for v in pair.split("x")) for pair in match.group(11).strip("_").split("_")]
    tokens, nested = sum(size for size, _ in groups), sum(size * width for size, width in groups)
    widest = max(width for _, width in groups)
    rows = batch * tokens
    if side == "in":
        flops, elements = 2 * batch * nested * columns, batch * nested + widest * columns + columns
        elements += rows * columns * derivative
    else:
        flops, elements = 2 * batch * nested * contraction, rows * contraction + contraction * widest + widest
        elements += rows * columns * residual + rows * scale
    elements += rows * columns * pre
    return flops, itemsize * (elements + rows * columns) + norm * 4 * (2 * rows + 2 * contraction) + 8 * rows * sums


def normalized(x, mean, rstd, gamma, beta):
    """``(x - mean) * (rstd * gamma) + beta`` in float32, rounded to ``x``'s dtype (the kernel's prologue)."""
    wide = x.astype(jnp.float32)
    scale = rstd.astype(jnp.float32)[..., None] * gamma.astype(jnp.float32)
    return ((wide - mean.astype(jnp.float32)[..., None]) * scale + beta.astype(jnp.float32)).astype(x.dtype)


def pallas_projection(x, w, b, residual, scale, norm, groups, side, activation, parts, tiles, precision, interpret,
                      transposed=False, derivative=None, keep_pre=False, row_sums=False):
    """The kernel launch (arguments checked by the caller: ``grouped_projection``'s). With
    ``keep_pre`` (one part) it returns ``(pre, out)``, both stored by the epilogue: side ``"in"``
    with an ``activation``, the pre-activations and their activation (fc1 of the training form:
    fc2's forward pass reads the second, its backward pass the first); side ``"out"``, the
    projection before its gate and residual (which the gate's gradient needs). With ``row_sums``
    (one part) it returns ``(out, sums, squares)`` (``(pre, out, sums, squares)`` with both):
    each program also stores its rows' sums and sums of squares of the values it stored, in
    float32, ``(column tiles, batch, tokens)`` each (the next LayerNorm's one-pass statistics,
    without a pass over ``out``). Three more forms serve the backward passes
    (``kernels.grouped_gradients``):

    * ``transposed``: ``w`` is given as ``(N, K)`` and read transposed, tile by tile (a dX
      kernel's ``W^T`` without a transposed copy of the weights written first).
    * ``derivative``: ``(function, pre)``, side ``"in"``: the epilogue multiplies by
      ``function'(pre)`` (elementwise, in float32; ``pre`` ``(batch, tokens, N)``), so the dX
      kernel of an out-projection of ``function(pre)`` writes ``d pre`` directly.
    * ``x`` a tuple of equal parts along the contraction, side ``"out"``, no ``norm``: each read
      where it lies (the dX kernel of q/k/v reads their three cotangents, not a joined copy).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    pieces = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    if len(pieces) > 1 and (side != "out" or norm is not None or pieces[0].shape[-1] % tiles[2]):
        raise ValueError(f"`x` in parts needs side 'out', no `norm` and parts of whole contraction steps "
                         f"({tiles[2]}); got side {side!r} and parts of {pieces[0].shape[-1]}.")
    x = pieces[0]
    batch, tokens = x.shape[:2]
    contraction = len(pieces) * x.shape[-1]
    columns = w.shape[0] if transposed else w.shape[1]
    block_rows, block_cols, block_k, num_warps, num_stages = tiles
    table, first_tile = _row_tile_table(groups, batch, block_rows)
    outputs = 2 if keep_pre else parts
    if not table:  # every group empty: no tokens
        empty = jnp.zeros(x.shape[:2] + (columns // parts,), x.dtype)
        nothing = jnp.zeros((columns // block_cols,) + x.shape[:2], jnp.float32)
        results = (empty,) * outputs + (nothing,) * (2 * row_sums)
        return results[0] if len(results) == 1 else results
    operands = [*(piece.reshape(batch * tokens, -1) for piece in pieces), w, b.reshape(1, columns)]
    if residual is not None:
        operands.append(residual.reshape(batch * tokens, columns))
    gated = isinstance(scale, (tuple, list))
    if scale is not None:  # a factor per row, or a gate per row and alpha (its factor computed by the kernel)
        operands.append((scale[0] if gated else scale).reshape(1, batch * tokens))
        if gated:
            operands.append(jnp.reshape(scale[1], (1, 1)).astype(jnp.float32))
    has_norm = _norm_operands(norm, batch * tokens, operands)
    if derivative is not None:
        operands.append(derivative[1].reshape(batch * tokens, columns))
    kernel = functools.partial(
        _projection_tile, table=tuple(table), batch=batch, tokens=tokens, side=side, activation=activation,
        blocks=(block_rows, block_cols, block_k), has_residual=residual is not None,
        has_scale=None if scale is None else ("gate" if gated else "scale"),
        has_norm=has_norm, parts=parts, precision=dot_precision(precision), transposed=transposed,
        derivative_of=None if derivative is None else derivative[0], input_parts=len(pieces), keep_pre=keep_pre,
        row_sums=row_sums,
    )
    shapes = [jax.ShapeDtypeStruct((batch * tokens, columns // parts), x.dtype)] * outputs
    shapes += [jax.ShapeDtypeStruct((columns // block_cols, batch * tokens), jnp.float32)] * (2 * row_sums)
    out = pl.pallas_call(
        kernel,
        # the column tiles vary fastest: a row tile's inputs are read from L2 for its every column tile
        grid=(columns // block_cols, first_tile),
        out_shape=shapes[0] if len(shapes) == 1 else tuple(shapes),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=kernel_label(side, contraction, columns, batch, groups, residual is not None, scale is not None,
                          norm is not None, derivative is not None, keep_pre, row_sums and columns // block_cols),
    )(*operands)
    results = list(out) if len(shapes) > 1 else [out]
    results = [t.reshape(batch, tokens, columns // parts) for t in results[:outputs]] + [
        t.reshape(-1, batch, tokens) for t in results[outputs:]]  # (the row sums per column tile)
    return results[0] if len(results) == 1 else tuple(results)


def _norm_operands(norm, rows, operands):
    """Appends a prologue's ``norm`` to ``operands``, float32: the statistics per row (or a
    ``RowSums``' partial sums per column tile and row, which the prologue finishes), the weights
    per feature. Returns the kernel's ``has_norm``: ``False``, ``True`` or ``(tiles, epsilon)``."""
    if norm is None:
        return False
    if isinstance(norm[0], RowSums):
        operands += [norm[0].sums.reshape(-1, rows), norm[0].squares.reshape(-1, rows)]
        operands += [t.astype(jnp.float32).reshape(1, -1) for t in norm[1:]]
        return norm[0].sums.shape[0], norm[0].epsilon
    operands += [t.astype(jnp.float32).reshape(1, -1) for t in norm]
    return True


def _row_tile_table(groups, batch, block_rows):
    """``(table, row tiles)``: each non-empty group's ``(first tile, tokens, first token, width)``, in
    order, its rows gathered across the batch into tiles of ``block_rows``."""
    table, first_tile, first_token = [], 0, 0
    for size, width in groups:
        if size:
            table.append((first_tile, size, first_token, width))
            first_tile += -(-batch * size // block_rows)
        first_token += size
    return table, first_tile


def _projection_tile(*refs, table, batch, tokens, side, activation, blocks, has_residual, has_scale, has_norm, parts,
                     precision, transposed, derivative_of, input_parts, keep_pre, row_sums):
    """One program: ``block_rows`` rows of one group by ``block_cols`` output columns."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    x_refs, (w_ref, b_ref), refs = refs[:input_parts], refs[input_parts:input_parts + 2], refs[input_parts + 2:]
    stored = (2 if keep_pre else parts) + 2 * row_sums
    inputs, outputs = refs[:len(refs) - stored], refs[len(refs) - stored:]
    block_rows, block_cols, block_k = blocks
    column_tile, row_tile = pl.program_id(0), pl.program_id(1)

    def of_this_group(values):  # the value of the group this row tile belongs to (a static table)
        chosen = jnp.int32(values[0])
        for (first, *_), value in zip(table[1:], values[1:]):
            chosen = jnp.where(row_tile >= first, jnp.int32(value), chosen)
        return chosen

    first, size, first_token, width = (of_this_group(column) for column in zip(*table))
    index = (row_tile - first) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # the group's rows
    valid = index < batch * size
    rows = jax.lax.div(index, size) * tokens + first_token + jax.lax.rem(index, size)  # rows of the (B T, K) view
    # rows past the group's end point past the array: masked on the card, dropped by the interpreter's
    # scatter (an in-range row there would be written twice in one store)
    rows = jnp.where(valid, rows, batch * tokens)
    start = column_tile * block_cols
    columns = start + jnp.arange(block_cols, dtype=jnp.int32)
    part_contraction = x_refs[0].shape[1]
    if side == "in":  # the contraction stops at the group's width (one part)
        steps, limit = (width + block_k - 1) // block_k, width
    else:  # column tiles past the group's width have nothing to compute
        # (a product, not jnp.where: Pallas' Triton lowering left the loop unverifiable with a select)
        steps, limit = (start < width).astype(jnp.int32) * (part_contraction // block_k), part_contraction

    if has_norm:  # the rows' LayerNorm statistics, loaded once per tile
        mean, rstd = _prologue_statistics(inputs, rows, valid, has_norm, part_contraction)

    def step(k, accumulator, x_ref, offset):
        inner = k * block_k + jnp.arange(block_k, dtype=jnp.int32)
        mask = valid[:, None] & (inner < limit)[None, :]
        tile = pl_triton.load(x_ref.at[rows[:, None], inner[None, :]], mask=mask, other=0)
        contracted = pl.ds(pl.multiple_of(offset + k * block_k, block_k), block_k)  # the weights' rows
        if has_norm:  # the prologue: (x - mean) * (rstd * gamma) + beta, as normalized; zeros past the width
            gamma, beta = (ref[:, contracted] for ref in inputs[2:4])
            normed = (tile.astype(jnp.float32) - mean[:, None]) * (rstd[:, None] * gamma) + beta
            tile = jnp.where(mask, normed, 0.0).astype(tile.dtype)
        if transposed:  # (block_cols, block_k) of the (N, K) array given
            weights = w_ref[pl.ds(start, block_cols), contracted].T
        else:
            weights = w_ref[contracted, pl.ds(start, block_cols)]
        return accumulator + jnp.dot(tile, weights.astype(tile.dtype), precision=precision,
                                     preferred_element_type=jnp.float32)

    accumulator = jnp.zeros((block_rows, block_cols), jnp.float32)
    for part, x_ref in enumerate(x_refs):  # the contraction part by part (one part but for dX of q/k/v)
        part_step = functools.partial(step, x_ref=x_ref, offset=part * part_contraction)
        accumulator = jax.lax.fori_loop(0, steps, part_step, accumulator)
    accumulator = accumulator + b_ref[:, pl.ds(start, block_cols)].astype(jnp.float32)
    if side == "out":  # Eq. 7's Pad: zeros past the group's width, in the output and in what keep_pre stores
        accumulator = jnp.where((columns < width)[None, :], accumulator, 0.0)
    if keep_pre:  # the pre-activations (an out-projection's before its gate and residual) first, then the output
        pre_ref, *outputs = outputs
        pl_triton.store(pre_ref.at[rows[:, None], columns[None, :]], accumulator.astype(pre_ref.dtype),
                        mask=valid[:, None])
    accumulator = _epilogue(accumulator, inputs, rows, columns, valid, side, activation, derivative_of,
                            has_scale, has_residual).astype(outputs[0].dtype)
    _store(outputs, accumulator, rows, columns, valid, (start, column_tile), parts, row_sums)


def _store(outputs, tile, rows, columns, valid, place, parts, row_sums):
    """Stores a program's output ``tile`` (in the part its columns lie in) and, with ``row_sums``,
    its rows' sums and sums of squares of the stored values (float32) at its column tile.
    ``place``: the tile's first column and its column tile's index."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    start, column_tile = place
    if row_sums:
        *outputs, sums_ref, squares_ref = outputs
        wide = tile.astype(jnp.float32)
        pl_triton.store(sums_ref.at[column_tile, rows], jnp.sum(wide, axis=1), mask=valid)
        pl_triton.store(squares_ref.at[column_tile, rows], jnp.sum(wide * wide, axis=1), mask=valid)
    if parts == 1:
        pl_triton.store(outputs[0].at[rows[:, None], columns[None, :]], tile, mask=valid[:, None])
        return
    width_of_part = outputs[0].shape[1]
    for part, out_ref in enumerate(outputs):  # the part this column tile lies in
        @pl.when(start // width_of_part == part)
        def _store_part(out_ref=out_ref, part=part):
            inner = columns - part * width_of_part
            pl_triton.store(out_ref.at[rows[:, None], inner[None, :]], tile, mask=valid[:, None])


def _prologue_statistics(inputs, rows, valid, has_norm, features):
    """The tile's rows' ``(mean, rstd)``: loaded, or with ``has_norm`` ``(tiles, epsilon)`` finished
    from the partial sums of the kernel that wrote the rows (``kernels.row_sums``, one pass)."""
    from jax.experimental.pallas import triton as pl_triton

    if has_norm is True:
        return (pl_triton.load(ref.at[0, rows], mask=valid, other=0) for ref in inputs[:2])
    tiles, epsilon = has_norm
    sums, squares = (sum(pl_triton.load(ref.at[tile, rows], mask=valid, other=0) for tile in range(tiles))
                     for ref in inputs[:2])
    return one_pass(sums, squares, features, epsilon)


def _epilogue(accumulator, inputs, rows, columns, valid, side, activation, derivative_of, has_scale, has_residual):
    """A program's float32 tile after its bias (an out-projection's already zero past the group's
    width): an in-projection's activation or derivative, an out-projection's gate and residual."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    if side == "in":
        if activation is not None:
            accumulator = activation(accumulator)
        if derivative_of is not None:  # d pre = d out * function'(pre)
            pre = pl_triton.load(inputs[-1].at[rows[:, None], columns[None, :]], mask=valid[:, None], other=0)
            pre = pre.astype(jnp.float32)
            accumulator = accumulator * jax.jvp(derivative_of, (pre,), (jnp.ones_like(pre),))[1]
        return accumulator
    if has_scale:  # "scale": the factor per row; "gate": alpha g + 1 from the gate per row and alpha
        factor_ref = inputs[-2] if has_scale == "gate" else inputs[-1]
        scale = pl_triton.load(factor_ref.at[0, rows], mask=valid, other=0).astype(jnp.float32)
        if has_scale == "gate":
            scale = inputs[-1][0, pl.ds(0, 1)] * scale + 1.0
        accumulator = accumulator * scale[:, None]
    if has_residual:
        residual = pl_triton.load(inputs[0].at[rows[:, None], columns[None, :]], mask=valid[:, None], other=0)
        accumulator = accumulator + residual.astype(jnp.float32)
    return accumulator
