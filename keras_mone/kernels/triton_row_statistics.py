"""A LayerNorm's row statistics in one Triton pass (torch): what the grouped projections'
prologue needs (``kernels.triton_grouped_projection``, ``norm=``).

Keras' ``LayerNormalization`` on torch under mixed precision casts the bf16 rows to float32,
normalises them and casts back: three passes that write the ``(rows, D)`` stream in float32 and
bf16, for a result the next projection reads once. With the normalisation in the projection's
prologue only the statistics are needed: here each program reads ``BLOCK_ROWS`` rows once, in
their own dtype, and writes each row's mean and ``1 / sqrt(var + epsilon)`` in float32 (the
biased variance, two passes over the row held on chip: ``sum((x - mean)^2) / D``, as
``torch.nn.functional.layer_norm`` takes it). With autograd, under ``torch.compile`` and off
Triton, ``plain_row_statistics`` (torch's ops; inductor fuses its cast into the reduction).
Off CUDA (or ``interpret=True``) the kernel runs through Triton's interpreter: for tests.

Where the rows are an out-projection's output (``kernels.triton_grouped_projection``,
``statistics=True``), no pass of their own is needed: each program of the out-projection writes,
per row, the mean and the sum of squared deviations of its tile of columns (``TilePartials``), and
the next in-projection's prologue combines the tiles (Chan et al.'s pairwise update for equal
tiles, ``combined_statistics``): a two-pass-quality variance, no launch, no read of the rows.
"""

import math
from typing import NamedTuple

from keras_mone.kernels import triton_build


class TilePartials(NamedTuple):
    """Each row's statistics over ``tiles`` equal tiles of its ``D`` features: ``means`` and
    ``squares`` (the sum of squared deviations from the tile's mean), ``(tiles, rows)`` float32
    each, as an out-projection's epilogue writes them (``plain_tile_partials`` with torch's ops)."""

    means: object
    squares: object


def plain_tile_partials(x, tiles):
    """``TilePartials`` of ``x`` ``(rows, D)`` over ``tiles`` equal tiles of its features, with
    torch's ops (in float32)."""
    pieces = x.float().reshape(x.shape[0], tiles, x.shape[1] // tiles)
    means = pieces.mean(-1)
    squares = (pieces - means[..., None]).square().sum(-1)
    return TilePartials(means.t().contiguous(), squares.t().contiguous())


def check_partials(partials, epsilon, rows, dim, device):
    """Raise ``ValueError`` naming ``norm`` unless ``partials`` are ``TilePartials`` of ``rows`` rows
    over tiles that divide ``dim`` (float32 on ``device``) and ``epsilon`` a finite number >= 0."""
    import torch

    tensors = tuple(partials)
    shape = tuple(tensors[0].shape)
    fits = len(shape) == 2 and shape[1] == rows and 0 < shape[0] <= dim and dim % shape[0] == 0
    if not fits or any(tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != device for t in tensors):
        raise ValueError(f"`norm`'s TilePartials must be two float32 (tiles, {rows}) tensors on {device}, tiles "
                         f"dividing {dim}; got {[(tuple(t.shape), t.dtype, str(t.device)) for t in tensors]}.")
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 <= epsilon < math.inf:
        raise ValueError(f"`norm` with TilePartials takes the LayerNorm's epsilon second, a finite number >= 0; got "
                         f"{epsilon!r}.")


def combined_statistics(partials, epsilon, dim):
    """``(mean, rstd)`` of rows of ``dim`` features from their ``TilePartials``, with torch's ops:
    for ``T`` tiles of ``n = dim / T`` features, ``mean = sum_t m_t / T`` and
    ``M2 = sum_t M2_t + n sum_t (m_t - mean)^2`` (Chan, Golub and LeVeque's update), the biased
    variance ``M2 / dim`` as ``torch.nn.functional.layer_norm`` takes it. The prologue of
    ``kernels.triton_grouped_tile`` computes the same."""
    import torch

    tiles = partials.means.shape[0]
    mean = partials.means.mean(0)
    spread = (partials.means - mean).square().sum(0)
    variance = (partials.squares.sum(0) + (dim // tiles) * spread) / dim
    return mean, torch.rsqrt(variance + epsilon)


def plain_row_statistics(x, epsilon):
    """``(mean, rstd)`` of each row of ``x`` ``(rows, D)`` in float32, with torch's ops."""
    import torch

    variance, mean = torch.var_mean(x.float(), dim=-1, correction=0)
    return mean, torch.rsqrt(variance + epsilon)


def row_statistics(x, epsilon, interpret=None):
    """``plain_row_statistics`` as one Triton launch where ``x`` runs eagerly without autograd;
    ``plain_row_statistics`` elsewhere. ``interpret``: Triton's interpreter (default: off CUDA)."""
    import torch

    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"`x` must be (rows, D) float16, bfloat16 or float32 rows; got {tuple(x.shape)} {x.dtype}.")
    recording = torch.is_grad_enabled() and x.requires_grad
    if triton is None or recording or torch.compiler.is_compiling() or x.shape[0] == 0:
        return plain_row_statistics(x, epsilon)
    x = x.contiguous()
    interpret = x.device.type != "cuda" if interpret is None else bool(interpret)
    statistics = torch.empty((2, x.shape[0]), device=x.device, dtype=torch.float32)  # one allocation
    mean, rstd = statistics[0], statistics[1]
    block_rows = 16
    _kernel(interpret)[(triton.cdiv(x.shape[0], block_rows),)](
        x, mean, rstd, x.shape[0], x.stride(0), float(epsilon),
        D=x.shape[1], BLOCK_D=triton.next_power_of_2(x.shape[1]), BLOCK_ROWS=block_rows)
    return mean, rstd


def compile_for_cuda(dim, dtype="bf16", block_rows=16, capability=90):
    """The kernel for rows of ``dim`` features compiled by Triton for a CUDA card of compute
    ``capability`` (90: H100/H200), without one: Triton's ``CompiledKernel``."""
    constants = dict(D=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_ROWS=block_rows)
    signature = {"x_ptr": f"*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "rows": "i32", "x_stride": "i32",
                 "epsilon": "fp32"}
    return triton_build.compile_for_cuda(_statistics_tile, signature, constants, {"num_warps": 4}, capability)


def _kernel(interpret):
    return triton_build.jitted(_statistics_tile, interpret)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the plain path runs
    triton = tl = None

if tl is not None:

    def _statistics_tile(x_ptr, mean_ptr, rstd_ptr, rows, x_stride, epsilon, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr):
        """``BLOCK_ROWS`` rows, each whole (``BLOCK_D``: ``D`` rounded up to a power of 2). Sums
        by ``tl.reduce`` with the combine function of Triton's own ``tl.sum``: ``tl.sum`` is a
        ``@jit`` helper, which does not run under an interpreter chosen after Triton was imported,
        and the interpreter sums that combine function with numpy."""
        row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        feature = tl.arange(0, BLOCK_D)
        inside = (row < rows)[:, None] & (feature < D)[None, :]
        x = tl.load(x_ptr + row[:, None] * x_stride + feature[None, :], mask=inside, other=0.0).to(tl.float32)
        mean = tl.reduce(x, 1, tl.standard._sum_combine) / D
        centered = tl.where(inside, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.reduce(centered * centered, 1, tl.standard._sum_combine) / D + epsilon)
        tl.store(mean_ptr + row, mean, mask=row < rows)
        tl.store(rstd_ptr + row, rstd, mask=row < rows)
