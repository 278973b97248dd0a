"""The Triton program of torch's grouped nested projection: one launch over all of a block's
token groups (``kernels.triton_grouped_projection`` holds the function users call, its checks,
its plain twin and its custom ops, ``kernels.triton_grouped_launch`` the launch; the former's
module docstring gives the equations).

A program takes ``BLOCK_ROWS`` rows of one group by ``BLOCK_COLS`` output columns. Which rows
and which width is data: the tile table (``tile_table``: each row tile's first row, its group's
end row and width), an int32 tensor the program reads three entries of. The layout (the batch
size, the capacities) is therefore not compiled in, only the rows' alignment (``ROW_ALIGN``, a
power of 2 up to ``BLOCK_ROWS``): one compile per alignment (eight at 128-row tiles) and
projection shape and dtype serves every batch size in eager calls. Inside ``torch.compile``,
which compiles per shape anyway, the layout is compiled in (``STATIC_TABLE``, ``group_table``),
so that no table in device memory must outlive a call replayed as a CUDA graph. Every program
runs one code path (a branch per group spilled registers on sm_90: BENCHMARKS.md). Block
pointers whose shapes end at the group's last row and its width give zeros past them as they
load: x's features past ``d`` (an in-projection), W's columns past ``d`` (an out-projection:
Eq. 7's ``Pad``), so the GEMM's loads need no per-element masks (the LayerNorm prologue masks its
weights past ``d``). On a card the contraction loop stops at the group's width; Triton's
interpreter, which takes only Python ints as loop bounds, runs every step and reads zeros
past it, so CI checks the results and ``compile_for_cuda`` the compiled loop. ``SPLIT_ROWS``: x is
a ``(tokens, batch, K)`` view with strides of its own, token-major row ``n * batch + b`` read at
``n * x_outer + b * x_stride`` (pointer loads masked at the group's last row and width, as the
block pointer's shape masks them; 32-bit offsets, which the caller guarantees: 64-bit ones
doubled the float32 out-projection's spills on sm_90): the attention's output as torch's memory-efficient CUDA SDPA
writes it, batch-major, read in place by the out-projection instead of copied to token-major rows.

The program's helpers are ``@triton.jit`` functions of this module, which Triton's interpreter
runs as Python (``triton_build.python_helpers``). Sums are ``tl.reduce`` with the combine function
of Triton's own ``tl.sum`` (``tl.standard._sum_combine``, a private name): ``tl.sum`` itself, a
``@jit`` helper of Triton's, does not run under an interpreter chosen after Triton was imported.
``UPCAST`` (the interpreter): 16-bit operands go to ``tl.dot`` as float32, exact products as on
tensor cores. ``HAS_NORM`` (in-projections): each loaded tile is the LayerNorm's ``(x - mean) * (rstd * gamma) + beta`` in
float32, rounded to the rows' dtype, zeros past the group's width; the statistics come per
row, computed beforehand, or (``NORM_TILES``) as the previous out-projection's per-tile partials,
combined per row here (``triton_row_statistics.combined_statistics``'s update; ``mean_ptr`` and
``rstd_ptr`` then hold ``(NORM_TILES, rows)`` means and sums of squared deviations). ``STATS_OUT``
(out-projections): each program writes its rows' partials over its ``BLOCK_COLS`` columns, as
stored (rounded to the output's dtype), for the next LayerNorm (``TilePartials``).
"""

import functools

from keras_mone.kernels import triton_build
from keras_mone.kernels.tiles import check_projection_tiles as check_tiles
from keras_mone.kernels.tiles import largest_power_of_2_dividing

ACTIVATIONS = (None, "gelu", "gelu_tanh")


def default_tiles(contraction, columns):
    """``(block_rows, block_cols, block_k, num_warps, num_stages)`` for a ``(K, N)`` projection:
    128 rows on 8 warps (two Hopper warpgroups), the widest power of 2 up to 128 dividing ``N``,
    32 contraction elements per step, 3 stages. Compiled for sm_90 without a card
    (``bench/triton_grouped_compile.py``, BENCHMARKS.md) at MoNE-ViT-B/16's four projections,
    batch 256: in bf16 and in float32 with TF32, wgmma and few or no spills; 64-element steps
    spilled more. Float32 at torch's default precision ("highest") has no tensor-core dot and
    spills more (as cuBLAS, it runs on the FMA units). Not screened on a card
    (``bench/triton_grouped_tiles.py``)."""
    return (128, largest_power_of_2_dividing(columns, 128), largest_power_of_2_dividing(contraction, 32), 8, 3)


def tile_table(sizes, widths, block_rows):
    """The kernel's tile table of groups of ``sizes`` rows (consecutive; empty ones have no tiles)
    at ``widths``: a flat tuple, three ints per row tile (its first row and its group's end row,
    both in units of ``row_align`` rows, and its group's width), the number of row tiles, and
    ``row_align``: the largest power of 2 up to ``block_rows`` dividing every group's first row
    and size. The kernel multiplies back by it, a compile-time constant, so the compiler knows
    the rows' alignment (the only thing of the layout it is compiled for)."""
    boundaries = [0]
    for size in sizes:
        boundaries.append(boundaries[-1] + size)
    row_align = block_rows
    while any(boundary % row_align for boundary in boundaries):
        row_align //= 2
    table = []
    for (start, end), width in zip(zip(boundaries, boundaries[1:]), widths):
        for first_row in range(start, end, block_rows):
            table += [first_row // row_align, end // row_align, width]
    return tuple(table), len(table) // 3, row_align


@functools.lru_cache(maxsize=1024)
def group_table(sizes, widths, block_rows, row_align):
    """The compile-time form of the layout (``STATIC_TABLE``): per non-empty group its first row
    tile, its first and end rows in units of ``row_align``, and its width, four tuples. A
    program finds its group by comparisons with constants: no memory read, nothing to keep
    alive between calls (CUDA graphs), one compile per layout. ``sizes`` and ``widths`` tuples:
    made once per layout."""
    table, first_tile, start = [], 0, 0
    for size, width in zip(sizes, widths):
        if size:
            table.append((first_tile, start // row_align, (start + size) // row_align, width))
            first_tile += -(-size // block_rows)
        start += size
    return tuple(tuple(column) for column in zip(*table))


@functools.lru_cache(maxsize=1024)
def constants(contraction, columns, side, activation, tiles, has_bias, has_residual, has_scale, has_norm, precision,
              upcast, row_align, has_alpha=False, static_table=None, split_rows=False, stats_out=False, norm_tiles=0):
    """The kernel's compile-time arguments: of the layout of the groups, only ``row_align``, or
    with ``static_table`` (``group_table``) all of it. ``split_rows``: x read as ``(tokens, batch,
    K)`` with strides of its own (row ``n * batch + b``; the batch size is not compiled in).
    ``stats_out``: write the output's per-tile partials; ``norm_tiles``: the LayerNorm's statistics
    come as that many tiles' partials (0: per row). Made once per set of arguments (a launch's
    host time): the dict returned is shared, read it only."""
    firsts, starts, ends, widths = static_table or ((0,), (0,), (0,), (0,))
    norm_tiles = norm_tiles if has_norm else 0
    return dict(SPLIT_ROWS=split_rows, STATIC_TABLE=bool(static_table), FIRSTS=firsts, STARTS=starts, ENDS=ends,
                WIDTHS=widths, GROUPS=len(firsts), ROW_ALIGN=row_align, K=contraction, K_STEPS=contraction // tiles[2],
                N=columns, SIDE_IN=side == "in", ACTIVATION=ACTIVATIONS.index(activation), HAS_BIAS=has_bias,
                HAS_RESIDUAL=has_residual, HAS_SCALE=has_scale, HAS_ALPHA=has_alpha, HAS_NORM=has_norm,
                BLOCK_ROWS=tiles[0], BLOCK_COLS=tiles[1], BLOCK_K=tiles[2], PRECISION=precision, UPCAST=upcast,
                STATS_OUT=stats_out and side == "out", NORM_TILES=norm_tiles,
                NORM_TILES_P2=1 << max(norm_tiles - 1, 0).bit_length(), STATS_COLS=contraction // max(norm_tiles, 1))


def compile_for_cuda(contraction, columns, side, dtype="bf16", tiles=None, activation=None,
                     residual=False, scale=False, norm=False, capability=90, weight_dtype=None, precision="tf32",
                     row_align=None, groups=None, split_rows=False, statistics=False, norm_tiles=0):
    """The kernel for a ``(K, N)`` projection (any layout of token groups) compiled by Triton for
    a CUDA card of compute ``capability`` (90: H100/H200), without one: Triton's
    ``CompiledKernel`` (``.asm["ptx"]``, ``.metadata.shared``; ``bench/kernel_compile.py`` reads
    registers and spills from it). ``dtype``: Triton's name of the rows' ("bf16", "fp16",
    "fp32"); ``weight_dtype`` the weights' and bias' (default the rows': what a model's call under
    mixed precision passes, Keras' autocast having cast them; "fp32": float32 variables passed
    as they are); the LayerNorm's weights are float32. ``precision``: float32 rows' dot, "tf32"
    (torch's ``float32_matmul_precision`` "high") or "ieee" (its default "highest": no tensor cores).
    ``row_align``: ``tile_table``'s (default ``block_rows``: every group's rows a multiple of it, as
    ViT-B/16's at a batch size that is a multiple of 128). ``scale``: ``True`` (a factor per row)
    or ``"gate"`` (MoNE's ``alpha g + 1`` from a gate per row). ``groups``: ``((rows, width), ...)``
    for the compile-time table (``STATIC_TABLE``, what ``torch.compile`` runs), else the tile
    table read at run time (eager). ``split_rows``: rows read as ``(tokens, batch, K)`` with
    strides (the attention's output as torch's memory-efficient CUDA SDPA writes it, batch-major).
    ``statistics``: an out-projection that writes its output's per-tile partials; ``norm_tiles``: an
    in-projection whose LayerNorm combines that many tiles' partials (0: statistics per row)."""
    tiles = tuple(tiles or default_tiles(contraction, columns))
    check_tiles(tiles, contraction, columns)
    row_align = row_align or tiles[0]
    table = None if groups is None else group_table(tuple(r for r, _ in groups), tuple(w for _, w in groups), tiles[0],
                                                      row_align)
    compiled = constants(contraction, columns, side, activation, tiles, True, residual, bool(scale), norm, precision,
                         False, row_align, scale == "gate", table, split_rows, statistics, norm_tiles)
    weights = weight_dtype or dtype
    signature = {"x_ptr": f"*{dtype}", "w_ptr": f"*{weights}", "b_ptr": f"*{weights}", "residual_ptr": f"*{dtype}",
                 "scale_ptr": f"*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "gamma_ptr": "*fp32",
                 "beta_ptr": "*fp32", "alpha_ptr": "*fp32", "out_ptr": f"*{dtype}", "table_ptr": "*i32"}
    signature.update({name: "i32" for name in ("x_stride", "x_outer", "x_batch", "w_stride", "out_stride",
                                                "stats_stride")})
    signature["epsilon"] = "fp32"
    return triton_build.compile_for_cuda(_grouped_tile, signature, compiled,
                                         {"num_warps": tiles[3], "num_stages": tiles[4]}, capability)


def kernel(interpret):
    """The Triton kernel, compiled (``triton.jit``) or for Triton's interpreter."""
    return triton_build.jitted(_grouped_tile, interpret)


try:  # the kernel is defined where Triton is installed
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the plain path runs
    triton = tl = None

if tl is not None:

    def _grouped_tile(x_ptr, w_ptr, b_ptr, residual_ptr, scale_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, alpha_ptr,
                      out_ptr, table_ptr, x_stride, x_outer, x_batch, w_stride, out_stride, stats_stride, epsilon,
                      SPLIT_ROWS: tl.constexpr,
                      STATIC_TABLE: tl.constexpr, FIRSTS: tl.constexpr, STARTS: tl.constexpr, ENDS: tl.constexpr,
                      WIDTHS: tl.constexpr, GROUPS: tl.constexpr, ROW_ALIGN: tl.constexpr, K: tl.constexpr,
                      K_STEPS: tl.constexpr, N: tl.constexpr, SIDE_IN: tl.constexpr, ACTIVATION: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
                      HAS_ALPHA: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      BLOCK_COLS: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                      STATS_OUT: tl.constexpr, NORM_TILES: tl.constexpr, NORM_TILES_P2: tl.constexpr,
                      STATS_COLS: tl.constexpr):
        """One program (the module docstring says what its flags do)."""
        first_column, row_tile, inner = tl.program_id(0) * BLOCK_COLS, tl.program_id(1), tl.arange(0, BLOCK_K)
        columns = first_column + tl.arange(0, BLOCK_COLS)
        row_type = x_ptr.dtype.element_ty
        dot_type = tl.float32 if UPCAST else row_type
        first_row, end_row, width = _row_tile(table_ptr, row_tile, STATIC_TABLE, FIRSTS, STARTS, ENDS, WIDTHS, GROUPS,
                                              ROW_ALIGN, BLOCK_ROWS)
        rows = first_row + tl.arange(0, BLOCK_ROWS)
        live = rows < end_row
        if SIDE_IN:  # the contraction stops at the group's width
            x_shape, w_shape, steps = (end_row, width), (width, N), (width + BLOCK_K - 1) // BLOCK_K
        else:  # column tiles past the group's width have nothing to compute
            x_shape, w_shape, steps = (end_row, K), (K, width), tl.where(first_column < width, K_STEPS, 0)
        if SPLIT_ROWS:  # x (tokens, batch, K) with any strides (SDPA's output): row n * batch + b, int32 offsets
            x_rows = x_ptr + ((rows // x_batch) * x_outer + (rows % x_batch) * x_stride)[:, None] + inner[None, :]
        else:
            tiles = tl.make_block_ptr(x_ptr, x_shape, (x_stride, 1), (first_row, 0), (BLOCK_ROWS, BLOCK_K), (1, 0))
        weights = tl.make_block_ptr(w_ptr, w_shape, (w_stride, 1), (0, first_column), (BLOCK_K, BLOCK_COLS), (1, 0))
        if HAS_NORM and NORM_TILES > 0:  # the previous out-projection's per-tile partials, combined per row
            mean, rstd = _combined_partials(mean_ptr, rstd_ptr, rows, live, stats_stride, epsilon, K, NORM_TILES,
                                            NORM_TILES_P2, STATS_COLS)
        elif HAS_NORM:  # the rows' statistics, loaded once per tile
            mean = tl.load(mean_ptr + rows, mask=live, other=0.0)[:, None]
            rstd = tl.load(rstd_ptr + rows, mask=live, other=0.0)[:, None]
        accumulator = tl.full((BLOCK_ROWS, BLOCK_COLS), 0.0, tl.float32)
        # the interpreter loops to K_STEPS (its loop bounds are Python ints): past `steps` the loads give zeros
        for step in range(0, K_STEPS if UPCAST else steps):
            features = step * BLOCK_K + inner
            if SPLIT_ROWS:  # zeros past the group's last row and its width (x_shape, as the block pointer's)
                inside = live[:, None] & (features < x_shape[1])[None, :]
                tile = tl.load(x_rows + step * BLOCK_K, mask=inside, other=0.0)
            else:
                tile = tl.load(tiles, boundary_check=(0, 1), padding_option="zero")
                tiles = tl.advance(tiles, (0, BLOCK_K))
            if HAS_NORM:
                gamma = tl.load(gamma_ptr + features, mask=features < width, other=0.0).to(tl.float32)[None, :]
                beta = tl.load(beta_ptr + features, mask=features < width, other=0.0).to(tl.float32)[None, :]
                tile = ((tile.to(tl.float32) - mean) * (rstd * gamma) + beta).to(row_type)
                tile = tl.where((features < width)[None, :], tile, 0.0)
            panel = tl.load(weights, boundary_check=(0, 1), padding_option="zero")
            accumulator = tl.dot(tile.to(dot_type), panel.to(row_type).to(dot_type), accumulator,
                                 input_precision=PRECISION)
            weights = tl.advance(weights, (BLOCK_K, 0))
        if HAS_BIAS:
            bias = tl.load(b_ptr + columns, mask=columns < (N if SIDE_IN else width), other=0.0)
            accumulator += bias.to(tl.float32)[None, :]
        if ACTIVATION == 1:  # the exact (erf) GELU
            accumulator = 0.5 * accumulator * (1.0 + tl.math.erf(accumulator * 0.7071067811865476))
        if ACTIVATION == 2:  # the tanh GELU: 0.5 x (1 + tanh(u)) = x sigmoid(2u)
            cubic = accumulator + 0.044715 * accumulator * accumulator * accumulator
            accumulator = accumulator / (1.0 + tl.exp(-1.5957691216057308 * cubic))
        if HAS_SCALE:  # the gate, then the residual (out-projections)
            factor = tl.load(scale_ptr + rows, mask=live, other=0.0).to(tl.float32)
            if HAS_ALPHA:  # MoNE's alpha g + 1 (Eq. 1) from the gate per row
                factor = tl.load(alpha_ptr).to(tl.float32) * factor + 1.0
            accumulator *= factor[:, None]
        if HAS_RESIDUAL:
            residual = tl.make_block_ptr(residual_ptr, (end_row, N), (out_stride, 1), (first_row, first_column),
                                         (BLOCK_ROWS, BLOCK_COLS), (1, 0))
            accumulator += tl.load(residual, boundary_check=(0,), padding_option="zero").to(tl.float32)
        out = tl.make_block_ptr(out_ptr, (end_row, N), (out_stride, 1), (first_row, first_column),
                                (BLOCK_ROWS, BLOCK_COLS), (1, 0))
        stored = accumulator.to(out_ptr.dtype.element_ty)
        tl.store(out, stored, boundary_check=(0,))
        if STATS_OUT:  # this tile's partials of the stored rows, for the next LayerNorm
            _store_partials(stored.to(tl.float32), mean_ptr + tl.program_id(0) * stats_stride + rows,
                            rstd_ptr + tl.program_id(0) * stats_stride + rows, live, BLOCK_COLS)

    @triton.jit
    def _row_tile(table_ptr, row_tile, STATIC_TABLE: tl.constexpr, FIRSTS: tl.constexpr, STARTS: tl.constexpr,
                  ENDS: tl.constexpr, WIDTHS: tl.constexpr, GROUPS: tl.constexpr, ROW_ALIGN: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr):
        """The row tile's first row, its group's end row and width: from the tile table, or compared
        with the compile-time group table (stored in ROW_ALIGN rows: 300-600 spilled bytes fewer)."""
        if STATIC_TABLE:
            first, start, end, width = row_tile * 0, row_tile * 0, row_tile * 0, row_tile * 0
            for group in tl.static_range(GROUPS):
                here = row_tile >= FIRSTS[group]
                first, start = tl.where(here, FIRSTS[group], first), tl.where(here, STARTS[group], start)
                end, width = tl.where(here, ENDS[group], end), tl.where(here, WIDTHS[group], width)
            return start * ROW_ALIGN + (row_tile - first) * BLOCK_ROWS, end * ROW_ALIGN, width
        first_row = tl.load(table_ptr + 3 * row_tile) * ROW_ALIGN
        return first_row, tl.load(table_ptr + 3 * row_tile + 1) * ROW_ALIGN, tl.load(table_ptr + 3 * row_tile + 2)

    @triton.jit
    def _combined_partials(means_ptr, squares_ptr, rows, live, stats_stride, epsilon, K: tl.constexpr,
                           NORM_TILES: tl.constexpr, NORM_TILES_P2: tl.constexpr, STATS_COLS: tl.constexpr):
        """Each row's ``(mean, rstd)``, as ``(rows, 1)`` columns, from ``NORM_TILES`` tiles' partials of
        ``STATS_COLS`` features each (``triton_row_statistics.combined_statistics``' update)."""
        part = tl.arange(0, NORM_TILES_P2)
        present = live[:, None] & (part < NORM_TILES)[None, :]
        offsets = part[None, :] * stats_stride + rows[:, None]
        means = tl.load(means_ptr + offsets, mask=present, other=0.0)
        within = tl.reduce(tl.load(squares_ptr + offsets, mask=present, other=0.0), 1, tl.standard._sum_combine)
        mean = tl.reduce(means, 1, tl.standard._sum_combine) / NORM_TILES
        spread = tl.where(present, means - mean[:, None], 0.0)
        variance = (within + STATS_COLS * tl.reduce(spread * spread, 1, tl.standard._sum_combine)) / K
        return mean[:, None], (1.0 / tl.sqrt(variance + epsilon))[:, None]

    @triton.jit
    def _store_partials(values, means_ptrs, squares_ptrs, live, BLOCK_COLS: tl.constexpr):
        """Each row's mean and sum of squared deviations over the tile's ``BLOCK_COLS`` float32
        ``values`` (two passes over registers), stored where ``live``."""
        tile_mean = tl.reduce(values, 1, tl.standard._sum_combine) / BLOCK_COLS
        centered = values - tile_mean[:, None]
        tl.store(means_ptrs, tile_mean, mask=live)
        tl.store(squares_ptrs, tl.reduce(centered * centered, 1, tl.standard._sum_combine), mask=live)
