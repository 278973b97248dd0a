"""Tiles, names and costs of the fused nested-MLP kernels, for every backend (issue 40).

Pure Python, no framework: ``fused_nested_mlp`` and ``fused_residual_mlp`` (Pallas, jax) and
``triton_nested_mlp`` (Triton, torch) take their tiles here; ``bench.hlo_kernels`` reads a
compiled kernel's products and traffic from its name (``kernel_name``). ``launchable`` is the
check every Triton launch setting here passes (the grouped projections', their gradients' and
flash attention's too); the grouped projections of both backends (``grouped_kernel``, Pallas;
``triton_grouped_tile``, Triton) share their tile check and their tiles variable's reading
(``check_projection_tiles``, ``shape_tiles``).
"""

import os
import re

MIN_CHUNK = 16
"""The smallest feature chunk a tensor-core ``dot`` takes (Triton: K >= 16)."""


def launchable(tiles, blocks):
    """Whether ``tiles`` reads as ``blocks`` block sizes, a warp count and a stage count: the
    blocks and the warps powers of 2, the blocks at least ``MIN_CHUNK``, the stages a positive
    int. Each kernel's check raises its own message, naming its tuple's fields."""
    if not isinstance(tiles, tuple) or len(tiles) != blocks + 2 or not all(isinstance(t, int) for t in tiles):
        return False
    powers = all(t > 0 and t & (t - 1) == 0 for t in tiles[:blocks + 1])
    return powers and min(tiles[:blocks]) >= MIN_CHUNK and tiles[-1] >= 1


def shape_tiles(variable, contraction, columns, check, key="KxN", example="768x2304=64,128,64,4,3"):
    """The tiles the environment ``variable`` names for a ``(K, N)`` kernel, or ``None``: entries
    ``KxN=comma,separated,ints`` separated by ``;`` or spaces (e.g.
    ``768x2304=64,128,64,4,3;3072x768=64,64,64,4,3``); a malformed entry raises ``ValueError``
    naming the variable, the entries' ``key`` and an ``example``, and ``check(tiles, K, N)`` raises for tiles the kernel
    cannot take. The grouped projections (Pallas and Triton), their weight gradients and flash
    attention (``K`` and ``N`` its queries and keys) read theirs so."""
    for entry in os.environ.get(variable, "").replace(";", " ").split():
        shape, _, values = entry.partition("=")
        try:
            k, n = (int(v) for v in shape.split("x"))
            tiles = tuple(int(v) for v in values.split(","))
        except ValueError:
            raise ValueError(f"${variable} entries must read {key}=comma,separated,ints (e.g. {example}), "
                             f"got {entry!r}.") from None
        if (k, n) == (contraction, columns):
            check(tiles, contraction, columns)
            return tiles
    return None


def check_projection_tiles(tiles, contraction, columns):
    """Raises ``ValueError`` naming what is wrong with ``tiles`` = ``(block_rows, block_cols,
    block_k, num_warps, num_stages)`` for a grouped projection of a ``(K, N)`` kernel (the Pallas
    and the Triton one)."""
    if not launchable(tuple(tiles), blocks=3):
        raise ValueError(f"`tiles` must be (block_rows, block_cols, block_k, num_warps, num_stages): four powers "
                         f"of 2, blocks of at least 16 (Triton's dot), and a positive stage count; got {tiles!r}.")
    block_cols, block_k = tiles[1:3]
    if columns % block_cols or contraction % block_k:
        raise ValueError(f"`tiles`' block_cols ({block_cols}) must divide N = {columns} and block_k ({block_k}) "
                         f"divide K = {contraction}.")


def largest_power_of_2_dividing(n, at_most):
    """The largest power of 2 of at most ``at_most`` dividing ``n``, and no less than 16."""
    power = at_most
    while power > 16 and n % power:
        power //= 2
    return power


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
    """``(block_rows, block_hidden)`` for 8 warps, derived from the compiled code rather than
    timed: the rule for a kernel and width no card has screened (``default_tiles``). Chosen
    so that the compiled loop computes each hidden element's GELU once (a tile small for its
    warps has Triton give two warpgroups copies of the same fc1 and GELU, BENCHMARKS.md, "The
    block kernel computed its GELU twice") and loads the weights as few times as the
    registers allow (``weight_bytes_per_hidden_element``: every program loads both weight
    slices whole):

    * ``d <= 192``: 128 rows (each warpgroup its own 64, on Hopper's ``wgmma``; the float32
      accumulator takes ``d / 2 <= 96`` registers per thread), 32 hidden columns up to d = 96,
      16 beyond (the block kernel at d = 192 fits 255 registers only so);
    * wider: 32 rows x 64 hidden columns, which Triton spreads over the 8 warps
      (``mma.sync``): 128 rows would need ``d / 2 = 192`` accumulator registers per thread.

    The hidden block is halved while one weight tile passes 48 KB (``fitted_hidden_block``).
    Compiled for sm_90 at ViT-B/16's widths (``bench/kernel_compile.py``): no spills in bf16;
    the block kernel in float32 at d = 192 spills 44 bytes."""
    if width <= 96:
        rows, block_hidden = 128, 32
    elif width <= 192:
        rows, block_hidden = 128, 16
    else:
        rows, block_hidden = 32, 64
    return rows, fitted_hidden_block(block_hidden, width, hidden, itemsize)


def fitted_hidden_block(block_hidden, width, hidden, itemsize):
    """``block_hidden`` cut to a power-of-2 block of ``hidden`` and halved while one weight tile
    (``width x block_hidden``) passes 48 KB: float32 at d = 384 takes 32 columns, since 64
    would need 248 KB of shared memory at 3 stages, past an H100's or H200's 227."""
    block_hidden = min(block_hidden, feature_chunk(hidden))
    while block_hidden > MIN_CHUNK and width * block_hidden * itemsize > 48 * 1024:
        block_hidden //= 2
    return block_hidden


KERNELS = ("mlp", "residual", "triton")
"""The fused kernels, by the names ``default_tiles`` and ``kernel_pays`` take: the Pallas MLP
kernel (``fused_nested_mlp``), the Pallas block kernel (``fused_residual_mlp``) and the
Triton MLP kernel for torch (``triton_nested_mlp``)."""

CARD_TILES = {
    "residual": ((96, (64, 64, 4, 2)), (192, (64, 32, 4, 2))),
    "triton": ((96, (64, 64, 4, 2)), (192, (128, 32, 8, 3)), (None, (64, 16, 4, 2))),
}
"""Each kernel's fastest ``(block_rows, block_hidden, num_warps, num_stages)`` up to the
nested width named (``None``: any wider), timed on one H200 on 2026-11-28 in bf16 at the
token groups of MoNE-ViT-B/16 at e_c 0.3 and batch 256 (BENCHMARKS.md, "MoNE on an H200,
measured again"):

* the block kernel (``bench/kernel_tiles.py``): 0.357 ms against XLA's 0.536 at d = 96
  (the old default 0.491), 0.397 against 0.407 at d = 192 (the old default 0.627); at
  d = 384 XLA's path beat every tile (``kernel_pays``);
* the Triton kernel (``bench/triton_mlp.py --sweep``, 36 settings per width; d = 384's
  sweep was cut after 9): 0.237, 0.239 and 0.407 ms, against torch's ops at about 0.22,
  0.18 and 0.16 ms (which varied by up to 40% between rounds): slower at every width,
  which is why it stays opt-in.

Four warps and 64 rows (one warpgroup's ``wgmma``) beat the 8-warp, 128-row tiles that the
compiled code suggested for the block kernel. The Pallas MLP kernel alone was not screened
on a card; it and the widths past a table keep ``default_blocks``."""

CARD_ITEMSIZE = 2
"""The bytes per element of the rows the card screened (bf16): ``CARD_TILES`` and ``CARD_PAYS``
hold for 16-bit rows only."""

CARD_PAYS = {"residual": 192}
"""The widest nested width at which a kernel beat XLA's path on a card in bf16 (``CARD_TILES``).
The Triton kernel has no entry: it lost to torch's ops at every width, and runs only where
``$KERAS_MONE_MLP`` asks for it, at the widths its weight loads allow (``kernel_pays``)."""


def default_tiles(width, hidden, itemsize=2, kernel="mlp"):
    """``(block_rows, block_hidden, num_warps, num_stages)`` of ``kernel`` (one of ``KERNELS``)
    for a nested group of ``width`` and an MLP ``hidden`` wide: the card's fastest tiles
    (``CARD_TILES``) where it screened the kernel, for 16-bit rows (the screen's; in float32
    the Triton kernel's d = 192 tile needs 240 KB of shared memory at 3 stages, past the
    card's 227), else ``default_blocks`` with 8 warps and Triton's 2 stages (3 for the Triton
    kernel). The hidden block is fitted to ``hidden`` and cut while one weight tile passes
    48 KB (``fitted_hidden_block``)."""
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {list(KERNELS)}, got {kernel!r}.")
    for limit, tiles in CARD_TILES.get(kernel, ()) if itemsize == CARD_ITEMSIZE else ():
        if limit is None or width <= limit:
            rows, block_hidden, num_warps, num_stages = tiles
            return rows, fitted_hidden_block(block_hidden, width, hidden, itemsize), num_warps, num_stages
    return default_blocks(width, hidden, itemsize) + (8, 3 if kernel == "triton" else 2)


def resolved_tiles(width, hidden, itemsize, block_rows, block_hidden, num_warps, num_stages, kernel="mlp"):
    """``(block_rows, block_hidden, num_warps, num_stages)`` for a call of ``kernel``: the tiles
    given, ``default_tiles`` where ``None``, checked (powers of 2 of at least ``MIN_CHUNK``, a
    hidden block dividing ``hidden``) with errors naming the argument. The Pallas and the
    Triton kernels take their tiles so."""
    defaults = default_tiles(width, hidden, itemsize, kernel)
    given = (block_rows, block_hidden, num_warps, num_stages)
    tiles = tuple(default if value is None else value for value, default in zip(given, defaults))
    for name, tile in zip(("block_rows", "block_hidden"), tiles):
        if tile < MIN_CHUNK or tile & (tile - 1):
            raise ValueError(f"`{name}` must be a power of 2 of at least {MIN_CHUNK} (Triton's tiles), got {tile}.")
    if hidden % tiles[1]:
        raise ValueError(f"`block_hidden`={tiles[1]} must divide the MLP's hidden width {hidden}.")
    for name, value in zip(("num_warps", "num_stages"), tiles[2:]):
        if value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value}.")
    return tiles


def kernel_pays(width, hidden, itemsize=2, kernel="mlp"):
    """Whether ``kernel`` runs a group of ``width`` by default. In bf16, where a card screened
    the kernel against XLA's path (``CARD_PAYS``), its verdict: the block kernel up to
    d = 192. Elsewhere, whether the default tile loads no more weight bytes per hidden
    element than XLA's path moves through memory for it (``4 itemsize``: fc1's write, the
    GELU's read and write, fc2's read): at d = 384, 32-row tiles load 48 bytes against 8 in
    bf16, and the kernel is bound by its weight loads. A width that does not pay keeps the
    plain path unless ``$KERAS_MONE_MLP_TILES`` names it."""
    if itemsize == CARD_ITEMSIZE and kernel in CARD_PAYS:
        return width <= CARD_PAYS[kernel]
    rows = default_tiles(width, hidden, itemsize, kernel)[0]
    return weight_bytes_per_hidden_element(width, rows, itemsize) <= 4 * itemsize


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
