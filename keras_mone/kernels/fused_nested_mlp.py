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
import re

import jax
import jax.numpy as jnp

MIN_CHUNK = 16
"""The smallest feature chunk a tensor-core ``dot`` takes (Triton: K >= 16)."""


def plain_nested_mlp(x, w1, b1, w2, b2, width, activation):
    """``activation(x[:, :d] @ W1[:d] + b1) @ W2[:, :d] + b2[:d]`` with XLA's ops (``d = width``).

    ``x``: ``(rows, D)`` or ``(rows, d)``; ``w1``: ``(D, H)``; ``w2``: ``(H, D)``; the
    result is ``(rows, d)``. Products accumulate in float32, like the kernel's.
    """
    hidden = jnp.dot(x[:, :width], w1[:width], preferred_element_type=jnp.float32) + b1.astype(jnp.float32)
    hidden = activation(hidden).astype(x.dtype)
    out = jnp.dot(hidden, w2[:, :width], preferred_element_type=jnp.float32) + b2[:width].astype(jnp.float32)
    return out.astype(x.dtype)


def feature_chunk(width):
    """The largest power of 2 dividing ``width``, at most 256."""
    return min(width & -width, 256)


def kernel_fits(width, hidden, interpret=False, full=None):
    """Whether the compiled kernel takes a group of ``width`` and an MLP ``hidden`` wide:
    feature chunks of at least ``MIN_CHUNK`` and a hidden width with a power-of-2 block
    of at least ``MIN_CHUNK``. ``full``: the token rows' whole width ``D`` where a kernel
    reads all of it (``fused_residual_mlp``'s LayerNorm statistics, summed in chunks of
    ``feature_chunk(D)``: a ``D`` with a small power-of-2 factor would unroll hundreds of
    them). The interpreter takes any width (the hidden blocks are checked all the same)."""
    if feature_chunk(hidden) < MIN_CHUNK:
        return False
    return interpret or all(feature_chunk(w) >= MIN_CHUNK for w in (width, full) if w is not None)


TILES_ENV = "KERAS_MONE_MLP_TILES"
"""Tile settings for the kernels, per nested width, read when a call is traced (for tuning on
a card: ``bench/kernel_tiles.py`` finds them, ``bench/gpu_forms.py`` times a model with
them): ``"96:128,64,4,3;192:64,128,8,3;384:plain"`` = ``width:block_rows,block_hidden,
num_warps,num_stages``, or ``width:plain`` for a width that keeps XLA's plain path (where
the card ran it faster than every tile); widths not named keep the defaults."""

PLAIN = "plain"
"""``tile_override``'s answer for a width that keeps the plain path."""


def tile_override(width):
    """``(block_rows, block_hidden, num_warps, num_stages)`` for ``width`` from ``$KERAS_MONE_MLP_TILES``,
    ``PLAIN`` (the width keeps XLA's plain path), or ``None``. The whole value is checked
    (positive integers, each width once), whichever width is asked for; both kernels take
    the tiles it names (``bench/kernel_tiles.py --kernel residual`` or ``mlp`` tunes either)."""
    import os

    text = os.environ.get(TILES_ENV, "").strip()
    tiles = {}
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        try:
            key, values = entry.split(":")
            numbers = (int(key),) if values.strip() == PLAIN else tuple(int(v) for v in (key, *values.split(",")))
        except ValueError:
            numbers = ()
        if len(numbers) not in (1, 5) or min(numbers, default=0) < 1:
            raise ValueError(f"${TILES_ENV} entries are width:block_rows,block_hidden,num_warps,num_stages "
                             f"(positive integers) or width:{PLAIN}, separated by ';', e.g. '96:128,64,4,3;"
                             f"384:{PLAIN}'; got {entry!r}.")
        if numbers[0] in tiles:
            raise ValueError(f"${TILES_ENV} names width {numbers[0]} twice: {text!r}.")
        tiles[numbers[0]] = numbers[1:] or PLAIN
    return tiles.get(width)


def weight_bytes_per_hidden_element(width, block_rows, itemsize=2):
    """Bytes of the weight slices ``W1[:d]`` and ``W2[:, :d]`` a program loads per hidden
    element it computes: every program of ``block_rows`` rows reads both slices whole, so
    ``2 d itemsize / block_rows``. These loads come from L2 (the slices fit in it), and the
    kernel is bound by them where they exceed what it saves. XLA's path moves ``4 itemsize``
    per hidden element through memory (fc1 writes it, the GELU reads and writes it, fc2
    reads it): at d = 192 in bf16, 32-row tiles load 24 bytes from L2 to save 8 from memory,
    128-row tiles 6."""
    return 2 * width * itemsize / block_rows


def default_blocks(width, hidden, itemsize=2):
    """``(block_rows, block_hidden)`` for 8 warps, for both kernels (``fused_residual_mlp``
    too), chosen so that the compiled loop computes each hidden element's GELU once (a tile
    small for its warps has Triton give two warpgroups copies of the same fc1 and GELU,
    BENCHMARKS.md, "The block kernel computed its GELU twice") and loads the weights as few
    times as the registers allow (``weight_bytes_per_hidden_element``: every program loads
    both weight slices whole):

    * ``d <= 192``: 128 rows (each warpgroup its own 64, on Hopper's ``wgmma``; the float32
      accumulator takes ``d / 2 <= 96`` registers per thread), 32 hidden columns up to d = 96,
      16 beyond (the block kernel at d = 192 fits 255 registers only so);
    * wider: 32 rows x 64 hidden columns, which Triton spreads over the 8 warps
      (``mma.sync``): 128 rows would need ``d / 2 = 192`` accumulator registers per thread.

    The hidden block is halved while one weight tile passes 48 KB (float32 at d = 384: 32
    columns, where the loop computes the GELU twice; 64 would need 248 KB of shared memory,
    past the card's 227). Compiled for sm_90 at ViT-B/16's widths (``bench/kernel_compile.py``):
    no spills in bf16; the block kernel in float32 at d = 192 spills 44 bytes."""
    if width <= 96:
        rows, block_hidden = 128, 32
    elif width <= 192:
        rows, block_hidden = 128, 16
    else:
        rows, block_hidden = 32, 64
    block_hidden = min(block_hidden, feature_chunk(hidden))
    while block_hidden > MIN_CHUNK and width * block_hidden * itemsize > 48 * 1024:
        block_hidden //= 2
    return rows, block_hidden


def kernel_pays(width, hidden, itemsize=2):
    """Whether a width's default tile loads no more weight bytes per hidden element than XLA's
    path moves through memory for it (``4 itemsize``: fc1's write, the GELU's read and write,
    fc2's read). Where it loads more (d = 384 at 32 rows: 48 bytes against 8 in bf16) the
    kernel is bound by its weight loads and is not used unless ``$KERAS_MONE_MLP_TILES`` names
    the width (a card's screen, ``bench/kernel_tiles.py``, found a tile that pays)."""
    rows, _ = default_blocks(width, hidden, itemsize)
    return weight_bytes_per_hidden_element(width, rows, itemsize) <= 4 * itemsize


def fused_nested_mlp(
    x, w1, b1, w2, b2, width, activation, block_rows=None, block_hidden=None, num_warps=8, num_stages=2,
    interpret=False,
):
    """The nested MLP of ``plain_nested_mlp`` as one Pallas kernel (see the module docstring).

    Args:
        x: ``(rows, D)`` token rows; columns past ``width`` are not read.
        w1, b1: fc1's ``(D, H)`` kernel and ``(H,)`` bias.
        w2, b2: fc2's ``(H, D)`` kernel and ``(D,)`` bias.
        width: the group's nested width ``d``.
        activation: an elementwise function (float32 in, float32 out), e.g. GELU.
        block_rows, block_hidden: tile sizes (powers of 2); ``default_blocks`` if ``None``.
        num_warps, num_stages: Triton's launch settings (8 warps: no register spills at
            ViT-B/16's widths, where 4 spilled; ``bench/kernel_compile.py``).
        interpret: run through Pallas' interpreter (no accelerator needed).

    Returns:
        ``(rows, width)`` in ``x``'s dtype.
    """
    tiles = checked_tiles(x, w1, w2, width, block_rows, block_hidden, num_warps, num_stages)
    if x.shape[0] == 0:  # an empty token group: nothing to launch
        return jnp.zeros((0, width), x.dtype)
    return _jitted_mlp(x, w1, b1, w2, b2, width, activation, tiles, bool(interpret))


def checked_tiles(x, w1, w2, width, block_rows, block_hidden, num_warps, num_stages):
    """``(block_rows, block_hidden, num_warps, num_stages)`` for a kernel call, after
    checking the shapes (clear errors naming the argument)."""
    hidden = w1.shape[1]
    if not 0 < width <= x.shape[1] or width > w1.shape[0] or w2.shape != (hidden, w1.shape[0]):
        raise ValueError(
            f"`width` must lie in [1, {min(x.shape[1], w1.shape[0])}] with w1 (D, H) and w2 (H, D); "
            f"got width={width}, x {x.shape}, w1 {w1.shape}, w2 {w2.shape}."
        )
    if not jnp.dtype(x.dtype) == jnp.dtype(w1.dtype) == jnp.dtype(w2.dtype):
        raise ValueError(f"The rows and both MLP kernels must share a dtype (Triton's dot); got {x.dtype}, "
                         f"{w1.dtype} and {w2.dtype}.")
    defaults = default_blocks(width, hidden, jnp.dtype(x.dtype).itemsize)
    tiles = (block_rows or defaults[0], block_hidden or defaults[1], num_warps, num_stages)
    for name, tile in zip(("block_rows", "block_hidden"), tiles):
        if tile < MIN_CHUNK or tile & (tile - 1):
            raise ValueError(f"`{name}` must be a power of 2 of at least {MIN_CHUNK} (Triton's tiles), got {tile}.")
    if hidden % tiles[1]:
        raise ValueError(f"`block_hidden`={tiles[1]} must divide the MLP's hidden width {hidden}.")
    return tiles


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


def kernel_name(tile_function, width, hidden):
    """The name a kernel is compiled under: its tile function, nested width and hidden width
    (``_mlp_tile_d96_h3072``), so that a program's reader (``bench.hlo_kernels``) and a
    profile tell the kernels apart and ``kernel_flops`` can count their products."""
    return f"{tile_function}_d{width}_h{hidden}"


def _named_widths(name):
    match = re.search(r"(_mlp|_residual)_tile_d(\d+)_h(\d+)", name)
    return None if match is None else (match.group(1), int(match.group(2)), int(match.group(3)))


def kernel_flops(name, rows):
    """The matmul FLOPs of a kernel named by ``kernel_name`` over ``rows`` (padded) rows:
    fc1's and fc2's products, ``2 d H`` each per row; ``None`` for another name."""
    widths = _named_widths(name)
    return None if widths is None else 4 * rows * widths[1] * widths[2]


def kernel_bytes(name, rows, full, itemsize):
    """Bytes a kernel named by ``kernel_name`` moves through device memory over ``rows``
    (padded) rows of a ``full``-wide stream: the weight slices ``W1[:d]`` and ``W2[:, :d]``
    once (later programs find them in L2), the rows it reads (``x[:, :d]``; the block kernel
    all of ``z`` and the per-row scale) and the ``(rows, d)`` it writes; ``None`` for another
    name. A program reading an operand's BlockSpec block does not read the rest of it."""
    widths = _named_widths(name)
    if widths is None:
        return None
    kind, width, hidden = widths
    read = rows * (full + 1) if kind == "_residual" else rows * width
    return itemsize * (read + 2 * width * hidden + hidden + width + rows * width)


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
