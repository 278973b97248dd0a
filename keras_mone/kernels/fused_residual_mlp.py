"""A MoNE block's second half in one Pallas kernel: ``z + s Pad(MLP_d(LN(z)[:, :d]))`` (jax).

The block's MLP half for one token group of width ``d`` (MoNE Eq. 1 with App. A.1 Eq. 6):
LayerNorm over the full width ``D``, the nested MLP (``fused_nested_mlp``), the gate's
per-token scale ``s = alpha g + 1`` and the residual sum, where only the first ``d``
features change. Done apart, XLA writes and reads the normalised ``(rows, D)`` tensor, the
MLP's output and the padded update; here one program reads a row tile of ``z`` once (for
the statistics, then the first ``d`` features again), keeps the hidden activations on chip
(``fused_nested_mlp``) and writes only the ``d`` features that change: the output is
``z``'s own buffer (``input_output_aliases``), whose other ``D - d`` features are already
right. ``bench/roofline.py`` models what this saves. On an H200 (2026-11-28, bf16, ViT-B/16's
groups at batch 256) it ran d = 96 1.50x and d = 192 1.03x faster than XLA's path at its
screened tiles, now its defaults (``tiles.CARD_TILES``); at d = 384 XLA's path won.

``plain_residual_mlp`` is the reference the kernel equals, and its backward pass.
"""

import functools

import jax
import jax.numpy as jnp

from keras_mone.kernels.fused_nested_mlp import checked_tiles, mlp_accumulators, plain_nested_mlp, row_tiled_call
from keras_mone.kernels.tiles import feature_chunk, kernel_name


STATISTICS_CHUNK = 64
"""Features per load while a tile's LayerNorm statistics are summed (registers: rows x 64)."""


def plain_residual_mlp(z, gamma, beta, w1, b1, w2, b2, scale, width, activation, epsilon):
    """``z + Pad(scale * MLP_d(LN(z)[:, :d]))`` with XLA's ops: ``z`` ``(rows, D)``,
    ``scale`` ``(rows,)`` or ``None``. The LayerNorm runs in float32 (Keras' does too)."""
    values = z.astype(jnp.float32)
    mean = jnp.mean(values, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(values - mean), axis=-1, keepdims=True)
    normed = (values - mean) * jax.lax.rsqrt(variance + epsilon) * gamma.astype(jnp.float32)
    normed = (normed + beta.astype(jnp.float32)).astype(z.dtype)
    update = plain_nested_mlp(normed, w1, b1, w2, b2, width, activation)
    if scale is not None:
        update = update * scale[:, None].astype(update.dtype)
    return jnp.asarray(z).at[:, :width].add(update)


def fused_residual_mlp(
    z, gamma, beta, w1, b1, w2, b2, scale, width, activation, epsilon=1e-6, block_rows=None,
    block_hidden=None, num_warps=None, num_stages=None, interpret=False,
):
    """``plain_residual_mlp`` as one Pallas kernel (see the module docstring).

    Args:
        z: ``(rows, D)`` token rows (the block's residual stream after attention).
        gamma, beta: the LayerNorm's ``(D,)`` scale and offset.
        w1, b1, w2, b2: the MLP's kernels ``(D, H)``, ``(H, D)`` and biases.
        scale: ``(rows,)`` per-token factor on the MLP update (MoNE's ``alpha g + 1``) or ``None``.
        width: the group's nested width ``d``.
        activation, block_rows, block_hidden, num_warps, num_stages, interpret: as in
            ``fused_nested_mlp`` (tiles: ``tiles.default_tiles(..., kernel="residual")`` if ``None``).

    Returns:
        ``(rows, D)`` in ``z``'s dtype.
    """
    if gamma.shape != (z.shape[1],) or beta.shape != (z.shape[1],):
        raise ValueError(f"`gamma` and `beta` must have shape ({z.shape[1]},), got {gamma.shape} and {beta.shape}.")
    if scale is not None and scale.shape != (z.shape[0],):
        raise ValueError(f"`scale` must have shape ({z.shape[0]},) (one factor per row) or be None, got {scale.shape}.")
    tiles = checked_tiles(z, w1, w2, width, block_rows, block_hidden, num_warps, num_stages, kernel="residual")
    if z.shape[0] == 0:  # an empty token group: nothing to launch
        return jnp.asarray(z)
    if scale is None:
        scale = jnp.ones((z.shape[0],), z.dtype)
    return _jitted_residual(z, gamma, beta, w1, b1, w2, b2, scale, width, activation, float(epsilon), tiles,
                            bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _residual(z, gamma, beta, w1, b1, w2, b2, scale, width, activation, epsilon, tiles, interpret):
    return _pallas_residual(z, gamma, beta, w1, b1, w2, b2, scale, width, activation, epsilon, tiles, interpret)


def _residual_forward(*arguments):
    return _residual(*arguments), arguments[:8]


def _residual_backward(width, activation, epsilon, tiles, interpret, saved, upstream):
    """The plain path's gradients, recomputed from the inputs (no activations kept)."""
    _, pullback = jax.vjp(lambda *a: plain_residual_mlp(*a, width, activation, epsilon), *saved)
    return pullback(upstream)


_residual.defvjp(_residual_forward, _residual_backward)
_jitted_residual = jax.jit(_residual, static_argnums=(8, 9, 10, 11, 12))  # one compilation per static setting


def _pallas_residual(z, gamma, beta, w1, b1, w2, b2, scale, width, activation, epsilon, tiles, interpret):
    full, hidden = z.shape[1], w1.shape[1]
    kernel = functools.partial(
        _residual_tile, width=width, chunk=feature_chunk(width), block_hidden=tiles[1],
        activation=activation, epsilon=epsilon,
    )
    weights = [(gamma.reshape(1, full), (1, full)), (beta.reshape(1, full), (1, full)), (w1, (width, hidden)),
               (b1.reshape(1, hidden), (1, hidden)), (w2, (hidden, width)), (b2.reshape(1, full), (1, width))]
    # a program writes the first `width` features of its row tile; `z`'s buffer holds the rest
    return row_tiled_call(kernel, [(z, full), (scale.reshape(-1, 1), 1)], weights, (full, width), tiles,
                          interpret, aliases={0: 0}, name=kernel_name("_residual_tile", width, hidden))


def row_statistics(z_ref, pieces, epsilon):
    """Inside a kernel: each row's mean and ``1 / sqrt(variance + epsilon)`` over the
    feature ``pieces`` of ``z_ref``, chunk by chunk (Chan et al.'s pairwise update: each
    piece's mean and sum of squared deviations, then ``sum M2_c + n sum (mean_c -
    mean)^2``), as stable as two passes over the row. Each piece is loaded once and used at
    once: two passes over the whole row kept every piece of the tile in registers between
    them (255 registers and spills at 128 rows, ``bench/kernel_compile.py``)."""
    means, deviations = [], []
    for piece in pieces:
        values = z_ref[:, piece].astype(jnp.float32)
        piece_mean = jnp.mean(values, axis=1, keepdims=True)
        means.append(piece_mean)
        deviations.append(jnp.sum(jnp.square(values - piece_mean), axis=1, keepdims=True))
    mean = sum(means) / len(pieces)
    squares = sum(deviations) + pieces[0].size * sum(jnp.square(m - mean) for m in means)
    return mean, jax.lax.rsqrt(squares / (len(pieces) * pieces[0].size) + epsilon)


def _residual_tile(z_ref, scale_ref, gamma_ref, beta_ref, w1_ref, b1_ref, w2_ref, b2_ref, out_ref, *,
                   width, chunk, block_hidden, activation, epsilon):
    """One row tile: LayerNorm statistics over ``D``, the nested MLP of the first ``d``
    normalised features, ``z + scale * update`` written into those ``d`` features."""
    from jax.experimental import pallas as pl

    full = z_ref.shape[1]
    step = min(STATISTICS_CHUNK, feature_chunk(full))
    pieces = [pl.ds(k * step, step) for k in range(full // step)]
    mean, inverse_std = row_statistics(z_ref, pieces, epsilon)

    features = [pl.ds(k * chunk, chunk) for k in range(width // chunk)]
    xs = [
        ((z_ref[:, f].astype(jnp.float32) - mean) * inverse_std * gamma_ref[:, f].astype(jnp.float32)
         + beta_ref[:, f].astype(jnp.float32)).astype(z_ref.dtype)
        for f in features
    ]
    accumulators = mlp_accumulators(xs, features, w1_ref, b1_ref, w2_ref, block_hidden, activation)
    scale = scale_ref[...].astype(z_ref.dtype)
    for acc, f in zip(accumulators, features):
        update = (acc + b2_ref[:, f].astype(jnp.float32)).astype(z_ref.dtype) * scale
        out_ref[:, f] = z_ref[:, f] + update
