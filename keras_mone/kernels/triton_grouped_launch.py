"""The launch of torch's grouped nested projection kernel on checked arguments
(``kernels.triton_grouped_projection`` checks them and holds the function users call; the
program itself: ``kernels.triton_grouped_tile``): how the rows are given to the kernel (2-D, or a
strided ``(tokens, batch, K)`` view read in place), the tile table of each layout (made once per
layout and device), and the output, with the per-tile partial statistics where asked.
"""

from keras_mone.kernels import triton_grouped_tile as _tile
from keras_mone.kernels.triton_build import exact_float32


def launch(x, w, b, residual, scale, mean, rstd, gamma, beta, alpha, spans, widths, side, activation, tiles,
           interpret, static_table=False, stats_out=False, epsilon=0.0):
    """The kernel launch: ``(rows, N)`` in ``x``'s dtype, or with ``stats_out`` ``(out, stats)``,
    ``stats`` ``(2, tiles, rows)`` float32: each row's mean and sum of squared deviations over each
    ``tiles[1]``-column tile (``triton_row_statistics.TilePartials``). ``static_table`` (inside
    ``torch.compile``): the layout compiled into the kernel, so that no device memory outlives the
    call (CUDA graphs replay what they captured); else (eager) the tile table, one compile per
    alignment of the groups' rows for every batch size. ``mean`` and ``rstd`` ``(tiles, rows)``:
    partials, combined in the prologue (``epsilon`` the LayerNorm's)."""
    import torch

    x, w, widths = kernel_rows(x), w.contiguous(), tuple(widths)
    split = x.dim() == 3  # (tokens, batch, K) strided: row n * batch + b at n * stride(0) + b * stride(1)
    rows, contraction, columns = rows_of(x), x.shape[-1], w.shape[1]
    out = x.new_empty((rows, columns))
    result, has_norm = out, mean is not None
    if stats_out:  # one allocation: the tiles' means and sums of squared deviations
        stats = torch.empty((2, columns // tiles[1], rows), device=x.device, dtype=torch.float32)
        mean, rstd = stats[0], stats[1]  # views (unpacking would be an unbind op of its own)
        result = (out, stats)
    sizes = tuple(stop - start for start, stop in spans)
    table, row_tiles, row_align = tile_table(sizes, widths, tiles[0], None if static_table else x.device)
    if not row_tiles:
        return result
    exact = exact_float32(x.dtype)
    groups = _tile.group_table(sizes, widths, tiles[0], row_align) if static_table else None
    norm_tiles = mean.shape[0] if has_norm and mean.dim() == 2 else 0
    compiled = _tile.constants(contraction, columns, side, activation, tiles, b is not None, residual is not None,
                               scale is not None, has_norm, "ieee" if exact else "tf32", interpret, row_align,
                               alpha is not None, groups, split, stats_out, norm_tiles)
    options = {} if interpret else {"num_warps": tiles[3], "num_stages": tiles[4]}
    pointers = [out if t is None else t.contiguous() for t in (b, residual, scale, mean, rstd, gamma, beta, alpha)]
    _tile.kernel(interpret)[(columns // tiles[1], row_tiles)](
        x, w, *pointers, out, out if table is None else table, x.stride(1) if split else x.stride(0),
        x.stride(0) if split else 0, x.shape[1] if split else 1, w.stride(0), columns, rows, epsilon, **compiled,
        **options)
    return result


def largest_offset(x):
    """The largest element offset a view ``x`` reaches (non-negative strides)."""
    return sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))


def rows_of(x):
    """The number of token rows of ``x``: ``(rows, K)`` or ``(tokens, batch, K)``."""
    return x.shape[0] if x.dim() == 2 else x.shape[0] * x.shape[1]


def kernel_rows(x):
    """``x`` as the kernel reads it: ``(rows, K)`` contiguous, or ``(tokens, batch, K)`` with unit
    feature stride where its first two axes do not merge into one and every offset fits 32 bits
    (the kernel's two-level row offsets are int32); else viewed or copied as 2-D."""
    if x.dim() == 2:
        return x.contiguous()
    split = x.dim() == 3 and x.stride(2) == 1 and x.shape[0] > 1 and x.shape[1] > 1
    if split and x.stride(0) != x.shape[1] * x.stride(1) and largest_offset(x) < 2**31:
        return x
    return x.reshape(-1, x.shape[-1]).contiguous()


TABLES = {}
"""Eager launches' tile tables by layout and device, each made once (a host-to-device copy on
first use) and kept: a layout's table is a few kilobytes, and a batch size has one layout."""


def tile_table(sizes, widths, block_rows, device):
    """``(table on device or None, row tiles, row_align)`` of a layout (``triton_grouped_tile.tile_table``);
    ``device`` ``None``: no table (the compile-time form)."""
    import torch

    key = (sizes, widths, block_rows, device)
    if key not in TABLES:
        table, row_tiles, row_align = _tile.tile_table(sizes, widths, block_rows)
        tensor = None if device is None else torch.tensor(table or (0,), dtype=torch.int32, device=device)
        TABLES[key] = (tensor, row_tiles, row_align)
    return TABLES[key]
