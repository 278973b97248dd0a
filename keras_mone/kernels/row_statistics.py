"""A LayerNorm's row statistics, mean and ``rsqrt(var + eps)``, as one Pallas kernel (jax).

Why (issue 40). With the grouped projection kernels (``kernels.grouped_projection``) a block's
LayerNorms are the in-projections' prologues, given each row's mean and rstd. XLA computes
those in two kernels per LayerNorm: a reduction (one pass: the sums of ``x`` and ``x^2``),
then a tiny elementwise pass for the variance and the rsqrt, which it does not fuse into the
reduction. Compiled for an H200, MoNE-ViViT-FE-B/16 at batch 1 runs 24 such passes among its
199 kernels, where latency is the target and every launch costs (BENCHMARKS.md, "Row
statistics in one kernel").

Here a program loads ``block_rows`` whole rows (the feature axis padded to a power of 2 and
masked), computes the mean, then the variance of the centred values still on chip (the
two-pass formula of Keras' LayerNorm, with one read of ``x``), and writes mean and rstd in
float32. ``plain_row_statistics`` is the same with XLA's ops: the reference the kernel equals
and its backward pass (recomputed from ``x``). ``interpret=True`` runs the kernel through
Pallas' interpreter (any platform: how CI tests it).
"""

import functools

import jax
import jax.numpy as jnp

DEFAULT_TILES = (8, 4)
"""``(block_rows, num_warps)``: 8 rows of up to 1024 features on 4 warps (64 float32 values a
thread). Compiled for sm_90 without a card at D = 768 (``bench/kernel_compile.py``'s
``compile_stats``; BENCHMARKS.md): no spills. Not screened on a card."""


def plain_row_statistics(x, epsilon):
    """``(mean, rsqrt(var + epsilon))`` of ``x``'s last axis in float32 (at least), each
    ``x.shape[:-1]``: Keras' LayerNorm statistics (two passes)."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.mean(wide, axis=-1)
    variance = jnp.mean(jnp.square(wide - mean[..., None]), axis=-1)
    return mean, jax.lax.rsqrt(variance + jnp.asarray(epsilon, wide.dtype))


def row_statistics(x, epsilon, tiles=None, interpret=False):
    """``plain_row_statistics`` as one Pallas launch (see the module docstring).

    Args:
        x: ``(..., D)`` float16, bfloat16 or float32.
        epsilon: the LayerNorm's epsilon, a Python float.
        tiles: ``(block_rows, num_warps)``, powers of 2; ``None``: ``DEFAULT_TILES``.
        interpret: run through Pallas' interpreter (no accelerator needed).

    Returns:
        ``(mean, rstd)``, float32, each ``x.shape[:-1]``.
    """
    if x.ndim < 1 or x.shape[-1] < 1 or x.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
        raise ValueError(f"`x` must be (..., D) float16, bfloat16 or float32 with D >= 1; got {x.shape} {x.dtype}.")
    tiles = DEFAULT_TILES if tiles is None else tuple(tiles)
    if len(tiles) != 2 or not all(isinstance(t, int) and t > 0 and t & (t - 1) == 0 for t in tiles):
        raise ValueError(f"`tiles` must be (block_rows, num_warps), both powers of 2; got {tiles!r}.")
    if not (isinstance(epsilon, (int, float)) and epsilon >= 0):
        raise ValueError(f"`epsilon` must be a number >= 0, got {epsilon!r}.")
    return _statistics(x, float(epsilon), tiles, bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _statistics(x, epsilon, tiles, interpret):
    return _jitted(x, epsilon, tiles, interpret)


def _statistics_forward(x, epsilon, tiles, interpret):
    return _statistics(x, epsilon, tiles, interpret), x


def _statistics_backward(epsilon, tiles, interpret, x, upstream):
    """The plain path's gradient, recomputed from ``x``."""
    _, pullback = jax.vjp(lambda t: plain_row_statistics(t, epsilon), x)
    return pullback(upstream)


_statistics.defvjp(_statistics_forward, _statistics_backward)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _jitted(x, epsilon, tiles, interpret):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    features = x.shape[-1]
    rows = x.reshape(-1, features)
    count = rows.shape[0]
    if count == 0:  # no rows: nothing to launch
        empty = jnp.zeros(x.shape[:-1], jnp.float32)
        return empty, empty
    block_rows, num_warps = tiles
    kernel = functools.partial(_statistics_tile, count=count, features=features, block_rows=block_rows,
                               block_features=1 << (features - 1).bit_length(), epsilon=epsilon)
    vector = jax.ShapeDtypeStruct((count,), jnp.float32)
    mean, rstd = pl.pallas_call(
        kernel,
        grid=(-(-count // block_rows),),
        out_shape=(vector, vector),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"row_statistics_r{count}_d{features}",
    )(rows)
    return mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])


def _statistics_tile(x_ref, mean_ref, rstd_ref, *, count, features, block_rows, block_features, epsilon):
    """One program: ``block_rows`` whole rows."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    index = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    valid = index < count
    # rows past the end point past the array: masked on the card, dropped by the interpreter's
    # scatter (an in-range row there would be written twice in one store)
    rows = jnp.where(valid, index, count)
    columns = jnp.arange(block_features, dtype=jnp.int32)
    inside = valid[:, None] & (columns < features)[None, :]
    x = pl_triton.load(x_ref.at[rows[:, None], columns[None, :]], mask=inside, other=0).astype(jnp.float32)
    mean = jnp.sum(x, axis=1) / features
    centred = jnp.where(inside, x - mean[:, None], 0.0)
    variance = jnp.sum(centred * centred, axis=1) / features
    pl_triton.store(mean_ref.at[rows], mean, mask=valid)
    pl_triton.store(rstd_ref.at[rows], jax.lax.rsqrt(variance + epsilon), mask=valid)
