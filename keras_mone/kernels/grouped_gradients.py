"""The backward pass of a grouped nested projection as grouped kernels (jax; issue 40).

``grouped_projection``'s kernel runs a nested projection over all of a block's token groups
in one launch (MoNE App. A.1 Eq. 5-7). Its gradients are grouped nested products too:

* **dX** is the same kind of projection on the other side, by ``W^T``. An in-projection's
  ``dx[:, g, :d_g] = dy[:, g] @ W[:d_g]^T`` is an out-projection of ``dy`` (it writes only
  the group's first ``d_g`` features); an out-projection's ``dx[:, g] = dy[:, g, :d_g] @
  W[:, :d_g]^T`` is an in-projection (its contraction stops at ``d_g``). Both run through
  ``grouped_projection``'s kernel, which reads ``W`` transposed tile by tile (no transposed
  copy). fc2's takes the GELU's derivative in its epilogue (``input_activation``), so it
  writes fc1's pre-activation cotangent: the GELU's backward pass is no separate pass.
* **dW** (``grouped_weight_gradient``): ``dW[:d_g] += x_g[:, :d_g]^T dy_g`` (in) or
  ``dW[:, :d_g] += x_g^T dy_g[:, :d_g]`` (out), one launch for all groups. A program owns one
  ``block_k x block_n`` tile of ``dW``. It walks the groups whose width reaches its tile, and
  their token rows, gathered across the batch. The rows are cut into ``splits`` chunks,
  whose partial tiles XLA then sums, so that even a 768 x 768 weight gives the card enough
  programs.
* **db** (column sums of ``dy``; an out-projection's group ``g`` adds only its first ``d_g``
  columns) in the same launch (``bias=True``): the programs of ``dW``'s first row tile sum
  the ``dy`` tiles they load anyway, so ``dy`` is not read again for it.
* q, k and v's cotangents (attention's backward pass writes three tensors) are read apart by
  both kernels, never joined.
* The LayerNorm prologue's vjp: its statistics' cotangents need two row sums over ``d
  normalized``, which the dX kernel's epilogue sums per column tile as it writes it
  (``pallas_projection``'s ``norm_sums``); the rest is elementwise and column sums, XLA's
  (``normalized_cotangents``).

``projection_gradients`` is the backward pass of a projection from its output's cotangent (no
activation epilogue, or fc1 keeping its pre-activations beside its activation; with or without
the LayerNorm prologue, ``parts`` and ``input_activation``): the form ``layers.grouped_block``
takes in training. ``grouped_projection``'s vjp gives an out-projection's residual and gate their
cotangents and passes the gated one on (``factor * d out``). ``plain_weight_gradient`` and
``plain_bias_gradient`` are ``dW`` and ``db`` with XLA's ops: the references the kernel equals.
"""

import functools

import jax
import jax.numpy as jnp

from keras_mone.kernels.grouped_kernel import (
    checked_groups, default_tiles, largest_power_of_2_dividing, pallas_projection, tile_override,
)
from keras_mone.kernels.grouped_labels import weight_gradient_label
from keras_mone.kernels.grouped_tile import row_factor, scale_operands
from keras_mone.kernels.precision import dot_precision, precision_name
from keras_mone.kernels.tiles import launchable

WEIGHT_TILES_ENV = "KERAS_MONE_WEIGHT_GRADIENT_TILES"
"""Tiles per weight shape, e.g. ``768x3072=64,128,128,8,3;3072x768=32,128,64,4,3`` (``(K, N)`` of
the weight; the values ``grouped_weight_gradient``'s ``tiles``): taken where a call gives
none. ``bench/weight_gradient_tiles.py`` prints a card's winners in this form."""

TARGET_PROGRAMS = 264
"""Programs a weight-gradient launch aims at (two per streaming multiprocessor of an H100 or
H200): ``default_splits`` cuts the token rows into as many chunks as that takes."""


def plain_weight_gradient(x, dy, groups, side):
    """``dW`` of a grouped nested projection with XLA's ops, one product per group, float32.

    Args:
        x: ``(batch, tokens, K)``, the projection's input (an in-projection's after its
            LayerNorm); ``dy``: ``(batch, tokens, N)``, its output's cotangent.
        groups, side: as ``grouped_projection``'s.

    Returns:
        ``(K, N)`` float32.
    """
    contraction, columns = x.shape[-1], dy.shape[-1]
    out, start = jnp.zeros((contraction, columns), jnp.float32), 0
    for size, width in groups:
        rows = x[:, start:start + size].reshape(-1, contraction)
        upstream = dy[:, start:start + size].reshape(-1, columns)
        if side == "in":
            out = out.at[:width].add(jnp.dot(rows[:, :width].T, upstream, preferred_element_type=jnp.float32))
        else:
            out = out.at[:, :width].add(jnp.dot(rows.T, upstream[:, :width], preferred_element_type=jnp.float32))
        start += size
    return out


def plain_bias_gradient(dy, groups, side):
    """``db`` of a grouped nested projection with XLA's ops, float32: the column sums of ``dy``
    (an out-projection's group adds only its first ``d_g`` columns)."""
    if side == "in":
        return jnp.sum(dy.astype(jnp.float32), axis=(0, 1))
    out, start = jnp.zeros((dy.shape[-1],), jnp.float32), 0
    for size, width in groups:
        out = out.at[:width].add(jnp.sum(dy[:, start:start + size, :width].astype(jnp.float32), axis=(0, 1)))
        start += size
    return out


def grouped_weight_gradient(x, dy, groups, side, tiles=None, splits=None, precision=None, interpret=False,
                            bias=False, norm=None, scale=None):
    """``plain_weight_gradient`` as one Pallas kernel launch (see the module docstring).

    Args: those of ``plain_weight_gradient``, and
        tiles: ``(block_rows, block_k, block_n, num_warps, num_stages)`` (the first four powers
            of 2, blocks of at least 16; ``block_k`` must divide K and ``block_n`` divide N);
            ``None``: those ``$KERAS_MONE_WEIGHT_GRADIENT_TILES`` names for ``(K, N)``, else
            ``default_weight_tiles``.
        splits: chunks of each group's token rows, summed by XLA afterwards; ``None``:
            ``default_splits``.
        precision: ``"default"`` or ``"highest"``; ``None``: what jax's
            ``default_matmul_precision`` asks now (``kernels.precision.precision_name``).
        interpret: run through Pallas' interpreter (no accelerator needed).
        bias: also return ``plain_bias_gradient`` from the same launch: ``(dW, db)``.
        norm: side ``"in"``: ``(mean, rstd, gamma, beta)`` of the LayerNorm before the
            projection (``grouped_projection``'s ``norm``): ``x`` is normalised tile by tile as
            it is loaded (``normalized``), so the normalised tokens are not written for it.
        scale: ``dy`` scaled per row first, ``(factor * dy)`` rounded to ``dy``'s dtype: a
            ``(batch, tokens)`` factor, or a ``(gate, alpha)`` pair whose factor is MoNE's
            ``alpha g + 1`` (Eq. 1; ``grouped_projection``'s ``scale``), computed as each tile is
            loaded (the gated fc2's ``dW`` and ``db``, without a scaled copy of ``dy``).

    ``dy`` may also be a tuple of equal parts along its columns (q, k and v's cotangents): the
    kernel reads each where a column tile lies, without a joined copy (each part's width a
    multiple of ``block_n``).
    """
    parts = tuple(dy) if isinstance(dy, (tuple, list)) else (dy,)
    if x.ndim != 3 or any(p.ndim != 3 or p.shape != parts[0].shape for p in parts) or x.shape[:2] != parts[0].shape[:2]:
        raise ValueError(f"`x` must be (batch, tokens, K) and `dy` (batch, tokens, N) or equal parts of it; got "
                         f"{x.shape} and {[p.shape for p in parts]}.")
    floating = [jnp.issubdtype(t.dtype, jnp.floating) for t in (x, *parts)]
    if not all(floating) or any(p.dtype != x.dtype for p in parts):
        raise ValueError(f"`x` and `dy` must be floating point of one dtype; got {x.dtype} and "
                         f"{[str(p.dtype) for p in parts]}.")
    precision = precision_name() if precision is None else precision
    dot_precision(precision)  # a clear error for another name, before the launch is traced
    columns = len(parts) * parts[0].shape[-1]
    # the projection's checks of groups and side, on the weight's shape only (nothing allocated)
    weight = jax.ShapeDtypeStruct((x.shape[-1], columns), x.dtype)
    groups = checked_groups(x, weight, jax.ShapeDtypeStruct((columns,), x.dtype), groups, side, scale=scale)
    part_width = parts[0].shape[-1]
    if tiles is None:
        check = (lambda tiles, k, n: check_weight_tiles(tiles, k, part_width))
        tiles = (tile_override(x.shape[-1], columns, WEIGHT_TILES_ENV, check)
                 or default_weight_tiles(x.shape[-1], part_width, x.dtype))
    tiles = tuple(tiles)
    check_weight_tiles(tiles, x.shape[-1], part_width)
    splits = default_splits(x.shape[-1], columns, tiles) if splits is None else splits
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"`splits` must be a positive int, got {splits!r}.")
    dy = parts if len(parts) > 1 else parts[0]
    if norm is not None:
        shapes = [tuple(t.shape) for t in norm] if len(norm) == 4 else None
        if side != "in" or shapes != [x.shape[:2], x.shape[:2], x.shape[2:], x.shape[2:]]:
            raise ValueError(f"`norm` belongs to side 'in' and must be (mean, rstd, gamma, beta) of shapes "
                             f"{x.shape[:2]}, {x.shape[:2]}, {x.shape[2:]}, {x.shape[2:]}; got side {side!r} and "
                             f"{shapes or norm!r}.")
        norm = tuple(t.astype(jnp.float32) for t in norm)
    scale = tuple(scale) if isinstance(scale, (tuple, list)) else scale
    dw, db = _weight_gradient(x, dy, norm, scale, groups, side, tiles, splits, precision, bool(interpret), bool(bias))
    return (dw, db) if bias else dw


def default_weight_tiles(contraction, columns, dtype):
    """``(64, 128, 128, 8, 3)``: 64 token rows per step into a 128 x 128 tile of ``dW`` on 8
    warps (32 rows and 2 stages in float32), the blocks narrowed to divide ``K`` and ``N``."""
    wide = jnp.dtype(dtype).itemsize > 2
    block_k, block_n = (largest_power_of_2_dividing(n, 128) for n in (contraction, columns))
    return (32 if wide else 64, block_k, block_n, 8, 2 if wide else 3)


def default_splits(contraction, columns, tiles):
    """Chunks of the token rows that bring a launch to ``TARGET_PROGRAMS`` programs (at most 16)."""
    output_tiles = (contraction // tiles[1]) * (columns // tiles[2])
    return max(1, min(16, -(-TARGET_PROGRAMS // output_tiles)))


def check_weight_tiles(tiles, contraction, columns):
    """Raises ``ValueError`` naming what is wrong with ``tiles`` for a ``(K, N)`` weight."""
    if not launchable(tuple(tiles), blocks=3):
        raise ValueError(f"`tiles` must be (block_rows, block_k, block_n, num_warps, num_stages): four powers of 2, "
                         f"blocks of at least 16, and a positive stage count; got {tiles!r}.")
    if contraction % tiles[1] or columns % tiles[2]:
        raise ValueError(f"`tiles`' block_k ({tiles[1]}) must divide K = {contraction} and block_n ({tiles[2]}) "
                         f"divide N = {columns}.")


def projection_gradients(x, w, b, norm, groups, side, parts, precision, interpret, upstream, input_activation=None,
                         activated=None, scale=None):
    """The cotangents of ``(x, w, b, residual, scale, norm)`` of a projection without an
    epilogue (see the module docstring): dX by a grouped projection kernel, dW and db by the
    weight-gradient kernel, the LayerNorm's vjp from the row sums the dX kernel adds
    (``normalized_cotangents``). ``upstream``: the output's cotangent (``parts`` tensors where it
    has parts: read apart, never joined). ``input_activation`` (side ``"out"``): the
    projection took ``activated = input_activation(x)``; the dX kernel's epilogue multiplies
    by the activation's derivative at ``x``, so its output is ``x``'s cotangent (fc2 of a
    training call: the GELU's backward pass is no separate pass over the hidden activations).
    ``scale`` (with ``input_activation``): the gate of a gated fc2, ``residual + factor * projection``,
    whose cotangent the fifth returns (``gate_cotangents``): ``upstream`` is the output's, which both
    kernels scale per row as they load it, and the dX kernel's epilogue sums the gate's gradient
    ``sum_D(d out * projection)`` as ``sum_H(activated * (d out W^T)) + d out . b`` (``pallas_projection``'s
    ``products``): no scaled cotangent, no projection kept and no pass over ``d out`` for it."""
    # q, k and v's cotangents stay apart: both kernels read each part where it lies
    dy = upstream.astype(x.dtype) if parts == 1 else tuple(part.astype(x.dtype) for part in upstream)
    contraction, columns = w.shape
    # dX's kernel reads w transposed, tile by tile, and casts its tiles: no (N, K) copy is written
    tiles = tile_override(columns, contraction) or dx_tiles(columns, contraction, x.dtype, input_activation is not None,
                                                            scale is not None)
    zeros = jnp.zeros((contraction,), jnp.float32)
    inputs = x if input_activation is None else activated
    # in: dx[:, g, :d_g] = dy_g @ W[:d_g]^T, an out-projection by W^T (with a LayerNorm prologue its
    # epilogue sums the statistics' cotangents); out: dx[:, g] = dy_g[:, :d_g] @ W[:, :d_g]^T, an
    # in-projection by W^T
    derivative = None if input_activation is None else (input_activation, x)
    dx = pallas_projection(dy, w, zeros, None, scale, None, groups, "out" if side == "in" else "in", None, 1, tiles,
                           precision, interpret, transposed=True, derivative=derivative,
                           products=None if scale is None else b,
                           norm_sums=None if norm is None else (x, norm[0], norm[2]))
    d_scale = None
    if scale is not None:  # the gate's gradient: sum_D(d out * (h W + b)) = sum_H(h * (d out W^T)) + d out . b
        dx, partials = dx
        d_scale = gate_cotangents(jnp.sum(partials, axis=0), scale)
    dw, db = grouped_weight_gradient(inputs, dy, groups, side, precision=precision, interpret=interpret, bias=True,
                                     norm=norm, scale=scale)
    dnorm = None
    if norm is not None:  # (the weight-gradient kernel normalises x itself: the normalised tokens are not kept)
        dx, sums, centred = dx
        dx, *dnorm = normalized_cotangents(dx, x, *norm, jnp.sum(sums, axis=0), jnp.sum(centred, axis=0))
        dnorm = tuple(dnorm)
    return dx, dw.astype(w.dtype), db.astype(b.dtype), None, d_scale, dnorm


def normalized_cotangents(dn, x, mean, rstd, gamma, beta, sums, centred):
    """The cotangents of ``normalized(x, mean, rstd, gamma, beta)``'s inputs from its output's,
    ``dn``, and the rows' ``sums = sum_D(dn * gamma)`` and ``centred = sum_D(dn * gamma * (x -
    mean))`` (float32, a dX kernel's ``norm_sums``): ``dx = dn * rstd * gamma``, ``d mean = -rstd *
    sums``, ``d rstd = centred`` and the weights' column sums, each in its input's dtype. The same
    as ``jax.vjp(normalized, ...)`` within float32 rounding, without its pass over ``dn`` and ``x``
    for the two row sums (XLA fuses what is left into one pass with the weights' sums)."""
    wide = dn.astype(jnp.float32)
    rstd32, gamma32 = rstd.astype(jnp.float32), gamma.astype(jnp.float32)
    centred_x = x.astype(jnp.float32) - mean.astype(jnp.float32)[..., None]
    d_gamma = jnp.sum(wide * centred_x * rstd32[..., None], axis=(0, 1))
    return ((wide * (rstd32[..., None] * gamma32)).astype(x.dtype), (-rstd32 * sums).astype(mean.dtype),
            centred.astype(rstd.dtype), d_gamma.astype(gamma.dtype), jnp.sum(wide, axis=(0, 1)).astype(beta.dtype))


def dx_tiles(contraction, columns, dtype, derivative, products):
    """A dX kernel's default tiles: ``default_tiles``, with 64 columns, not 128, where its epilogue
    holds the GELU's derivative in float32 rows, or also the GELU's values for the gate's
    gradient (``products``). Compiled for sm_90 without a card (``bench/grouped_kernel_compile.py``,
    MoNE-ViT-B/16's fc2, batch 256), 128 columns spilled after the loop: 152 bytes (float32,
    derivative), 52 (bf16, products), 3572 (float32, products); 64 columns spill nothing (108,
    156 and 197 registers)."""
    tiles = default_tiles(contraction, columns, dtype)
    if (derivative and jnp.dtype(dtype).itemsize > 2) or products:
        tiles = (tiles[0], largest_power_of_2_dividing(columns, 64), *tiles[2:])
    return tiles


def gate_cotangents(product, scale):
    """The cotangent of ``scale`` in ``out = residual + factor * projection`` from ``product =
    sum_D(d out * projection)`` per row (float32): a factor's is ``product``; a ``(gate, alpha)``
    pair's (MoNE's ``alpha g + 1``, Eq. 1) ``alpha * product`` and ``sum(gate * product)``, each
    cast to its input's dtype."""
    if not isinstance(scale, tuple):
        return product.astype(scale.dtype)
    gate, alpha = scale
    return ((alpha.astype(jnp.float32) * product).astype(gate.dtype),
            jnp.sum(gate.astype(jnp.float32) * product).astype(alpha.dtype))


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7, 8, 9, 10))
def _weight_gradient(x, dy, norm, scale, groups, side, tiles, splits, precision, interpret, bias):
    """``(dW, db)``: ``db`` ``None`` unless ``bias``. ``dy``: one array or a tuple of equal parts
    along the columns."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    parts = dy if isinstance(dy, tuple) else (dy,)
    batch, tokens, contraction = x.shape
    columns = sum(part.shape[-1] for part in parts)
    block_rows, block_k, block_n, num_warps, num_stages = tiles
    table, first_token = [], 0  # (first token, tokens, width) of each non-empty group
    for size, width in groups:
        if size:
            table.append((first_token, size, width))
        first_token += size
    if not table:
        return jnp.zeros((contraction, columns), jnp.float32), (jnp.zeros((columns,), jnp.float32) if bias else None)
    factors, has_scale = scale_operands(scale, batch * tokens)  # per row (and alpha)
    kernel = functools.partial(_weight_tile, table=tuple(table), batch=batch, tokens=tokens, side=side,
                               blocks=(block_rows, block_k, block_n), splits=splits, bias=bias, parts=len(parts),
                               has_norm=norm is not None, has_scale=has_scale, precision=dot_precision(precision))
    statistics = () if norm is None else tuple(t.reshape(1, -1) for t in norm)  # per row, then per feature
    partial_sums = jax.ShapeDtypeStruct((splits * contraction, columns), jnp.float32)
    outputs = pl.pallas_call(
        kernel,
        grid=(splits, contraction // block_k, columns // block_n),
        out_shape=(partial_sums, jax.ShapeDtypeStruct((splits, columns), jnp.float32)) if bias else partial_sums,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=weight_gradient_label(side, contraction, columns, batch, splits, groups, bias, norm is not None,
                                   scale is not None),
    )(x.reshape(batch * tokens, contraction), *(part.reshape(batch * tokens, -1) for part in parts), *statistics,
      *factors)
    partial, column_sums = outputs if bias else (outputs, None)
    dw = jnp.sum(partial.reshape(splits, contraction, columns), axis=0)
    return dw, (None if column_sums is None else jnp.sum(column_sums, axis=0))


def _weight_tile(x_ref, *refs, table, batch, tokens, side, blocks, splits, bias, parts, has_norm, has_scale,
                 precision):
    """One program: one ``block_k x block_n`` tile of ``dW`` over one chunk of every group's rows;
    with ``bias``, the programs of the first row tile also sum the ``dy`` columns they load
    (``db``: an out-projection's loads are already cut at each group's width). ``dy`` comes in
    ``parts`` equal column blocks (q, k and v's cotangents, not joined first): a column tile
    reads the part it lies in. With ``has_scale`` each ``dy`` tile is scaled per row as loaded."""
    from jax.experimental import pallas as pl

    dy_refs, refs = refs[:parts], refs[parts:]
    norm_refs, refs = refs[:4 * has_norm], refs[4 * has_norm:]
    factor_count = {None: 0, "scale": 1, "gate": 2}[has_scale]
    factor_refs, out_refs = refs[:factor_count], refs[factor_count:]
    part_width = dy_refs[0].shape[1]
    program = tuple(pl.program_id(axis) for axis in range(3))  # (read here: Pallas' interpreter takes no
    column_tile = program[2]                                    # program_id inside a branch)
    tile = functools.partial(_weight_tile_of_part, x_ref, out_refs=out_refs, norm_refs=norm_refs,
                             factor_refs=factor_refs, has_scale=has_scale, program=program, table=table,
                             batch=batch, tokens=tokens, side=side, blocks=blocks, splits=splits, bias=bias,
                             precision=precision)
    if parts == 1:
        return tile(dy_refs[0], 0)
    for part, dy_ref in enumerate(dy_refs):
        pl.when(column_tile * blocks[2] // part_width == part)(functools.partial(tile, dy_ref, part * part_width))


def _weight_tile_of_part(x_ref, dy_ref, offset, *, out_refs, norm_refs, factor_refs, has_scale, program, table, batch,
                         tokens, side, blocks, splits, bias, precision):
    """``_weight_tile`` with ``dy``'s columns ``[offset, offset + dy_ref's width)`` in ``dy_ref``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    block_rows, block_k, block_n = blocks
    split, row_tile, column_tile = program
    features = row_tile * block_k + jnp.arange(block_k, dtype=jnp.int32)
    columns = column_tile * block_n + jnp.arange(block_n, dtype=jnp.int32)
    sums_here = row_tile == 0  # every group reaches dW's first row tile (widths are at least 1)
    if norm_refs:  # the LayerNorm's weights of this tile's features
        gamma, beta = (ref[:, pl.ds(pl.multiple_of(row_tile * block_k, block_k), block_k)] for ref in norm_refs[2:])
    carry = (jnp.zeros((block_k, block_n), jnp.float32), jnp.zeros((block_n,), jnp.float32))
    for first_token, size, width in table:  # static: a few groups
        steps_total = -(-batch * size // block_rows)
        # this split's row tiles of the group; none where the tile lies past the group's width
        reaches = (row_tile * block_k < width) if side == "in" else (column_tile * block_n < width)
        low = jax.lax.div(split * steps_total, splits)
        high = jax.lax.div((split + 1) * steps_total, splits)
        feature_mask = (features < width) if side == "in" else jnp.ones((block_k,), jnp.bool_)
        column_mask = (columns < width) if side == "out" else jnp.ones((block_n,), jnp.bool_)

        def step(i, carry, first_token=first_token, size=size, low=low, feature_mask=feature_mask,
                 column_mask=column_mask):
            accumulator, column_sums = carry
            index = (low + i) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
            valid = index < batch * size
            rows = jax.lax.div(index, size) * tokens + first_token + jax.lax.rem(index, size)
            rows = jnp.where(valid, rows, batch * tokens)  # past the array: masked
            mask = valid[:, None] & feature_mask[None, :]
            a = pl_triton.load(x_ref.at[rows[:, None], features[None, :]], mask=mask, other=0)
            if norm_refs:  # the LayerNorm, as normalized computes it; zeros where masked
                mean, rstd = (pl_triton.load(ref.at[0, rows], mask=valid, other=0) for ref in norm_refs[:2])
                normed = (a.astype(jnp.float32) - mean[:, None]) * (rstd[:, None] * gamma) + beta
                a = jnp.where(mask, normed, 0.0).astype(a.dtype)
            g = pl_triton.load(dy_ref.at[rows[:, None], columns[None, :] - offset],
                               mask=valid[:, None] & column_mask[None, :], other=0)
            if has_scale:  # factor * dy, rounded to dy's dtype (as the plain path's scaled cotangent)
                g = (g.astype(jnp.float32) * row_factor(factor_refs, rows, valid, has_scale)[:, None]).astype(g.dtype)
            accumulator = accumulator + jax.lax.dot_general(a, g, (((0,), (0,)), ((), ())), precision=precision,
                                                            preferred_element_type=jnp.float32)
            if bias:  # a uniform branch: only the first row tile's programs sum
                column_sums = jax.lax.cond(sums_here, lambda s: s + jnp.sum(g.astype(jnp.float32), axis=0),
                                           lambda s: s, column_sums)
            return accumulator, column_sums

        carry = jax.lax.fori_loop(0, (high - low) * reaches.astype(jnp.int32), step, carry)
    accumulator, column_sums = carry
    out_rows = split * x_ref.shape[1] + features  # this split's (K, N) slice of the partial sums
    pl_triton.store(out_refs[0].at[out_rows[:, None], columns[None, :]], accumulator)
    if bias:
        @pl.when(sums_here)
        def _store_column_sums():
            pl_triton.store(out_refs[1].at[split, columns], column_sums)
