"""A nested projection over all of a block's token groups as one Triton launch (torch).

The torch twin of ``kernels.grouped_projection`` (Pallas, jax), for the same reason (issue 40):
through torch's ops a MoNE block runs one GEMM per token group and projection, zero-pads the
out-projections, then adds the gate, the residual and fc1's GELU in passes of their own over
the ``(rows, D)`` stream and the ``(rows, 4D)`` hidden activations, each as large as a dense
block's. Torch's packed blocks (``layers.packed_block``) hold a block's groups as one
token-major ``(rows, K)`` tensor, each group a contiguous run of rows, so one launch covers
them all here: a program takes ``block_rows`` rows of one group and ``block_cols`` output
columns (MoNE App. A.1 Eq. 5-7):

* ``side="in"``: ``out[g] = act(x[g, :d_g] @ W[:d_g] + b)``, all ``N`` columns (q/k/v, fc1);
  the contraction stops at the group's width ``d_g``; ``activation`` ("gelu", "gelu_tanh")
  is the epilogue, so fc1's output is written once, activated.
* ``side="out"``: ``out[g, :d_g] = x[g] @ W[:, :d_g] + b[:d_g]``, zeros past ``d_g`` (Eq. 7's
  ``Pad``; the attention's out-projection, fc2); column tiles past ``d_g`` skip the loop.
  Epilogue: ``residual + scale * out`` (the block's residual and MoNE's gate ``alpha g + 1``,
  Eq. 1), so the block's stream is written once per half.

Weights may be float32 under mixed precision: each tile is cast to the rows' dtype as it is
loaded (no cast copy of the weights). Accumulation, bias and epilogue are float32, rounded
once. ``plain_grouped_projection`` is the same computation with torch's ops, one GEMM per
group: the reference the kernel equals, and its backward pass (recomputed from the inputs).
Off CUDA (or ``interpret=True``) the kernel runs through Triton's interpreter: slow, for
tests. Under ``torch.compile`` it is the custom op ``keras_mone::grouped_projection``
(``torch.library``), which inductor calls as it stands. Not timed on a card.
"""

import functools

from keras_mone.kernels.tiles import launchable, shape_tiles

SIDES = ("in", "out")
ACTIVATIONS = (None, "gelu", "gelu_tanh")
MAX_GROUPS = 16
"""The most token groups one launch takes (a branch each in the compiled kernel)."""
TILES_ENV = "KERAS_MONE_PROJECTION_TILES"
"""Tiles per projection shape, as the Pallas kernel reads them (``kernels.grouped_kernel``):
``768x2304=64,128,64,4,3;3072x768=64,64,64,4,3``. ``bench/triton_grouped_tiles.py`` prints a
card's winners in this form."""


def available():
    """Whether Triton is installed (torch's CUDA wheels bring it; the ``test`` extra too)."""
    return triton is not None


def shape_fits(*dimensions):
    """Whether projections of these ``K`` and ``N`` take the kernel: multiples of 16 (Triton's
    smallest dot; ViT-Ti to ViT-H all are)."""
    return all(d % 16 == 0 for d in dimensions)


def default_tiles(contraction, columns, itemsize):
    """``(block_rows, block_cols, block_k, num_warps, num_stages)`` for a ``(K, N)`` projection:
    those of the Pallas kernel (``kernels.grouped_kernel.default_tiles``: 128 rows on 8 warps,
    the widest power of 2 up to 128 dividing ``N``, up to 64 (16-bit) or 32 (float32)
    contraction elements per step, 3 stages). Not screened on a card."""
    return (128, _power_of_2_dividing(columns, 128), _power_of_2_dividing(contraction, 64 if itemsize <= 2 else 32),
            8, 3)


def _power_of_2_dividing(n, at_most):
    power = at_most
    while power > 16 and n % power:
        power //= 2
    return power


def check_tiles(tiles, contraction, columns):
    """Raises ``ValueError`` naming what is wrong with ``tiles`` for a ``(K, N)`` projection."""
    if not launchable(tuple(tiles), blocks=3):
        raise ValueError(f"`tiles` must be (block_rows, block_cols, block_k, num_warps, num_stages): four powers "
                         f"of 2, blocks of at least 16 (Triton's dot), and a positive stage count; got {tiles!r}.")
    if columns % tiles[1] or contraction % tiles[2]:
        raise ValueError(f"`tiles`' block_cols ({tiles[1]}) must divide N = {columns} and block_k ({tiles[2]}) "
                         f"divide K = {contraction}.")


def plain_grouped_projection(x, w, b, spans, widths, side, activation=None, residual=None, scale=None):
    """The grouped nested projection with torch's ops, one GEMM per group.

    Args:
        x: ``(rows, K)`` token rows, each group the rows ``start:stop`` of its span.
        w, b: the ``(K, N)`` kernel and ``(N,)`` bias (or ``None``), any float dtype: cast to
            ``x``'s, as the kernel casts each weight tile.
        spans: ``((start, stop), ...)`` per group, in order, covering ``x``'s rows.
        widths: each group's nested width ``d``.
        side: ``"in"`` (``d`` cuts ``w``'s rows) or ``"out"`` (its columns).
        activation: side "in": ``None``, ``"gelu"`` or ``"gelu_tanh"`` on the float32 result.
        residual, scale: side "out": ``(rows, N)`` and ``(rows,)``; the result is
            ``residual + scale * projection``.

    Returns:
        ``(rows, N)`` in ``x``'s dtype.
    """
    import torch
    from torch.nn import functional

    w = w.to(x.dtype)
    columns = w.shape[1]
    pieces = []
    for (start, stop), width in zip(spans, widths):
        rows = x[start:stop]
        if side == "in":
            piece = rows[:, :width] @ w[:width]
            piece = piece.float() if b is None else piece.float() + b.float()
            if activation is not None:
                piece = functional.gelu(piece, approximate="tanh" if activation == "gelu_tanh" else "none")
        else:
            piece = (rows @ w[:, :width]).float()
            piece = piece if b is None else piece + b[:width].float()
            piece = functional.pad(piece, (0, columns - width))
        pieces.append(piece)
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if scale is not None:
        out = out * scale.float()[:, None]
    if residual is not None:
        out = out + residual.float()
    return out.to(x.dtype)


def grouped_projection(x, w, b, spans, widths, side, activation=None, residual=None, scale=None, tiles=None,
                       interpret=None):
    """``plain_grouped_projection`` as one Triton launch (see the module docstring).

    Args: those of ``plain_grouped_projection``, and
        tiles: ``(block_rows, block_cols, block_k, num_warps, num_stages)``; where ``None``, those
            ``$KERAS_MONE_PROJECTION_TILES`` names for ``(K, N)``, else ``default_tiles``.
        interpret: run through Triton's interpreter; default: unless ``x`` is on CUDA.

    Differentiable (the plain path's gradients, recomputed); under ``torch.compile``, under
    forward-mode AD or with autograd recording it runs as the custom op, else it launches
    directly (less host time).
    """
    import torch

    spans, widths, tiles = _checked(x, w, b, spans, widths, side, activation, residual, scale, tiles)
    interpret = x.device.type != "cuda" if interpret is None else bool(interpret)
    tensors = (x, w, b, residual, scale)
    recording = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if not recording and not torch.compiler.is_compiling():
        return _launch(x, w, b, residual, scale, spans, widths, side, activation, tiles, interpret)
    flat_spans = [bound for span in spans for bound in span]
    return _OP(x, w, b, residual, scale, flat_spans, list(widths), side, activation or "", list(tiles),
                        interpret)


def _checked(x, w, b, spans, widths, side, activation, residual, scale, tiles):
    """``(spans, widths, tiles)`` as tuples of ints, after checking every argument."""
    import torch

    if side not in SIDES:
        raise ValueError(f"`side` must be one of {list(SIDES)}, got {side!r}.")
    if activation not in ACTIVATIONS or (activation is not None and side != "in"):
        raise ValueError(f"`activation` must be one of {list(ACTIVATIONS)} (side 'in' only), got {activation!r} "
                         f"on side {side!r}.")
    if (residual is not None or scale is not None) and side != "out":
        raise ValueError("`residual` and `scale` belong to side 'out' (the block's residual and gate).")
    if x.dim() != 2 or w.dim() != 2 or w.shape[0] != x.shape[1] or (b is not None and tuple(b.shape) != (w.shape[1],)):
        raise ValueError(f"`x` must be (rows, K), `w` (K, N) and `b` (N,) or None; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, b {None if b is None else tuple(b.shape)}.")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"`x` must be float16, bfloat16 or float32 rows (tensor cores); got {x.dtype}.")
    for name, t in (("w", w), ("b", b), ("residual", residual), ("scale", scale)):
        if t is not None and (not t.is_floating_point() or t.device != x.device):
            raise ValueError(f"`{name}` must be a floating tensor on x's device ({x.device}); "
                             f"got {t.dtype} on {t.device}.")
    spans = tuple((int(start), int(stop)) for start, stop in spans)
    widths = tuple(int(width) for width in widths)
    limit = w.shape[0] if side == "in" else w.shape[1]
    ends = [0] + [stop for _, stop in spans]
    covering = all(start == end and stop >= start for (start, stop), end in zip(spans, ends)) and ends[-1] == x.shape[0]
    if not covering or len(widths) != len(spans) or not 0 < len(spans) <= MAX_GROUPS or not all(
            0 < d <= limit for d in widths):
        raise ValueError(f"`spans` must be 1 to {MAX_GROUPS} (start, stop) row ranges covering x's {x.shape[0]} rows "
                         f"in order, and `widths` one width in [1, {limit}] per span (side {side!r}); got spans "
                         f"{spans}, widths {widths}.")
    rows, columns = x.shape[0], w.shape[1]
    if residual is not None and tuple(residual.shape) != (rows, columns):
        raise ValueError(f"`residual` must be (rows, N) = {(rows, columns)}, got {tuple(residual.shape)}.")
    if scale is not None and tuple(scale.shape) != (rows,):
        raise ValueError(f"`scale` must be (rows,) = {(rows,)}, got {tuple(scale.shape)}.")
    if tiles is None:
        tiles = (shape_tiles(TILES_ENV, x.shape[1], columns, check_tiles)
                 or default_tiles(x.shape[1], columns, x.element_size()))
    tiles = tuple(tiles)
    check_tiles(tiles, x.shape[1], columns)
    return spans, widths, tiles


def _launch(x, w, b, residual, scale, spans, widths, side, activation, tiles, interpret):
    """The kernel launch on checked arguments: ``(rows, N)`` in ``x``'s dtype."""
    import torch

    x, w = x.contiguous(), w.contiguous()
    rows, columns = x.shape[0], w.shape[1]
    out = x.new_empty((rows, columns))
    block_rows, block_cols, block_k, num_warps, num_stages = tiles
    table, first = [], 0  # non-empty groups: (first row tile, first row, rows, width)
    for (start, stop), width in zip(spans, widths):
        if stop > start:
            table.append((first, start, stop - start, width))
            first += -(-(stop - start) // block_rows)
    if not table:
        return out
    residual = None if residual is None else residual.contiguous()
    exact = x.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    options = {} if interpret else {"num_warps": num_warps, "num_stages": num_stages}
    firsts, starts, sizes, group_widths = (tuple(column) for column in zip(*table))
    _kernel(interpret)[(columns // block_cols, first)](
        x, w, out if b is None else b, out if residual is None else residual, out if scale is None else scale, out,
        x.stride(0), w.stride(0), columns,
        FIRSTS=firsts, STARTS=starts, SIZES=sizes, WIDTHS=group_widths, GROUPS=len(table), K=x.shape[1], N=columns,
        SIDE_IN=side == "in", ACTIVATION=ACTIVATIONS.index(activation), HAS_BIAS=b is not None,
        HAS_RESIDUAL=residual is not None, HAS_SCALE=scale is not None, BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols, BLOCK_K=block_k, PRECISION="ieee" if exact else "tf32", UPCAST=interpret, **options,
    )
    return out


def _define_custom_op():
    """``keras_mone::grouped_projection``: the kernel as a torch custom op (its shape for
    ``torch.compile``'s fake tensors, its gradients the plain path's). Defined once, when the
    module is imported (``_OP``): dynamo would trace a definition made inside a compiled call."""
    import torch

    @torch.library.custom_op("keras_mone::grouped_projection", mutates_args=())
    def op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor | None,
           scale: torch.Tensor | None, spans: list[int], widths: list[int], side: str, activation: str,
           tiles: list[int], interpret: bool) -> torch.Tensor:
        return _launch(x, w, b, residual, scale, _pairs(spans), tuple(widths), side, activation or None,
                       tuple(tiles), interpret)

    @op.register_fake
    def _(x, w, b, residual, scale, spans, widths, side, activation, tiles, interpret):
        return x.new_empty((x.shape[0], w.shape[1]))

    def setup_context(ctx, inputs, output):
        x, w, b, residual, scale, spans, widths, side, activation, *_ = inputs
        ctx.save_for_backward(x, w, b, residual, scale)
        ctx.settings = (_pairs(spans), tuple(widths), side, activation or None)

    def backward(ctx, upstream):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[:5]
        inputs = [t if t is None else t.detach().requires_grad_(need) for t, need in zip(saved, needs)]
        wanted = [t for t, need in zip(inputs, needs) if t is not None and need]
        with torch.enable_grad():
            output = plain_grouped_projection(*inputs[:3], *ctx.settings, residual=inputs[3], scale=inputs[4])
            grads = iter(torch.autograd.grad(output, wanted, upstream) if wanted else ())
        return (*(next(grads) if t is not None and need else None for t, need in zip(inputs, needs)),
                None, None, None, None, None, None)

    op.register_autograd(backward, setup_context=setup_context)
    return op


def compile_for_cuda(contraction, columns, groups, side, dtype="bf16", tiles=None, activation=None,
                     residual=False, scale=False, capability=90, weight_dtype="fp32"):
    """The kernel for a ``(K, N)`` projection of ``groups`` (``((rows, width), ...)``) compiled by
    Triton for a CUDA card of compute ``capability`` (90: H100/H200), without one: Triton's
    ``CompiledKernel`` (``.asm["ptx"]``, ``.metadata.shared``; ``bench/kernel_compile.py`` reads
    registers and spills from it). ``dtype``: Triton's name of the rows' ("bf16", "fp16",
    "fp32"); the weights are float32 (mixed precision's variables)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tiles = tuple(tiles or default_tiles(contraction, columns, 4 if dtype == "fp32" else 2))
    check_tiles(tiles, contraction, columns)
    table, first, start = [], 0, 0
    for rows, width in groups:
        table.append((first, start, rows, width))
        first, start = first + -(-rows // tiles[0]), start + rows
    firsts, starts, sizes, widths = (tuple(column) for column in zip(*table))
    constants = dict(FIRSTS=firsts, STARTS=starts, SIZES=sizes, WIDTHS=widths, GROUPS=len(table), K=contraction, N=columns,
                     SIDE_IN=side == "in", ACTIVATION=ACTIVATIONS.index(activation), HAS_BIAS=True,
                     HAS_RESIDUAL=bool(residual), HAS_SCALE=bool(scale), BLOCK_ROWS=tiles[0], BLOCK_COLS=tiles[1],
                     BLOCK_K=tiles[2], PRECISION="tf32", UPCAST=False)
    function = _kernel(False)
    signature = {"x_ptr": f"*{dtype}", "w_ptr": f"*{weight_dtype}", "b_ptr": f"*{weight_dtype}", "residual_ptr": f"*{dtype}",
                 "scale_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
    signature.update({name: "i32" for name in ("x_stride", "w_stride", "out_stride")})
    signature.update({name: "constexpr" for name in constants})
    source = ASTSource(function, signature, constexprs={(function.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": tiles[3], "num_stages": tiles[4]})


def _pairs(flat):
    return tuple(zip(flat[::2], flat[1::2]))


@functools.cache
def _kernel(interpret):
    """The Triton kernel, compiled (``triton.jit``) or for Triton's interpreter."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_grouped_tile)
    return triton.jit(_grouped_tile)


try:  # the kernel is defined where Triton is installed (``available``)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the plain path runs
    triton = tl = None

try:  # the custom op exists where torch and Triton are installed
    import torch as _torch_module  # noqa: F401
except ImportError:  # pragma: no cover - jax or tensorflow alone
    _torch_module = None
_OP = _define_custom_op() if _torch_module is not None and triton is not None else None

if tl is not None:

    def _grouped_tile(x_ptr, w_ptr, b_ptr, residual_ptr, scale_ptr, out_ptr, x_stride, w_stride, out_stride,
                      FIRSTS: tl.constexpr, STARTS: tl.constexpr, SIZES: tl.constexpr, WIDTHS: tl.constexpr,
                      GROUPS: tl.constexpr, K: tl.constexpr, N: tl.constexpr, SIDE_IN: tl.constexpr, ACTIVATION: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
                      BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """One program: ``BLOCK_ROWS`` rows of one group by ``BLOCK_COLS`` output columns. Each
        group is a branch of its own, with its rows, width and contraction length known when
        the kernel compiles (``FIRSTS`` etc.: the static group table); a program runs the one
        its row tile lies in. Builtins only (as ``triton_nested_mlp``: Triton's ``@jit``
        helpers do not run under an interpreter chosen after Triton was imported); ``UPCAST``
        (the interpreter): 16-bit operands go to ``tl.dot`` as float32, exact products as on
        tensor cores."""
        column_tile, row_tile = tl.program_id(0), tl.program_id(1)
        first_column = column_tile * BLOCK_COLS
        columns = first_column + tl.arange(0, BLOCK_COLS)
        dot_type = tl.float32 if UPCAST else x_ptr.dtype.element_ty
        for group in tl.static_range(GROUPS):
            start, size, width = STARTS[group], SIZES[group], WIDTHS[group]
            tiles_here = (size + BLOCK_ROWS - 1) // BLOCK_ROWS
            if (row_tile >= FIRSTS[group]) & (row_tile < FIRSTS[group] + tiles_here):
                first_row = start + (row_tile - FIRSTS[group]) * BLOCK_ROWS
                # block pointers whose shapes end at the group's last row and its width: the
                # loads give zeros past them (x's features past d_g, an in-projection; W's
                # columns past d_g, an out-projection: Pad's zeros), no per-element masks
                if SIDE_IN:
                    x_shape, w_shape, steps = (start + size, width), (width, N), (width + BLOCK_K - 1) // BLOCK_K
                else:
                    x_shape, w_shape, steps = (start + size, K), (K, width), K // BLOCK_K
                tiles = tl.make_block_ptr(x_ptr, x_shape, (x_stride, 1), (first_row, 0), (BLOCK_ROWS, BLOCK_K), (1, 0))
                weights = tl.make_block_ptr(w_ptr, w_shape, (w_stride, 1), (0, first_column), (BLOCK_K, BLOCK_COLS),
                                            (1, 0))
                accumulator = tl.full((BLOCK_ROWS, BLOCK_COLS), 0.0, tl.float32)
                if SIDE_IN or first_column < width:  # an out-projection's column tiles past d_g: zeros
                    for _ in range(0, steps):
                        tile = tl.load(tiles, boundary_check=(0, 1), padding_option="zero")
                        panel = tl.load(weights, boundary_check=(0, 1), padding_option="zero")
                        accumulator = tl.dot(tile.to(dot_type), panel.to(x_ptr.dtype.element_ty).to(dot_type),
                                             accumulator, input_precision=PRECISION)
                        tiles = tl.advance(tiles, (0, BLOCK_K))
                        weights = tl.advance(weights, (BLOCK_K, 0))
                if HAS_BIAS:
                    bias_width = N if SIDE_IN else width
                    accumulator += tl.load(b_ptr + columns, mask=columns < bias_width, other=0.0).to(tl.float32)[None, :]
                if ACTIVATION == 1:  # the exact (erf) GELU
                    accumulator = 0.5 * accumulator * (1.0 + tl.math.erf(accumulator * 0.7071067811865476))
                if ACTIVATION == 2:  # the tanh GELU: 0.5 x (1 + tanh(u)) = x sigmoid(2u)
                    cubic = accumulator + 0.044715 * accumulator * accumulator * accumulator
                    accumulator = accumulator / (1.0 + tl.exp(-1.5957691216057308 * cubic))
                if HAS_SCALE:  # the gate, then the residual (out-projections)
                    rows = first_row + tl.arange(0, BLOCK_ROWS)
                    gate = tl.load(scale_ptr + rows, mask=rows < start + size, other=0.0)
                    accumulator *= gate.to(tl.float32)[:, None]
                out_shape = (start + size, N)
                if HAS_RESIDUAL:
                    residual = tl.make_block_ptr(residual_ptr, out_shape, (out_stride, 1), (first_row, first_column),
                                                 (BLOCK_ROWS, BLOCK_COLS), (1, 0))
                    accumulator += tl.load(residual, boundary_check=(0,), padding_option="zero").to(tl.float32)
                out = tl.make_block_ptr(out_ptr, out_shape, (out_stride, 1), (first_row, first_column),
                                        (BLOCK_ROWS, BLOCK_COLS), (1, 0))
                tl.store(out, accumulator.to(out_ptr.dtype.element_ty), boundary_check=(0,))
