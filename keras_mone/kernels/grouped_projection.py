"""A nested projection over all of a block's token groups as one Pallas kernel (jax).

Why (issue 40). MoNE's nested projections (App. A.1 Eq. 5-7) run one GEMM per token group:
``x[:, :d] @ W[:d]`` for an in-projection, ``x @ W[:, :d]`` for an out-projection. With
E = 4 groups MoNE-ViT-B/16's forward launched 1039 kernels on an H200 against dense's 350,
and at batch 64 and for ViViT at batch 1, where each group's GEMM has a few hundred rows,
the launches and the small GEMMs cost more than the FLOPs saved (BENCHMARKS.md, "MoNE on an
H200, measured again"). Here one launch covers every group: a program takes ``block_rows``
rows of one group (gathered across the batch, so only a group's last tile is partly empty)
and ``block_cols`` output columns, and its loop over the contraction stops where its group's
weights stop:

* ``side="in"``: ``out[:, g] = act(x[:, g, :d_g] @ W[:d_g] + b)``, full output width ``N``
  (q/k/v, fc1; Eq. 5-6). The loop runs ``ceil(d_g / block_k)`` steps; ``act`` (e.g. the GELU)
  is applied in the epilogue, so fc1's output is written once, activated.
* ``side="out"``: ``out[:, g, :d_g] = x[:, g] @ W[:, :d_g] + b[:d_g]`` and zeros past
  ``d_g`` (Eq. 7's ``Pad``; the attention output, fc2). Column tiles past ``d_g`` skip the
  loop. Optional epilogue: ``residual + scale * out`` (the block's residual and MoNE's gate
  ``alpha g + 1``, Eq. 1), so the block's residual stream is written once per half.

``plain_grouped_projection`` is the same computation with XLA's ops, one GEMM per group:
the reference the kernel equals (float32 accumulation in both) and its backward pass, which
recomputes it from the saved inputs. ``interpret=True`` runs the kernel through Pallas'
interpreter (any platform: how CI tests it).
"""

import functools

import jax
import jax.numpy as jnp


SIDES = ("in", "out")


def plain_grouped_projection(x, w, b, groups, side, activation=None, residual=None, scale=None):
    """The grouped nested projection with XLA's ops, one GEMM per group (see the module docstring).

    Args:
        x: ``(batch, tokens, K)``: the token groups one after the other along the tokens.
        w, b: the full ``(K, N)`` kernel and ``(N,)`` bias.
        groups: ``((tokens, width), ...)`` per group, in token order; the tokens sum to ``x``'s.
        side: ``"in"`` (``width`` cuts ``w``'s rows) or ``"out"`` (its columns).
        activation: ``side="in"``: an elementwise function on the float32 pre-activation.
        residual, scale: ``side="out"``: ``(batch, tokens, N)`` and ``(batch, tokens)``; the
            result is ``residual + scale * projection``.

    Returns:
        ``(batch, tokens, N)`` in ``x``'s dtype.
    """
    parts, start = [], 0
    for size, width in groups:
        rows = x[:, start:start + size]
        if side == "in":
            part = jnp.dot(rows[..., :width], w[:width], preferred_element_type=jnp.float32) + b.astype(jnp.float32)
            part = part if activation is None else activation(part)
        else:
            part = jnp.dot(rows, w[:, :width], preferred_element_type=jnp.float32) + b[:width].astype(jnp.float32)
            part = jnp.pad(part, ((0, 0), (0, 0), (0, w.shape[1] - width)))
        parts.append(part)
        start += size
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
    if scale is not None:
        out = out * scale.astype(jnp.float32)[..., None]
    if residual is not None:
        out = out + residual.astype(jnp.float32)
    return out.astype(x.dtype)


def grouped_projection(x, w, b, groups, side, activation=None, residual=None, scale=None, tiles=None,
                       interpret=False):
    """``plain_grouped_projection`` as one Pallas kernel launch (see the module docstring).

    Args: those of ``plain_grouped_projection``, and
        tiles: ``(block_rows, block_cols, block_k, num_warps, num_stages)`` (the first four powers of 2;
            ``block_cols`` must divide ``N`` and ``block_k`` divide ``K``); ``default_tiles``
            where ``None``.
        interpret: run through Pallas' interpreter (no accelerator needed).
    """
    groups = checked_groups(x, w, b, groups, side, activation, residual, scale)
    tiles = tuple(tiles) if tiles is not None else default_tiles(x.shape[-1], w.shape[1], x.dtype)
    check_tiles(tiles, x.shape[-1], w.shape[1])
    return _jitted(x, w, b, residual, scale, groups, side, activation, tiles, bool(interpret))


def default_tiles(contraction, columns, dtype):
    """Tiles for a ``(K, N)`` kernel: 64 rows (one Hopper warpgroup's MMA), the widest power
    of 2 up to 128 dividing ``N``, and up to 64 (16-bit) or 32 (float32) contraction
    elements per step, 4 warps, 3 stages. Not screened on a card yet."""
    block_cols = _largest_power_of_2_dividing(columns, 128)
    block_k = _largest_power_of_2_dividing(contraction, 64 if jnp.dtype(dtype).itemsize <= 2 else 32)
    return (64, block_cols, block_k, 4, 3)


def check_tiles(tiles, contraction, columns):
    """Raises ``ValueError`` naming what is wrong with ``tiles`` for a ``(K, N)`` kernel."""
    powers = len(tiles) == 5 and all(isinstance(t, int) and t > 0 and t & (t - 1) == 0 for t in tiles[:4])
    if not powers or not isinstance(tiles[4], int) or tiles[4] < 1:
        raise ValueError(f"`tiles` must be (block_rows, block_cols, block_k, num_warps, num_stages): four powers "
                         f"of 2 and a positive stage count, got {tiles!r}.")
    block_rows, block_cols, block_k = tiles[:3]
    if block_rows < 16 or block_cols < 16 or block_k < 16:
        raise ValueError(f"`tiles`' blocks must be at least 16 (Triton's dot), got {tiles[:3]}.")
    if columns % block_cols or contraction % block_k:
        raise ValueError(f"`tiles`' block_cols ({block_cols}) must divide N = {columns} and block_k ({block_k}) "
                         f"divide K = {contraction}.")


def checked_groups(x, w, b, groups, side, activation=None, residual=None, scale=None):
    """``groups`` as a tuple of ``(tokens, width)`` int pairs, after checking every argument
    (clear errors naming it)."""
    if side not in SIDES:
        raise ValueError(f"`side` must be one of {list(SIDES)}, got {side!r}.")
    if x.ndim != 3 or w.ndim != 2 or w.shape[0] != x.shape[-1] or b.shape != (w.shape[1],):
        raise ValueError(f"`x` must be (batch, tokens, K), `w` (K, N) and `b` (N,); got x {x.shape}, "
                         f"w {w.shape}, b {b.shape}.")
    if not jnp.dtype(x.dtype) == jnp.dtype(w.dtype):
        raise ValueError(f"`x` and `w` must share a dtype (Triton's dot); got {x.dtype} and {w.dtype}.")
    groups = tuple((int(size), int(width)) for size, width in groups)
    limit = w.shape[0] if side == "in" else w.shape[1]
    if sum(size for size, _ in groups) != x.shape[1] or any(s < 0 or not 0 < d <= limit for s, d in groups):
        raise ValueError(f"`groups` must be (tokens, width) pairs whose tokens sum to {x.shape[1]} and whose "
                         f"widths lie in [1, {limit}] (side {side!r}); got {groups}.")
    if side == "in" and (residual is not None or scale is not None):
        raise ValueError("`residual` and `scale` belong to side 'out' (the block's residual and gate).")
    if side == "out" and activation is not None:
        raise ValueError("`activation` belongs to side 'in' (fc1's epilogue).")
    out_shape = x.shape[:2] + (w.shape[1],)
    if residual is not None and residual.shape != out_shape:
        raise ValueError(f"`residual` must have the output's shape {out_shape}, got {residual.shape}.")
    if scale is not None and scale.shape != x.shape[:2]:
        raise ValueError(f"`scale` must be (batch, tokens) = {x.shape[:2]}, got {scale.shape}.")
    return groups


def _largest_power_of_2_dividing(n, at_most):
    power = at_most
    while power > 16 and n % power:
        power //= 2
    return power


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _projection(x, w, b, residual, scale, groups, side, activation, tiles, interpret):
    return _pallas_projection(x, w, b, residual, scale, groups, side, activation, tiles, interpret)


def _projection_forward(x, w, b, residual, scale, groups, side, activation, tiles, interpret):
    outputs = _projection(x, w, b, residual, scale, groups, side, activation, tiles, interpret)
    return outputs, (x, w, b, residual, scale)


def _projection_backward(groups, side, activation, tiles, interpret, saved, upstream):
    """The plain path's gradients, recomputed from the inputs (a forward form: nothing but
    the inputs is kept between the passes)."""
    def plain(x, w, b, residual, scale):
        return plain_grouped_projection(x, w, b, groups, side, activation, residual, scale)

    _, pullback = jax.vjp(plain, *saved)
    return pullback(upstream)


_projection.defvjp(_projection_forward, _projection_backward)
# compiled once per (shapes, groups, side, activation, tiles): eager calls reuse the kernel
_jitted = jax.jit(_projection, static_argnums=(5, 6, 7, 8, 9))


def _pallas_projection(x, w, b, residual, scale, groups, side, activation, tiles, interpret):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    batch, tokens, contraction = x.shape
    columns = w.shape[1]
    block_rows, block_cols, block_k, num_warps, num_stages = tiles
    # each group's row tiles, in order: (first tile, tokens, first token, width)
    table, first_tile, first_token = [], 0, 0
    for size, width in groups:
        if size:
            table.append((first_tile, size, first_token, width))
            first_tile += -(-batch * size // block_rows)
        first_token += size
    if not table:  # every group empty: no tokens
        return jnp.zeros(x.shape[:2] + (columns,), x.dtype)
    operands = [x.reshape(batch * tokens, contraction), w, b.reshape(1, columns)]
    if residual is not None:
        operands.append(residual.reshape(batch * tokens, columns))
    if scale is not None:
        operands.append(scale.reshape(1, batch * tokens))
    kernel = functools.partial(
        _projection_tile, table=tuple(table), batch=batch, tokens=tokens, side=side, activation=activation,
        blocks=(block_rows, block_cols, block_k), has_residual=residual is not None, has_scale=scale is not None,
    )
    out = pl.pallas_call(
        kernel,
        # the column tiles vary fastest: a row tile's inputs are read from L2 for its every column tile
        grid=(columns // block_cols, first_tile),
        out_shape=jax.ShapeDtypeStruct((batch * tokens, columns), x.dtype),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"grouped_{side}_projection_k{contraction}_n{columns}",
    )(*operands)
    return out.reshape(batch, tokens, columns)


def _projection_tile(x_ref, w_ref, b_ref, *refs, table, batch, tokens, side, activation, blocks, has_residual,
                     has_scale):
    """One program: ``block_rows`` rows of one group by ``block_cols`` output columns."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    out_ref = refs[-1]
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
    contraction = x_ref.shape[1]
    if side == "in":  # the contraction stops at the group's width
        steps, limit = (width + block_k - 1) // block_k, width
    else:  # column tiles past the group's width have nothing to compute
        # (a product, not jnp.where: Pallas' Triton lowering left the loop unverifiable with a select)
        steps, limit = (start < width).astype(jnp.int32) * (contraction // block_k), contraction

    def step(k, accumulator):
        inner = k * block_k + jnp.arange(block_k, dtype=jnp.int32)
        mask = valid[:, None] & (inner < limit)[None, :]
        tile = pl_triton.load(x_ref.at[rows[:, None], inner[None, :]], mask=mask, other=0)
        weights = w_ref[pl.ds(pl.multiple_of(k * block_k, block_k), block_k), pl.ds(start, block_cols)]
        return accumulator + jnp.dot(tile, weights, preferred_element_type=jnp.float32)

    accumulator = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_rows, block_cols), jnp.float32))
    accumulator = accumulator + b_ref[:, pl.ds(start, block_cols)].astype(jnp.float32)
    if side == "in":
        if activation is not None:
            accumulator = activation(accumulator)
    else:
        accumulator = jnp.where((columns < width)[None, :], accumulator, 0.0)
        if has_scale:
            scale_ref = refs[-2]
            scale = pl_triton.load(scale_ref.at[0, rows], mask=valid, other=0)
            accumulator = accumulator * scale.astype(jnp.float32)[:, None]
        if has_residual:
            residual = pl_triton.load(refs[0].at[rows[:, None], columns[None, :]], mask=valid[:, None], other=0)
            accumulator = accumulator + residual.astype(jnp.float32)
    pl_triton.store(out_ref.at[rows[:, None], columns[None, :]], accumulator.astype(out_ref.dtype),
                    mask=valid[:, None])
