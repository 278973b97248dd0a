"""The Pallas launch of ``grouped_projection`` (jax): one launch for a nested projection over
all of a block's token groups, its checks and its tiles. One program of it is
``kernels.grouped_tile``; the name it is compiled under, and what that name says it costs,
``kernels.grouped_labels``. ``kernels.grouped_projection`` holds the function users call (its
module docstring gives the equations), its plain twin and its gradients;
``kernels.grouped_gradients`` runs the backward pass through this program too.
"""

import functools

import jax
import jax.numpy as jnp

from keras_mone.kernels.grouped_labels import kernel_label
from keras_mone.kernels.grouped_tile import projection_tile, scale_operands
from keras_mone.kernels.precision import dot_precision
from keras_mone.kernels.row_sums import RowSums
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


def normalized(x, mean, rstd, gamma, beta):
    """``(x - mean) * (rstd * gamma) + beta`` in float32, rounded to ``x``'s dtype (the kernel's prologue)."""
    wide = x.astype(jnp.float32)
    scale = rstd.astype(jnp.float32)[..., None] * gamma.astype(jnp.float32)
    return ((wide - mean.astype(jnp.float32)[..., None]) * scale + beta.astype(jnp.float32)).astype(x.dtype)


def pallas_projection(x, w, b, residual, scale, norm, groups, side, activation, parts, tiles, precision, interpret,
                      transposed=False, derivative=None, keep_pre=False, row_sums=False, products=None,
                      norm_sums=None, in_place=False, residual_sums=None):
    """The kernel launch (arguments checked by the caller: ``grouped_projection``'s). With
    ``keep_pre`` (one part) it returns ``(pre, out)``, both stored by the epilogue: side ``"in"``
    with an ``activation``, the pre-activations and their activation (fc1 of the training form:
    fc2's forward pass reads the second, its backward pass the first); side ``"out"``, the
    projection before its gate and residual (which the gate's gradient needs). With ``row_sums``
    (one part) it returns ``(out, sums, squares)`` (``(pre, out, sums, squares)`` with both):
    each program also stores its rows' sums and sums of squares of the values it stored, in
    float32, ``(column tiles, batch, tokens)`` each (the next LayerNorm's one-pass statistics,
    without a pass over ``out``). Four more forms serve the backward passes
    (``kernels.grouped_gradients``):

    * ``transposed``: ``w`` is given as ``(N, K)`` and read transposed, tile by tile (a dX
      kernel's ``W^T`` without a transposed copy of the weights written first).
    * ``derivative``: ``(function, pre)``, side ``"in"``: the epilogue multiplies by
      ``function'(pre)`` (elementwise, in float32; ``pre`` ``(batch, tokens, N)``), so the dX
      kernel of an out-projection of ``function(pre)`` writes ``d pre`` directly. With
      ``scale`` (side ``"in"`` here too) it then multiplies each row by its factor. With
      ``products``, the out-projection's bias ``b`` ``(K,)``, it also returns float32 partial
      sums ``(column tiles + 1, batch, tokens)``: each column tile's ``sum_N(function(pre) *
      product)`` (taken before both), and ``x . b`` from the programs of one more column tile.
      That is the dX kernel of a gated fc2, whose gate's gradient ``sum_D(d out * (h W + b))``
      is ``sum_H(h * (d out W^T)) + d out . b``, the sum of those partials: the forward pass
      keeps no projection for it, and no pass over ``d out`` computes it.
    * ``norm_sums``: ``(x, mean, gamma)`` of the LayerNorm prologue of an in-projection, side
      ``"out"`` (its dX kernel, which writes ``d normalized``); it also returns float32 partial
      sums ``(column tiles, batch, tokens)`` of each row's ``sum(dn * gamma)`` and ``sum(dn *
      gamma * (x - mean))``: the statistics' cotangents without a pass over ``dn`` and ``x``
      (``grouped_gradients.normalized_cotangents``).
    * ``x`` a tuple of equal parts along the contraction, side ``"out"``, no ``norm``: each read
      where it lies (the dX kernel of q/k/v reads their three cotangents, not a joined copy).

    ``in_place``, ``residual_sums``: an inference out-projection writing into its residual's buffer
    only its groups' column tiles (``_in_place_aliases``)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    pieces = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    _check_backward_forms(pieces, residual, scale, norm, side, parts, tiles, derivative, products)
    columns = w.shape[0] if transposed else w.shape[1]
    if norm_sums is not None:
        _check_norm_sums(norm_sums, pieces[0].shape[:2] + (columns,), side, parts, (residual, scale, norm, derivative),
                         keep_pre or row_sums)
    out_bias, products = products, products is not None  # (the bias of a gated fc2's dX kernel, below)
    x = pieces[0]
    (batch, tokens), contraction = x.shape[:2], len(pieces) * x.shape[-1]
    block_rows, block_cols, block_k, num_warps, num_stages = tiles
    table, first_tile = _row_tile_table(groups, batch, block_rows)
    outputs = 2 if keep_pre else parts
    shapes = _output_shapes(batch * tokens, columns // parts, x.dtype, outputs, columns // block_cols, row_sums,
                            products, norm_sums is not None)
    if not table:  # every group empty: no tokens
        return _reshaped([jnp.zeros(shape.shape, shape.dtype) for shape in shapes], batch, tokens, outputs)
    operands = [*(piece.reshape(batch * tokens, -1) for piece in pieces), w, b.reshape(1, columns)]
    has_scale, has_norm = _epilogue_operands(operands, batch * tokens, residual, scale, norm, out_bias, derivative,
                                             norm_sums)
    aliases, unread = ({}, 0) if not in_place else _in_place_aliases(
        operands, pieces, residual, side, parts, row_sums, residual_sums, columns // block_cols,
        (keep_pre, derivative, products, norm_sums, transposed))
    kernel = functools.partial(
        projection_tile, table=tuple(table), batch=batch, tokens=tokens, side=side, activation=activation,
        blocks=(block_rows, block_cols, block_k), has_residual=residual is not None, has_scale=has_scale,
        has_norm=has_norm, parts=parts, precision=dot_precision(precision), transposed=transposed,
        derivative_of=None if derivative is None else derivative[0], input_parts=len(pieces), keep_pre=keep_pre,
        row_sums=row_sums, products=products, norm_sums=norm_sums is not None, in_place=in_place, unread=unread)
    out = pl.pallas_call(
        kernel,  # (the column tiles vary fastest: a row tile's inputs are read from L2 for its every column tile)
        grid=(columns // block_cols + products, first_tile),  # (products: one more column tile, x . b)
        out_shape=shapes[0] if len(shapes) == 1 else tuple(shapes),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        input_output_aliases=aliases,
        interpret=interpret,
        name=kernel_label(side, contraction, columns, batch, groups, residual is not None, scale is not None,
                          norm is not None, derivative is not None, keep_pre, row_sums and columns // block_cols,
                          products and columns // block_cols + 1, (norm_sums is not None) and columns // block_cols,
                          in_place and columns // block_cols),
    )(*operands)
    return _reshaped(list(out) if len(shapes) > 1 else [out], batch, tokens, outputs)


def _output_shapes(rows, width, dtype, outputs, column_tiles, row_sums, products, norm_sums):
    """The launch's outputs: ``outputs`` arrays ``(rows, width)``, then float32 ``(column tiles,
    rows)`` partial sums: two with ``row_sums``, one more tile's worth with ``products``, two
    with ``norm_sums``."""
    partial = jax.ShapeDtypeStruct((column_tiles, rows), jnp.float32)
    return ([jax.ShapeDtypeStruct((rows, width), dtype)] * outputs + [partial] * (2 * row_sums)
            + [jax.ShapeDtypeStruct((column_tiles + 1, rows), jnp.float32)] * products + [partial] * (2 * norm_sums))


def _reshaped(results, batch, tokens, outputs):
    """The launch's results, the first ``outputs`` as ``(batch, tokens, width)``, the partial sums
    per column tile as ``(tiles, batch, tokens)``; one array alone, else a tuple."""
    results = [t.reshape(batch, tokens, t.shape[1]) for t in results[:outputs]] + [
        t.reshape(t.shape[0], batch, tokens) for t in results[outputs:]]
    return results[0] if len(results) == 1 else tuple(results)


def _check_backward_forms(pieces, residual, scale, norm, side, parts, tiles, derivative, products):
    """Raises ``ValueError`` for a form of the backward passes' that ``pallas_projection`` does not run."""
    if len(pieces) > 1 and (side != "out" or norm is not None or pieces[0].shape[-1] % tiles[2]):
        raise ValueError(f"`x` in parts needs side 'out', no `norm` and parts of whole contraction steps "
                         f"({tiles[2]}); got side {side!r} and parts of {pieces[0].shape[-1]}.")
    if (products is not None and (side != "in" or derivative is None or parts != 1)) or (
            (products is not None or (side == "in" and scale is not None))
            and (norm is not None or residual is not None)):
        raise ValueError("`products` and a `scale` on side 'in' belong to a dX kernel: `products` with a "
                         "`derivative` and one part, neither with a `norm` or `residual`.")


def in_place_fits(residual, dtype, residual_sums=None, column_tiles=None):
    """Whether an out-projection can write into the buffer of ``residual``: a residual of the rows'
    ``dtype`` and, where the launch stores row sums over ``column_tiles`` (``None``: it stores
    none), ``residual_sums`` the residual's float32 ``(sums, squares)``, ``(column_tiles, batch,
    tokens)`` each (``_in_place_aliases``)."""
    if residual is None or residual.dtype != dtype:
        return False
    if column_tiles is None:
        return True
    expected = (column_tiles,) + tuple(residual.shape[:2])
    return residual_sums is not None and len(residual_sums) == 2 and all(
        tuple(jnp.shape(t)) == expected and jnp.dtype(t.dtype) == jnp.float32 for t in residual_sums)

def _in_place_aliases(operands, pieces, residual, side, parts, row_sums, residual_sums, column_tiles, others):
    """``(input_output_aliases, unread operands)`` of an ``in_place`` launch: an inference
    out-projection whose output is its residual's buffer (the residual is read after x, w and b),
    so that a program whose column tile lies past its group's width reads and writes nothing, its
    columns being the residual's already. With ``row_sums`` the sums are ``residual_sums``' buffers
    (the residual's ``(sums, squares)``, ``(column tiles, batch, tokens)``, appended to
    ``operands`` and never read), those tiles' sums being the residual's already. Raises
    ``ValueError`` unless it fits: one part, none of ``others`` (keep_pre, derivative, products,
    norm_sums, transposed), a ``residual`` of x's dtype and with ``row_sums`` its sums per this
    kernel's ``column_tiles``."""
    if side != "out" or parts != 1 or residual is None or residual.dtype != pieces[0].dtype or any(
            other is not None and other is not False for other in others):
        raise ValueError("`in_place` belongs to a forward out-projection with a `residual` of x's dtype: one part, "
                         "no `keep_pre`, `derivative`, `products`, `norm_sums` or transposed weights.")
    if not in_place_fits(residual, pieces[0].dtype, residual_sums, column_tiles if row_sums else None):
        shapes = [tuple(jnp.shape(t)) for t in residual_sums or ()]
        raise ValueError(f"`in_place` with `row_sums` needs `residual_sums`, the residual's float32 (sums, "
                         f"squares) of shape {(column_tiles,) + tuple(residual.shape[:2])} each (one per column "
                         f"tile); got {shapes}.")
    aliases = {len(pieces) + 2: 0}
    if not row_sums:
        return aliases, 0
    aliases.update({len(operands): 1, len(operands) + 1: 2})
    operands += [t.reshape(t.shape[0], -1) for t in residual_sums]
    return aliases, 2


def _check_norm_sums(norm_sums, out_shape, side, parts, others, forward_stores):
    """Raises ``ValueError`` unless ``norm_sums`` is ``(x, mean, gamma)`` shaped for the output
    ``out_shape`` of a dX kernel that can store its sums: none of ``others`` (the launch's
    ``residual``, ``scale``, ``norm`` and ``derivative``) given, nor ``forward_stores``
    (``keep_pre`` or ``row_sums``)."""
    if forward_stores or side != "out" or parts != 1 or any(other is not None for other in others):
        raise ValueError("`norm_sums` belongs to the dX kernel of an in-projection with a LayerNorm prologue: side "
                         "'out', one part, no `residual`, `scale`, `norm`, `derivative`, `keep_pre` or `row_sums`.")
    shapes = [tuple(jnp.shape(t)) for t in norm_sums]
    if shapes != [out_shape, out_shape[:2], out_shape[2:]]:
        raise ValueError(f"`norm_sums` must be (x, mean, gamma) of shapes {out_shape}, {out_shape[:2]} and "
                         f"{out_shape[2:]}; got {shapes}.")


def _epilogue_operands(operands, rows, residual, scale, norm, out_bias, derivative, norm_sums=None):
    """Appends to ``operands`` what the programs read besides ``x``, ``w`` and ``b``, in the order
    they read it: the residual, the factor per row (or the gate and alpha), the prologue's norm, a
    gated fc2's dX kernel's bias, the pre-activations of a ``derivative`` and the LayerNorm's ``x``,
    means and gamma of ``norm_sums``. Returns the kernel's ``(has_scale, has_norm)``."""
    if residual is not None:
        operands.append(residual.reshape(rows, -1))
    factors, has_scale = scale_operands(scale, rows)
    operands += factors
    has_norm = _norm_operands(norm, rows, operands)
    if out_bias is not None:
        operands.append(out_bias.astype(jnp.float32).reshape(1, -1))
    if derivative is not None:
        operands.append(derivative[1].reshape(rows, -1))
    if norm_sums is not None:
        operands += [norm_sums[0].reshape(rows, -1), *(t.astype(jnp.float32).reshape(1, -1) for t in norm_sums[1:])]
    return has_scale, has_norm


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
