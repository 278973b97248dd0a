"""A nested projection over all of a block's token groups as one Triton launch (torch).

The torch twin of ``kernels.grouped_projection`` (Pallas, jax), for the same reason (issue 40):
through torch's ops a MoNE block runs one GEMM per token group and projection, zero-pads the
out-projections, then applies the LayerNorms and adds the gate, the residual and fc1's GELU in
passes of their own over the ``(rows, D)`` stream and the ``(rows, 4D)`` hidden activations,
each as large as a dense block's. Torch's packed blocks (``layers.packed_block``) hold a
block's groups as one token-major ``(rows, K)`` tensor, each group a contiguous run of rows, so
one launch covers them all here: a program takes ``block_rows`` rows of one group and
``block_cols`` output columns (MoNE App. A.1 Eq. 5-7; the program: ``kernels.triton_grouped_tile``):

* ``side="in"``: ``out[g] = act(LN(x)[g, :d_g] @ W[:d_g] + b)``, all ``N`` columns (q/k/v,
  fc1); the contraction stops at the group's width ``d_g``; ``activation`` ("gelu",
  "gelu_tanh") is the epilogue, so fc1's output is written once, activated; with ``norm`` the
  block's LayerNorm is the prologue (statistics per row beforehand:
  ``kernels.triton_row_statistics``), so the normalised tokens are never written.
* ``side="out"``: ``out[g, :d_g] = x[g] @ W[:, :d_g] + b[:d_g]``, zeros past ``d_g`` (Eq. 7's
  ``Pad``; the attention's out-projection, fc2); column tiles past ``d_g`` skip the loop.
  Epilogue: ``residual + scale * out`` (the block's residual and MoNE's gate ``alpha g + 1``,
  Eq. 1), so the block's stream is written once per half; with ``statistics=True`` each
  program also writes its rows' partial statistics over its columns
  (``triton_row_statistics.TilePartials``), which the next in-projection's LayerNorm prologue
  combines: the stream is not read again for them.

``x`` may also be ``(tokens, batch, K)`` with strides of its own, token-major row ``n * batch + b``:
the attention's output as torch's memory-efficient CUDA SDPA writes it (what SDPA runs for float32,
where flash attention does not apply), batch-major ``(batch, tokens, heads, head_dim)`` whatever the
query's layout, which made the packed block's token-major reshape a copy of ``(rows, D)`` per block
(0.93 GB per MoNE-ViT-B/16 forward at batch 64 in float32); the kernel reads it in place. Flash
and cuDNN attention follow the query's (token-major) layout: their output is a plain view.

Weights may be float32 under mixed precision: each tile is cast to the rows' dtype as it is
loaded (no cast copy of the weights). Accumulation, bias and epilogue are float32, rounded
once. ``plain_grouped_projection`` is the same computation with torch's ops, one GEMM per
group: the reference the kernel equals, and its backward pass (recomputed from the inputs).
Off CUDA (or ``interpret=True``) the kernel runs through Triton's interpreter: slow, for
tests. Under ``torch.compile`` and with autograd it is the custom op
``keras_mone::grouped_projection`` (``torch.library``), which inductor calls as it stands.
Not timed on a card.
"""

import functools
import os

from keras_mone.kernels import triton_grouped_tile as _tile
from keras_mone.kernels.tiles import shape_tiles
from keras_mone.kernels.triton_grouped_launch import launch as _launch
from keras_mone.kernels.triton_grouped_launch import rows_of as _rows
from keras_mone.kernels.triton_row_statistics import TilePartials, check_partials, combined_statistics
from keras_mone.kernels.triton_row_statistics import plain_tile_partials
from keras_mone.kernels.triton_grouped_tile import ACTIVATIONS, check_tiles, default_tiles

__all__ = ["grouped_projection", "plain_grouped_projection", "available", "shape_fits", "check_tiles",
           "default_tiles", "ACTIVATIONS", "SIDES", "TILES_ENV"]

SIDES = ("in", "out")
TILES_ENV = "KERAS_MONE_PROJECTION_TILES"
"""Tiles per projection shape, as the Pallas kernel reads them (``kernels.grouped_kernel``):
``768x2304=64,128,64,4,3;3072x768=64,64,64,4,3``. ``bench/triton_grouped_tiles.py`` prints a
card's winners in this form."""


def available():
    """Whether Triton is installed (torch's CUDA wheels bring it; the ``test`` extra too)."""
    return _tile.triton is not None


def shape_fits(*dimensions):
    """Whether projections of these ``K`` and ``N`` take the kernel: multiples of 16 (Triton's
    smallest dot; ViT-Ti to ViT-H all are)."""
    return all(d % 16 == 0 for d in dimensions)


def normalized(x, mean, rstd, gamma, beta):
    """``(x - mean) * (rstd * gamma) + beta`` in float32, rounded to ``x``'s dtype (the prologue)."""
    scale = rstd.float()[:, None] * gamma.float()
    return ((x.float() - mean.float()[:, None]) * scale + beta.float()).to(x.dtype)


def plain_grouped_projection(x, w, b, spans, widths, side, activation=None, residual=None, scale=None, norm=None):
    """The grouped nested projection with torch's ops, one GEMM per group.

    Args:
        x: ``(rows, K)`` token rows, each group the rows ``start:stop`` of its span; or
            ``(tokens, batch, K)``, row ``n * batch + b`` (the kernel reads it with its strides:
            the attention's output as torch's memory-efficient CUDA SDPA writes it, batch-major,
            without a copy).
        w, b: the ``(K, N)`` kernel and ``(N,)`` bias (or ``None``), any float dtype: ``w`` cast
            to ``x``'s, as the kernel casts each weight tile; ``b`` added in float32.
        spans: ``((start, stop), ...)`` per group, in order, covering ``x``'s rows.
        widths: each group's nested width ``d``.
        side: ``"in"`` (``d`` cuts ``w``'s rows) or ``"out"`` (its columns).
        activation: side "in": ``None``, ``"gelu"`` or ``"gelu_tanh"`` on the float32 result.
        residual, scale: side "out": ``(rows, N)`` and ``(rows,)``; the result is
            ``residual + scale * projection``. ``scale`` may be a ``(gate, alpha)`` pair, a
            ``(rows,)`` gate and a one-element alpha: the factor is MoNE's ``alpha * gate + 1``
            (Eq. 1) in float32 (the kernel computes it in its epilogue, so no block writes it).
        norm: side "in": ``(mean, rstd, gamma, beta)``, a LayerNorm applied to ``x`` first
            (``normalized``); ``mean``, ``rstd`` ``(rows,)``, ``gamma``, ``beta`` ``(K,)``.

    Returns:
        ``(rows, N)`` in ``x``'s dtype.
    """
    import torch
    from torch.nn import functional

    w = w.to(x.dtype)
    x = x.reshape(-1, x.shape[-1])
    x = x if norm is None else normalized(x, *norm)
    scale, alpha = _gate_pair(scale)
    columns = w.shape[1]
    pieces = []
    for (start, stop), width in zip(spans, widths):
        rows = x[start:stop]
        if side == "in":
            piece = (rows[:, :width] @ w[:width]).float()
            piece = piece if b is None else piece + b.float()
            if activation is not None:
                piece = functional.gelu(piece, approximate="tanh" if activation == "gelu_tanh" else "none")
        else:
            piece = (rows @ w[:, :width]).float()
            piece = piece if b is None else piece + b[:width].float()
            piece = functional.pad(piece, (0, columns - width))
        pieces.append(piece)
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if scale is not None:
        factor = scale.float() if alpha is None else alpha.float().reshape(()) * scale.float() + 1.0
        out = out * factor[:, None]
    if residual is not None:
        out = out + residual.float()
    return out.to(x.dtype)


def _gate_pair(scale):
    """``(scale, alpha)``: a ``(gate, alpha)`` pair apart (a number alpha made a tensor on the
    gate's device), or ``(scale, None)``; a malformed pair raises ``ValueError`` naming ``scale``."""
    import torch

    if not isinstance(scale, (tuple, list)):
        return scale, None
    if len(scale) != 2 or not torch.is_tensor(scale[0]) or scale[1] is None:
        raise ValueError(f"`scale` must be a (rows,) tensor or a (gate, alpha) pair of a (rows,) gate and one "
                         f"alpha; got a {type(scale).__name__} of {len(scale)}.")
    gate, alpha = scale
    return gate, alpha if torch.is_tensor(alpha) else torch.tensor(float(alpha), device=gate.device)


def grouped_projection(x, w, b, spans, widths, side, activation=None, residual=None, scale=None, norm=None,
                       tiles=None, interpret=None, statistics=False):
    """``plain_grouped_projection`` as one Triton launch (see the module docstring).

    Args: those of ``plain_grouped_projection``, and
        norm: also ``(partials, epsilon, gamma, beta)``: the statistics as an out-projection's
            ``TilePartials`` of ``x`` (``statistics=True``) and the LayerNorm's epsilon.
        tiles: ``(block_rows, block_cols, block_k, num_warps, num_stages)``; where ``None``, those
            ``$KERAS_MONE_PROJECTION_TILES`` names for ``(K, N)``, else ``default_tiles``.
        interpret: run through Triton's interpreter; default: unless ``x`` is on CUDA.
        statistics: side "out": return ``(out, TilePartials of out)`` over the kernel's
            ``block_cols``-column tiles, for the next LayerNorm.

    Differentiable (the plain path's gradients, recomputed). Under ``torch.compile`` or with
    autograd recording it runs as a custom op (with autograd, partials by torch's ops), else it
    launches directly (less host time).
    """
    import torch

    scale, alpha = _gate_pair(scale)
    if statistics and side != "out":
        raise ValueError(f"`statistics` belongs to side 'out' (the stream the next LayerNorm reads); got side "
                         f"{side!r}.")
    given = norm is not None and len(norm) == 4 and isinstance(norm[0], TilePartials)
    partials, epsilon = (norm[0], norm[1]) if given else (None, 0.0)
    if partials is not None:
        check_partials(partials, epsilon, _rows(x), x.shape[-1], x.device)
    spans, widths, tiles = _checked(x, w, b, spans, widths, side, activation, residual, scale, alpha, norm, tiles)
    interpret = x.device.type != "cuda" if interpret is None else bool(interpret)
    statistic_pair = tuple(partials) if partials is not None else (norm or (None, None))[:2]
    tensors = (x, w, b, residual, scale, *statistic_pair, *(norm or (None,) * 4)[2:], alpha)
    recording = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    compiling = torch.compiler.is_compiling()
    if not recording and not compiling:
        out = _launch(*tensors, spans, widths, side, activation, tiles, interpret, False, statistics, float(epsilon))
        return (out[0], TilePartials(out[1][0], out[1][1])) if statistics else out
    if partials is not None:  # the prologue's statistics with torch's ops (differentiable; inductor fuses them)
        tensors = (*tensors[:5], *combined_statistics(partials, epsilon, x.shape[-1]), *tensors[7:])
    flat_spans = [bound for span in spans for bound in span]
    # inside torch.compile the layout is compiled into the kernel (CUDA graphs keep no table alive)
    if statistics and not recording:  # torch.compile at inference: the kernel writes the partials
        out, stats = _OP_STATISTICS(*tensors[:5], alpha, flat_spans, list(widths), list(tiles), interpret, compiling)
        return out, TilePartials(stats[0], stats[1])
    out = _OP(*tensors, flat_spans, list(widths), side, activation or "", list(tiles), interpret, compiling)
    return (out, plain_tile_partials(out, w.shape[1] // tiles[1])) if statistics else out


def _checked(x, w, b, spans, widths, side, activation, residual, scale, alpha, norm, tiles):
    """``(spans, widths, tiles)`` as tuples of ints, after checking every argument (of a ``norm``
    with ``TilePartials``, gamma and beta: ``check_partials`` checks the rest)."""
    import torch

    if side not in SIDES:
        raise ValueError(f"`side` must be one of {list(SIDES)}, got {side!r}.")
    if activation not in ACTIVATIONS or (activation is not None and side != "in"):
        raise ValueError(f"`activation` must be one of {list(ACTIVATIONS)} (side 'in' only), got {activation!r} "
                         f"on side {side!r}.")
    if (residual is not None or scale is not None) and side != "out":
        raise ValueError("`residual` and `scale` belong to side 'out' (the block's residual and gate).")
    if norm is not None and (side != "in" or len(norm) != 4 or any(t is None for t in norm)):
        raise ValueError("`norm` is (mean, rstd, gamma, beta) or (TilePartials, epsilon, gamma, beta), none of them "
                         "None, and belongs to side 'in' (the LayerNorm before q/k/v and fc1).")
    names = ("mean", "rstd", "gamma", "beta")
    if norm is not None and isinstance(norm[0], TilePartials):
        names, norm = names[2:], norm[2:]
    bias_fits = b is None or tuple(b.shape) == (w.shape[-1],)
    if x.dim() not in (2, 3) or w.dim() != 2 or w.shape[0] != x.shape[-1] or not bias_fits:
        raise ValueError(f"`x` must be (rows, K) or (tokens, batch, K), `w` (K, N) and `b` (N,) or None; got "
                         f"x {tuple(x.shape)}, w {tuple(w.shape)}, b {None if b is None else tuple(b.shape)}.")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"`x` must be float16, bfloat16 or float32 rows (tensor cores); got {x.dtype}.")
    named = (("w", w), ("b", b), ("residual", residual), ("scale", scale), ("alpha", alpha))
    for name, t in named + tuple(zip(names, norm or ())):
        if t is not None and (not t.is_floating_point() or t.device != x.device):
            raise ValueError(f"`{name}` must be a floating tensor on x's device ({x.device}); "
                             f"got {t.dtype} on {t.device}.")
    rows, contraction, columns = _rows(x), x.shape[-1], w.shape[1]
    cached = not torch.compiler.is_compiling()  # (dynamo traces through lru caches with a warning each)
    spans, widths = _layout(spans, widths, rows, w.shape[0] if side == "in" else w.shape[1], side, cached)
    if alpha is not None and alpha.numel() != 1:
        raise ValueError(f"`scale` as a (gate, alpha) pair takes one alpha, got alpha of shape {tuple(alpha.shape)}.")
    shapes = {"residual": (residual, (rows, columns)), "scale": (scale, (rows,))}
    if norm is not None:
        per_row = ((rows,),) * (len(norm) - 2)
        shapes.update(zip(names, zip(norm, per_row + ((contraction,),) * 2)))
    for name, (t, shape) in shapes.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"`{name}` must have shape {shape}, got {tuple(t.shape)}.")
    tiles_of = _tiles if cached else _tiles.__wrapped__
    return spans, widths, tiles_of(None if tiles is None else tuple(tiles), os.environ.get(TILES_ENV, ""), contraction,
                                   columns)


def _layout(spans, widths, rows, limit, side, cached=True):
    """``(spans, widths)`` as tuples of ints, checked: a layout is checked once (``_checked_layout``;
    the blocks of a forward share theirs), unhashable ones (lists inside) and uncached calls each
    time. (Made ints before the cache, each call took 2-8 us more: ``bench/triton_launch_host.py``.)"""
    spans, widths = tuple(spans), tuple(widths)
    if cached:
        try:
            return _checked_layout(spans, widths, rows, limit, side)
        except TypeError:  # (unhashable entries; a TypeError of the check itself comes again below)
            pass
    return _checked_layout.__wrapped__(spans, widths, rows, limit, side)


@functools.lru_cache(maxsize=1024)
def _checked_layout(spans, widths, rows, limit, side):
    spans = tuple((int(start), int(stop)) for start, stop in spans)
    widths = tuple(int(width) for width in widths)
    ends = [0] + [stop for _, stop in spans]
    covering = all(start == end and stop >= start for (start, stop), end in zip(spans, ends)) and ends[-1] == rows
    if not covering or len(widths) != len(spans) or not spans or not all(0 < d <= limit for d in widths):
        raise ValueError(f"`spans` must be one or more (start, stop) row ranges covering x's {rows} rows "
                         f"in order, and `widths` one width in [1, {limit}] per span (side {side!r}); got spans "
                         f"{spans}, widths {widths}.")
    return spans, widths


@functools.lru_cache(maxsize=256)
def _tiles(tiles, variable_value, contraction, columns):
    """The tiles given (checked), else those ``$KERAS_MONE_PROJECTION_TILES`` (whose value is
    ``variable_value``: a changed variable is read again) names for ``(K, N)``, else the defaults."""
    if tiles is None:
        tiles = shape_tiles(TILES_ENV, contraction, columns, check_tiles) or default_tiles(contraction, columns)
    tiles = tuple(tiles)
    check_tiles(tiles, contraction, columns)
    return tiles


def _define_custom_ops():
    """``keras_mone::grouped_projection``: the kernel as a torch custom op (its shape for
    ``torch.compile``'s fake tensors, its gradients the plain path's); and
    ``keras_mone::grouped_projection_statistics``: an out-projection that also returns its
    ``(2, tiles, rows)`` partials, without gradients (``torch.compile`` at inference). Defined
    once, when the module is imported: dynamo would trace a definition made inside a compiled call."""
    import torch

    Tensor, Optional = torch.Tensor, torch.Tensor | None

    @torch.library.custom_op("keras_mone::grouped_projection", mutates_args=())
    def op(x: Tensor, w: Tensor, b: Optional, residual: Optional, scale: Optional, mean: Optional, rstd: Optional,
           gamma: Optional, beta: Optional, alpha: Optional, spans: list[int], widths: list[int], side: str,
           activation: str, tiles: list[int], interpret: bool, static_table: bool) -> Tensor:
        return _launch(x, w, b, residual, scale, mean, rstd, gamma, beta, alpha, _pairs(spans), tuple(widths), side,
                       activation or None, tuple(tiles), interpret, static_table)

    @op.register_fake
    def _(x, w, *rest):
        return x.new_empty((_rows(x), w.shape[1]))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:10])
        spans, widths, side, activation = inputs[10:14]
        ctx.settings = (_pairs(spans), tuple(widths), side, activation or None)

    def backward(ctx, upstream):
        needs = ctx.needs_input_grad[:10]
        inputs = [t if t is None else t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
        wanted = [t for t, need in zip(inputs, needs) if t is not None and need]
        x, w, b, residual, scale, *norm, alpha = inputs
        with torch.enable_grad():
            output = plain_grouped_projection(x, w, b, *ctx.settings, residual=residual,
                                              scale=scale if alpha is None else (scale, alpha),
                                              norm=None if norm[0] is None else norm)
            grads = iter(torch.autograd.grad(output, wanted, upstream) if wanted else ())
        return (*(next(grads) if t is not None and need else None for t, need in zip(inputs, needs)),) + (None,) * 7

    op.register_autograd(backward, setup_context=setup_context)

    @torch.library.custom_op("keras_mone::grouped_projection_statistics", mutates_args=())
    def statistics_op(x: Tensor, w: Tensor, b: Optional, residual: Optional, scale: Optional, alpha: Optional,
                      spans: list[int], widths: list[int], tiles: list[int], interpret: bool,
                      static_table: bool) -> tuple[Tensor, Tensor]:
        return _launch(x, w, b, residual, scale, None, None, None, None, alpha, _pairs(spans), tuple(widths), "out",
                       None, tuple(tiles), interpret, static_table, True)

    @statistics_op.register_fake
    def _(x, w, *rest):
        tiles = rest[6]
        stats = x.new_empty((2, w.shape[1] // tiles[1], _rows(x)), dtype=torch.float32)
        return x.new_empty((_rows(x), w.shape[1])), stats

    return op, statistics_op


def _pairs(flat):
    return tuple(zip(flat[::2], flat[1::2]))


try:  # the custom op exists where torch and Triton are installed
    import torch as _torch_module  # noqa: F401
except ImportError:  # pragma: no cover - jax or tensorflow alone
    _torch_module = None
_OP, _OP_STATISTICS = _define_custom_ops() if _torch_module is not None and available() else (None, None)
