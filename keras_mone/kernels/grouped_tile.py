"""One program of the grouped projection kernel (``kernels.grouped_kernel``'s ``pallas_projection``, jax).

A program takes ``block_rows`` rows of one token group, gathered across the batch, and one
``block_cols`` tile of the output columns (MoNE App. A.1 Eq. 5-7). Its loop over the contraction
stops at the group's width (an in-projection) or is skipped past it (an out-projection's column
tiles, Eq. 7's ``Pad``). Around the loop: the LayerNorm prologue's statistics, the epilogues
(activation, GELU derivative, MoNE's gate ``alpha g + 1`` of Eq. 1, residual) and the stores
(the output in its parts, row sums for the next LayerNorm, the gate's gradient's partial sums,
a LayerNorm's statistics' cotangents).
"""

import functools

import jax
import jax.numpy as jnp

from keras_mone.kernels.row_sums import one_pass


def projection_tile(*refs, table, batch, tokens, side, activation, blocks, has_residual, has_scale, has_norm, parts,
                    precision, transposed, derivative_of, input_parts, keep_pre, row_sums, products, norm_sums=False,
                    in_place=False, unread=0):
    """One program: ``block_rows`` rows of one group by ``block_cols`` output columns; with
    ``products``, the programs of one more column tile compute ``x . b`` alone (``_bias_products``).
    ``in_place``: the output is the residual's buffer, so a program whose column tile lies past
    its group's width reads and stores nothing; the last ``unread`` inputs are buffers the
    outputs alias, never read."""
    from jax.experimental import pallas as pl

    x_refs, (w_ref, b_ref), refs = refs[:input_parts], refs[input_parts:input_parts + 2], refs[input_parts + 2:]
    stored = (2 if keep_pre else parts) + 2 * row_sums + products + 2 * norm_sums
    inputs, outputs = refs[:len(refs) - stored - unread], refs[len(refs) - stored:]
    block_rows = blocks[0]
    # (read here: Pallas' interpreter takes no program_id inside a branch)
    column_tile, row_tile = pl.program_id(0), pl.program_id(1)

    def of_this_group(values):  # the value of the group this row tile belongs to (a static table)
        chosen = jnp.int32(values[0])
        for (first, *_), value in zip(table[1:], values[1:]):
            chosen = jnp.where(row_tile >= first, jnp.int32(value), chosen)
        return chosen

    first, size, first_token, width = (of_this_group(column) for column in zip(*table))
    index = (row_tile - first) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # the group's rows
    valid = index < batch * size
    if in_place:  # a column tile past the group's width: the residual's values, already in the buffer
        valid = valid & (column_tile * blocks[1] < width)
    rows = jax.lax.div(index, size) * tokens + first_token + jax.lax.rem(index, size)  # rows of the (B T, K) view
    # rows past the group's end point past the array: masked on the card, dropped by the interpreter's
    # scatter (an in-range row there would be written twice in one store)
    rows = jnp.where(valid, rows, batch * tokens)
    project = functools.partial(
        _project, x_refs, w_ref, b_ref, inputs, outputs, column_tile, rows, valid, width, side=side,
        activation=activation, blocks=blocks, has_residual=has_residual, has_scale=has_scale, has_norm=has_norm,
        parts=parts, precision=precision, transposed=transposed, derivative_of=derivative_of, keep_pre=keep_pre,
        row_sums=row_sums, products=products, norm_sums=norm_sums)
    if not products:
        return project()
    bias_tile = column_tile == outputs[-1].shape[0] - 1  # the products' last row: x . b
    pl.when(bias_tile)(functools.partial(_bias_products, x_refs[0], inputs[-2], outputs[-1], column_tile, rows, valid,
                                         width, blocks[2], precision))
    pl.when(jnp.logical_not(bias_tile))(project)


def _bias_products(x_ref, bias_ref, products_ref, column_tile, rows, valid, width, block_k, precision):
    """A gated fc2's dX kernel's last column tile: ``x . b`` of each row over its group's first
    ``width`` features, stored as the products' last row. Its own programs, so that the others'
    loops and registers stay as they are without it (a second product in their loop held 60 more
    registers). A product with a ``(block_k, 16)`` matrix (a dot's least width) whose first two
    columns are ``b`` rounded to ``x``'s dtype and the rest of ``b`` (in bf16 rows, about 16
    significant bits of ``b`` instead of 8)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    column = jnp.arange(16, dtype=jnp.int32)[None, :]

    def step(k, accumulator):
        inner = k * block_k + jnp.arange(block_k, dtype=jnp.int32)
        tile = pl_triton.load(x_ref.at[rows[:, None], inner[None, :]], mask=valid[:, None] & (inner < width)[None, :],
                              other=0)
        chunk = bias_ref[:, pl.ds(pl.multiple_of(k * block_k, block_k), block_k)].T  # (block_k, 1), float32
        high = chunk.astype(tile.dtype).astype(jnp.float32)
        parts = jnp.where(column == 0, high, jnp.where(column == 1, chunk - high, 0.0)).astype(tile.dtype)
        return accumulator + jnp.dot(tile, parts, precision=precision, preferred_element_type=jnp.float32)

    accumulator = jax.lax.fori_loop(0, (width + block_k - 1) // block_k, step,
                                    jnp.zeros((rows.shape[0], 16), jnp.float32))
    pl_triton.store(products_ref.at[column_tile, rows], jnp.sum(accumulator, axis=1), mask=valid)


def _project(x_refs, w_ref, b_ref, inputs, outputs, column_tile, rows, valid, width, *, side, activation, blocks,
             has_residual, has_scale, has_norm, parts, precision, transposed, derivative_of, keep_pre, row_sums,
             products, norm_sums):
    """``projection_tile``'s product of its rows by its column tile, with its prologue and epilogue."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    block_rows, block_cols, block_k = blocks
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
    accumulator, row_products = _epilogue(accumulator, inputs, rows, columns, valid, side, activation, derivative_of,
                                          has_scale, has_residual, products)
    if products:  # (the dX kernel of a gated fc2: the gate's gradient, per column tile)
        *outputs, products_ref = outputs
        pl_triton.store(products_ref.at[column_tile, rows], row_products, mask=valid)
    tile = accumulator.astype(outputs[0].dtype)
    if norm_sums:  # (the dX kernel of an in-projection with a LayerNorm prologue: its statistics' cotangents)
        *outputs, sums_ref, centred_ref = outputs
        _store_norm_sums(inputs[-3:], (sums_ref, centred_ref), tile, rows, columns, valid, width, (start, column_tile))
    _store(outputs, tile, rows, columns, valid, (start, column_tile), parts, row_sums)


def _store_norm_sums(norm_refs, sums_refs, tile, rows, columns, valid, width, place):
    """Stores, at its column tile, each row's ``sum(dn * gamma)`` and ``sum(dn * gamma * (x - mean))``
    over the tile's columns (float32, of the stored ``dn``): the LayerNorm's ``d mean = -rstd *
    sum_D(dn * gamma)`` and ``d rstd = sum_D(dn * gamma * (x - mean))``, once XLA sums the column tiles
    (``grouped_gradients.normalized_cotangents``). ``norm_refs``: ``x`` ``(rows, D)``, the rows'
    means ``(1, rows)`` and ``gamma`` ``(1, D)``; ``x`` is read only below the group's ``width``
    (``dn`` is zero past it). ``place``: the tile's first column and its column tile's index."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    (start, column_tile), (x_ref, mean_ref, gamma_ref) = place, norm_refs
    mask = valid[:, None] & (columns < width)[None, :]
    x = pl_triton.load(x_ref.at[rows[:, None], columns[None, :]], mask=mask, other=0).astype(jnp.float32)
    mean = pl_triton.load(mean_ref.at[0, rows], mask=valid, other=0)
    weighted = tile.astype(jnp.float32) * gamma_ref[:, pl.ds(start, columns.shape[0])]
    pl_triton.store(sums_refs[0].at[column_tile, rows], jnp.sum(weighted, axis=1), mask=valid)
    # (the mask on x - mean changes no value, weighted being zero where x was not loaded, but without it the
    # float32 kernels compiled for sm_90 took 33 and 44 registers more and fc1's spilled)
    centred = jnp.where(mask, x - mean[:, None], 0.0)
    pl_triton.store(sums_refs[1].at[column_tile, rows], jnp.sum(weighted * centred, axis=1), mask=valid)


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


def _epilogue(accumulator, inputs, rows, columns, valid, side, activation, derivative_of, has_scale, has_residual,
              want_products=False):
    """``(tile, products)``: a program's float32 tile after its bias (an out-projection's already zero
    past the group's width) and its epilogue (an in-projection's activation, or a dX kernel's
    derivative and factor per row; an out-projection's gate and residual), and with
    ``want_products`` (and a derivative) the rows' ``sum(function(pre) * tile)`` before it (else ``None``)."""
    from jax.experimental.pallas import triton as pl_triton

    products = None
    if side == "in":
        if activation is not None:
            accumulator = activation(accumulator)
        if derivative_of is not None:  # d pre = d out * function'(pre)
            pre = pl_triton.load(inputs[-1].at[rows[:, None], columns[None, :]], mask=valid[:, None], other=0)
            pre = pre.astype(jnp.float32)
            if want_products:  # first, so that the activation's values are dead before its derivative's
                products = jnp.sum(derivative_of(pre).astype(jnp.float32) * accumulator, axis=1)
            accumulator = accumulator * jax.jvp(derivative_of, (pre,), (jnp.ones_like(pre),))[1]
        if has_scale:  # (a dX kernel's: residual and norm are not in its inputs)
            accumulator = accumulator * row_factor(inputs, rows, valid, has_scale)[:, None]
        return accumulator, products
    if has_scale:  # the factor per row, or alpha g + 1 (its operands are the last)
        accumulator = accumulator * row_factor(inputs[-2:] if has_scale == "gate" else inputs[-1:], rows, valid,
                                               has_scale)[:, None]
    if has_residual:
        residual = pl_triton.load(inputs[0].at[rows[:, None], columns[None, :]], mask=valid[:, None], other=0)
        accumulator = accumulator + residual.astype(jnp.float32)
    return accumulator, products


def scale_operands(scale, rows):
    """``(operands, has_scale)``: how a kernel takes a ``scale`` (``row_factor`` reads it): a factor
    per row, ``(1, rows)``, ``"scale"``; or a ``(gate, alpha)`` pair, the gate per row and alpha as
    float32 ``(1, 1)``, ``"gate"`` (the kernel computes ``alpha g + 1``); ``([], None)`` for none."""
    if scale is None:
        return [], None
    if isinstance(scale, (tuple, list)):
        return [scale[0].reshape(1, rows), jnp.reshape(scale[1], (1, 1)).astype(jnp.float32)], "gate"
    return [scale.reshape(1, rows)], "scale"


def row_factor(refs, rows, valid, has_scale):
    """The float32 factor of each of a tile's ``rows``: ``refs[0]``'s value per row (``"scale"``),
    or MoNE's ``alpha g + 1`` (Eq. 1) from the gate per row and ``refs[1]``'s alpha (``"gate"``)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    factor = pl_triton.load(refs[0].at[0, rows], mask=valid, other=0).astype(jnp.float32)
    if has_scale == "gate":
        factor = refs[1][0, pl.ds(0, 1)] * factor + 1.0
    return factor
