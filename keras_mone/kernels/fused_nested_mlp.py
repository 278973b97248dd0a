"""A nested MLP in one Pallas kernel: the hidden activations never leave the chip (jax).

Why (issue 40). A MoNE token group of width ``d`` runs ``gelu(x[:, :d] @ W1[:d] + b1) @
W2[:, :d] + b2[:d]`` (App. A.1 Eq. 6). Only the GEMMs shrink with ``d``: the hidden
activations stay ``(rows, 4D)`` wide, so the plain path writes them to device memory after
fc1, reads them for the GELU, writes them again and reads them for fc2, exactly as much
traffic as the dense MLP. Per row fc1 does ``2 d 4D`` FLOPs against ``2 * 4D`` bytes of
bf16 output: ``d`` FLOPs per byte, under the ~200 an H100/H200 needs to be compute-bound
for ``d = D/8, D/4`` of ViT-B/16 (96, 192). Those groups run at memory speed, which is why
MoNE-ViT-B/16 at e_c 0.3 (3.03x fewer FLOPs) gained only 1.2-1.3x on an H200
(``bench/roofline.py`` models it op by op).

Here each program takes ``block_rows`` rows of one group and loops over the hidden width
in ``block_hidden`` columns: fc1's slice, bias and GELU, then that slice's product with
fc2's rows, added into a ``(block_rows, d)`` float32 accumulator. Device memory sees
``x``, the weights and the ``(rows, d)`` output only. Feature dimensions are cut into
power-of-2 chunks (the largest power of 2 dividing ``d``: 32 for ``d = 96``), as Triton
needs.

``fused_nested_mlp`` is differentiable: its backward pass recomputes the plain path
(``plain_nested_mlp``) from the saved inputs, so training keeps no hidden activations
between the passes either. ``interpret=True`` runs the kernel through Pallas' interpreter
(any platform: how CI tests it). ``plain_nested_mlp`` is the reference it equals.
"""

import functools

import jax
import jax.numpy as jnp

from keras_mone.kernels.tiles import feature_chunk, kernel_name, resolved_tiles

def plain_nested_mlp(x, w1, b1, w2, b2, width, activation):
    """``activation(x[:, :d] @ W1[:d] + b1) @ W2[:, :d] + b2[:d]`` with XLA's ops (``d = width``).

    ``x``: ``(rows, D)`` or ``(rows, d)``; ``w1``: ``(D, H)``; ``w2``: ``(H, D)``; the
    result is ``(rows, d)``. Products accumulate in float32, like the kernel's.
    """
    hidden = jnp.dot(x[:, :width], w1[:width], preferred_element_type=jnp.float32) + b1.astype(jnp.float32)
    hidden = activation(hidden).astype(x.dtype)
    out = jnp.dot(hidden, w2[:, :width], preferred_element_type=jnp.float32) + b2[:width].astype(jnp.float32)
    return out.astype(x.dtype)


def fused_nested_mlp(
    x, w1, b1, w2, b2, width, activation, block_rows=None, block_hidden=None, num_warps=None, num_stages=None,
    interpret=False,
):
    """The nested MLP of ``plain_nested_mlp`` as one Pallas kernel (see the module docstring).

    Args:
        x: ``(rows, D)`` token rows; columns past ``width`` are not read.
        w1, b1: fc1's ``(D, H)`` kernel and ``(H,)`` bias.
        w2, b2: fc2's ``(H, D)`` kernel and ``(D,)`` bias.
        width: the group's nested width ``d``.
        activation: an elementwise function (float32 in, float32 out), e.g. GELU.
        block_rows, block_hidden, num_warps, num_stages: tile sizes (powers of 2) and Triton's
            launch settings; ``tiles.default_tiles(..., kernel="mlp")`` where ``None``.
        interpret: run through Pallas' interpreter (no accelerator needed).

    Returns:
        ``(rows, width)`` in ``x``'s dtype.
    """
    tiles = checked_tiles(x, w1, w2, width, block_rows, block_hidden, num_warps, num_stages)
    if x.shape[0] == 0:  # an empty token group: nothing to launch
        return jnp.zeros((0, width), x.dtype)
    return _jitted_mlp(x, w1, b1, w2, b2, width, activation, tiles, bool(interpret))


def checked_tiles(x, w1, w2, width, block_rows, block_hidden, num_warps, num_stages, kernel="mlp"):
    """``(block_rows, block_hidden, num_warps, num_stages)`` for a kernel call, after
    checking the shapes (clear errors naming the argument); ``kernel``: whose defaults fill
    the ``None`` (``tiles.KERNELS``)."""
    hidden = w1.shape[1]
    if not 0 < width <= x.shape[1] or width > w1.shape[0] or w2.shape != (hidden, w1.shape[0]):
        raise ValueError(
            f"`width` must lie in [1, {min(x.shape[1], w1.shape[0])}] with w1 (D, H) and w2 (H, D); "
            f"got width={width}, x {x.shape}, w1 {w1.shape}, w2 {w2.shape}."
        )
    if not jnp.dtype(x.dtype) == jnp.dtype(w1.dtype) == jnp.dtype(w2.dtype):
        raise ValueError(f"The rows and both MLP kernels must share a dtype (Triton's dot); got {x.dtype}, "
                         f"{w1.dtype} and {w2.dtype}.")
    itemsize = jnp.dtype(x.dtype).itemsize
    return resolved_tiles(width, hidden, itemsize, block_rows, block_hidden, num_warps, num_stages, kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _mlp(x, w1, b1, w2, b2, width, activation, tiles, interpret):
    return _pallas_mlp(x, w1, b1, w2, b2, width, activation, tiles, interpret)


def _mlp_forward(x, w1, b1, w2, b2, width, activation, tiles, interpret):
    return _mlp(x, w1, b1, w2, b2, width, activation, tiles, interpret), (x, w1, b1, w2, b2)


def _mlp_backward(width, activation, tiles, interpret, saved, upstream):
    """The plain path's gradients, recomputed from the inputs: no hidden activations
    are kept between the passes."""
    _, pullback = jax.vjp(lambda *a: plain_nested_mlp(*a, width, activation), *saved)
    return pullback(upstream)


_mlp.defvjp(_mlp_forward, _mlp_backward)
# compiled once per (shapes, width, activation, tiles): called eagerly, each call would
# otherwise build a new kernel and compile it again
_jitted_mlp = jax.jit(_mlp, static_argnums=(5, 6, 7, 8))


def _pallas_mlp(x, w1, b1, w2, b2, width, activation, tiles, interpret):
    hidden, full = w1.shape[1], w1.shape[0]
    kernel = functools.partial(
        _mlp_tile, width=width, chunk=feature_chunk(width), block_hidden=tiles[1], activation=activation,
    )
    # blocks (·, width) at index 0 of (·, D) arrays: the first `width` features, not copied
    weights = [(w1, (width, hidden)), (b1.reshape(1, hidden), (1, hidden)), (w2, (hidden, width)),
               (b2.reshape(1, full), (1, width))]
    return row_tiled_call(kernel, [(x, width)], weights, (width, width), tiles, interpret,
                          name=kernel_name("_mlp_tile", width, hidden))


def row_tiled_call(kernel, rows, weights, out, tiles, interpret, aliases=None, name=None):
    """``kernel`` over tiles of ``block_rows`` rows, one program each, through Pallas'
    Triton lowering (Pallas' default on GPUs, Mosaic GPU, would stage the whole weight
    blocks in shared memory: 1.2 MB at d = 96).

    Args:
        rows: ``(array, columns)`` pairs: ``(n, c)`` arrays cut into row tiles, of which a
            program sees the first ``columns``; padded to whole tiles (no masked loads).
        weights: ``(array, block shape)`` pairs: every program sees the block at index 0.
        out: ``(columns of the result, columns a program writes)``; the result has the
            first row array's dtype and is cut back to ``n`` rows.
        tiles: ``(block_rows, block_hidden, num_warps, num_stages)``.
        aliases: ``input_output_aliases`` of ``pallas_call``.
        name: the kernel's name (``kernel_name``).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    block_rows, _, num_warps, num_stages = tiles
    count = rows[0][0].shape[0]
    padded = -(-count // block_rows) * block_rows
    arrays = [a if padded == count else jnp.pad(a, ((0, padded - count), (0, 0))) for a, _ in rows]
    specs = [pl.BlockSpec((block_rows, columns), lambda i: (i, 0)) for _, columns in rows]
    specs += [pl.BlockSpec(shape, lambda i: (0, 0)) for _, shape in weights]
    result = pl.pallas_call(
        kernel,
        grid=(padded // block_rows,),
        in_specs=specs,
        out_specs=pl.BlockSpec((block_rows, out[1]), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((padded, out[0]), arrays[0].dtype),
        input_output_aliases=aliases or {},
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*arrays, *(array for array, _ in weights))
    return result if padded == count else result[:count]


def _mlp_tile(x_ref, w1_ref, b1_ref, w2_ref, b2_ref, out_ref, *, width, chunk, block_hidden, activation):
    """One row tile: ``out = act(x W1 + b1) W2 + b2`` over hidden blocks, accumulated in float32."""
    from jax.experimental import pallas as pl

    features = [pl.ds(k * chunk, chunk) for k in range(width // chunk)]
    accumulators = mlp_accumulators([x_ref[:, f] for f in features], features, w1_ref, b1_ref, w2_ref,
                                    block_hidden, activation)
    for acc, f in zip(accumulators, features):
        out_ref[:, f] = (acc + b2_ref[:, f].astype(jnp.float32)).astype(out_ref.dtype)


def mlp_accumulators(xs, features, w1_ref, b1_ref, w2_ref, block_hidden, activation):
    """Inside a kernel: ``act(x W1[:d] + b1) W2[:, :d]`` for a row tile given as feature
    chunks ``xs`` (at the ``features`` slices of ``d``), looping over the hidden width
    in ``block_hidden`` columns; one float32 accumulator per chunk, no bias."""
    from jax.experimental import pallas as pl

    def hidden_block(j, accumulators):
        columns = pl.ds(pl.multiple_of(j * block_hidden, block_hidden), block_hidden)
        pre = b1_ref[:, columns].astype(jnp.float32)
        for x, f in zip(xs, features):
            pre = pre + jnp.dot(x, w1_ref[f, columns], preferred_element_type=jnp.float32)
        h = activation(pre).astype(xs[0].dtype)
        return tuple(
            acc + jnp.dot(h, w2_ref[columns, f], preferred_element_type=jnp.float32)
            for acc, f in zip(accumulators, features)
        )

    start = tuple(jnp.zeros((xs[0].shape[0], f.size), jnp.float32) for f in features)
    return jax.lax.fori_loop(0, w1_ref.shape[1] // block_hidden, hidden_block, start)
