"""A nested MLP in one Triton kernel for torch: the hidden activations never leave the chip.

The torch twin of ``fused_nested_mlp`` (Pallas, jax), for the same reason (issue 40): a
MoNE token group of width ``d`` runs ``gelu(x[:, :d] @ W1[:d] + b1) @ W2[:, :d] + b2[:d]``
(MoNE App. A.1 Eq. 6), and only the GEMMs shrink with ``d``. Through torch's ops the
``(rows, 4D)`` hidden activations go to device memory and back three times (fc1 writes
them, the GELU reads and writes them, fc2 reads them), as much traffic as the dense MLP.

Here each program takes ``block_rows`` rows and loops over the hidden width in
``block_hidden`` columns: fc1's block with its bias (accumulated in float32), the GELU,
then that block's product with fc2's rows, added into float32 accumulators of the
``(block_rows, d)`` output. The row tile ``x[:, :d]`` is loaded once. ``d`` is cut into
one to four power-of-2 chunks (``d = 96``: three of 32), as ``tl.dot`` needs; a width that
does not cut so (``kernel_fits``) keeps the plain path. Raw Triton, unlike Pallas' Triton
lowering, lets the compiler pipeline the weight loads of the hidden loop (``num_stages``).

``nested_mlp`` is differentiable: its backward pass recomputes ``plain_nested_mlp`` from the
saved inputs, so training keeps no hidden activations between the passes (with
``create_graph=True`` the recomputation is differentiable: second derivatives are torch's
path's); forward-mode AD takes torch's ops. Off CUDA (or with ``interpret=True``) the
kernel runs through Triton's interpreter: slow, for tests, float32 to float32 rounding (its
casts to 16-bit types truncate where a card rounds).
Without Triton installed (``available``) the plain path is all there is.

On an H200 (2026-11-28, bf16, MoNE-ViT-B/16's groups at batch 256) it was slower than torch's
ops at every width and tile: 0.237 against 0.218 ms at d = 96, its best (BENCHMARKS.md, "MoNE
on an H200, measured again"). Its defaults are that sweep's fastest tiles (``tiles.CARD_TILES``).
"""

import functools

from keras_mone.kernels import triton_build
from keras_mone.kernels.tiles import MIN_CHUNK, feature_chunk, resolved_tiles

MAX_CHUNKS = 4
"""The most power-of-2 chunks a width is cut into (one accumulator each)."""


def available():
    """Whether Triton is installed (torch's CUDA wheels bring it; the ``test`` extra too)."""
    return triton is not None


def _dtypes():
    import torch

    return (torch.float16, torch.bfloat16, torch.float32)


def takes_dtype(dtype):
    """Whether the kernel takes rows of ``dtype`` (a ``torch.dtype``): float16, bfloat16, float32."""
    return dtype in _dtypes()


def kernel_fits(width, hidden):
    """Whether the kernel takes a group of ``width`` in an MLP ``hidden`` wide: ``width`` cut into
    at most ``MAX_CHUNKS`` power-of-2 chunks of at least ``MIN_CHUNK`` (ViT widths: 3 x 2^k), and
    a power-of-2 hidden block of at least ``MIN_CHUNK``."""
    chunk = feature_chunk(width)
    return chunk >= MIN_CHUNK and width // chunk <= MAX_CHUNKS and feature_chunk(hidden) >= MIN_CHUNK


def plain_nested_mlp(x, w1, b1, w2, b2, width, approximate=False, out=None):
    """``gelu(x[:, :d] @ W1[:d] + b1) @ W2[:, :d] + b2[:d]`` with torch's ops (``d = width``):
    the reference the kernel equals, and its backward pass. ``b1``, ``b2`` may be ``None``;
    ``out``: where fc2 writes (no autograd)."""
    import torch
    from torch.nn import functional

    hidden = x[:, :width] @ w1[:width] if b1 is None else torch.addmm(b1, x[:, :width], w1[:width])
    hidden = functional.gelu(hidden, approximate="tanh" if approximate else "none")
    if b2 is None:
        return torch.mm(hidden, w2[:, :width], out=out)
    return torch.addmm(b2[:width], hidden, w2[:, :width], out=out)


def grouped_nested_mlp(x, spans, widths, tiles, w1, b1, w2, b2, approximate=False, in_place=False):
    """Token groups, each the rows ``x[start:stop]`` of a span, through their nested MLPs at
    ``widths``: through the kernel where ``tiles`` holds a group's settings (a dict for
    ``nested_mlp``), else through torch's ops. Returns ``(rows, D)``, each group's output
    zero-padded to ``D``: with ``in_place`` (no autograd) every group writes its ``d`` columns
    of one zeroed buffer, else the groups are padded and stacked."""
    import torch

    dim = w2.shape[1]
    outputs = x.new_zeros((x.shape[0], dim)) if in_place else None
    parts = []
    for (start, stop), width, tile in zip(spans, widths, tiles):
        target = outputs[start:stop, :width] if in_place else None
        if tile is not None:
            result = nested_mlp(x[start:stop], w1, b1, w2, b2, width, approximate, out=target, **tile)
        else:
            result = plain_nested_mlp(x[start:stop], w1, b1, w2, b2, width, approximate, out=target)
        parts.append(None if in_place else torch.nn.functional.pad(result, (0, dim - width)))
    return outputs if in_place else torch.cat(parts)


def nested_mlp(x, w1, b1, w2, b2, width, approximate=False, out=None, block_rows=None, block_hidden=None,
               num_warps=None, num_stages=None, interpret=None):
    """``plain_nested_mlp`` as one Triton kernel (see the module docstring).

    Args:
        x: ``(rows, D)`` (or ``(rows, d)``) token rows; columns past ``width`` are not read.
        w1, b1: fc1's ``(D, H)`` kernel and ``(H,)`` bias (or ``None``).
        w2, b2: fc2's ``(H, D)`` kernel and ``(D,)`` bias (or ``None``).
        width: the group's nested width ``d``.
        approximate: the tanh GELU (else the exact, erf one).
        out: a ``(rows, d)`` tensor to write into (e.g. the first ``d`` columns of a zeroed
            ``(rows, D)`` buffer: no padding copy); only without autograd.
        block_rows, block_hidden, num_warps, num_stages: tile sizes (powers of 2) and Triton's
            launch settings; ``tiles.default_tiles(..., kernel="triton")`` where ``None``.
        interpret: run through Triton's interpreter; default: unless ``x`` is on CUDA.

    Returns:
        ``(rows, width)`` in ``x``'s dtype (``out`` when given).
    """
    import torch

    tiles = _checked(x, w1, b1, w2, b2, width, out, block_rows, block_hidden, num_warps, num_stages)
    interpret = x.device.type != "cuda" if interpret is None else bool(interpret)
    tensors = (x, w1, b1, w2, b2)
    if _has_tangents(tensors):  # forward-mode AD: torch's ops carry the tangents
        result = plain_nested_mlp(*tensors, width, approximate)
        return result if out is None else out.copy_(result)
    recording = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if not recording:
        return _launch(x, w1, b1, w2, b2, width, approximate, out, tiles, interpret)
    if out is not None:
        raise ValueError("`out` takes no gradient: call `nested_mlp` under `torch.no_grad()` to write into it.")
    return _function().apply(x, w1, b1, w2, b2, width, approximate, tiles, interpret)


def _has_tangents(tensors):
    """Whether any of ``tensors`` is a dual tensor of forward-mode AD (``torch.autograd.forward_ad``)."""
    from torch.autograd import forward_ad

    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _checked(x, w1, b1, w2, b2, width, out, block_rows, block_hidden, num_warps, num_stages):
    """``(block_rows, block_hidden, num_warps, num_stages)`` after checking every argument."""
    full, hidden = w1.shape
    if x.dim() != 2 or not 0 < width <= min(x.shape[1], full) or tuple(w2.shape) != (hidden, full):
        raise ValueError(f"`width` must lie in [1, {min(x.shape[1], full)}] with x (rows, D), w1 (D, H) and "
                         f"w2 (H, D); got width={width}, x {tuple(x.shape)}, w1 {tuple(w1.shape)}, "
                         f"w2 {tuple(w2.shape)}.")
    if not kernel_fits(width, hidden):
        raise ValueError(f"`width`={width} with hidden width {hidden} does not fit the kernel: `width` must be at "
                         f"most {MAX_CHUNKS} power-of-2 chunks of at least {MIN_CHUNK} (kernel_fits).")
    tensors = {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2}
    if x.dtype not in _dtypes():
        raise ValueError(f"The kernel takes float16, bfloat16 or float32 rows (tensor cores); got {x.dtype}.")
    if len({t.dtype for t in tensors.values() if t is not None}) != 1:
        raise ValueError("The rows, kernels and biases must share a dtype; got "
                         + ", ".join(f"{k} {t.dtype}" for k, t in tensors.items() if t is not None) + ".")
    if len({t.device for t in tensors.values() if t is not None}) != 1:
        raise ValueError("The rows, kernels and biases must be on one device.")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.stride(-1) != 1:
            raise ValueError(f"`{name}` must be contiguous in its last dimension (stride 1); "
                             f"got strides {tensor.stride()}.")
    if out is not None and (tuple(out.shape) != (x.shape[0], width) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"`out` must be a ({x.shape[0]}, {width}) {x.dtype} tensor with unit column stride; "
                         f"got {tuple(out.shape)} {out.dtype}, strides {out.stride()}.")
    return resolved_tiles(width, hidden, x.element_size(), block_rows, block_hidden, num_warps, num_stages,
                          kernel="triton")


def _launch(x, w1, b1, w2, b2, width, approximate, out, tiles, interpret):
    rows, hidden = x.shape[0], w1.shape[1]
    out = x.new_empty((rows, width)) if out is None else out
    if rows == 0:
        return out
    block_rows, block_hidden, num_warps, num_stages = tiles
    chunk = feature_chunk(width)
    # float32 at torch's "highest" matmul precision: no TF32 (the argument is ignored for 16-bit rows)
    exact = triton_build.exact_float32(x.dtype)
    kernel = _kernel(interpret)
    options = {} if interpret else {"num_warps": num_warps, "num_stages": num_stages}
    kernel[(triton.cdiv(rows, block_rows),)](
        x, w1, w2 if b1 is None else b1, w2, w2 if b2 is None else b2, out, rows,
        x.stride(0), w1.stride(0), w2.stride(0), out.stride(0),
        HIDDEN=hidden, BLOCK_ROWS=block_rows, BLOCK_HIDDEN=block_hidden, CHUNK=chunk, CHUNKS=width // chunk,
        HAS_B1=b1 is not None, HAS_B2=b2 is not None, APPROXIMATE=bool(approximate),
        PRECISION="ieee" if exact else "tf32", UPCAST=interpret, **options,
    )
    return out


@functools.cache
def _function():
    """The ``torch.autograd.Function``: the kernel forward, the plain path's gradients backward."""
    import torch

    class NestedMLP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w1, b1, w2, b2, width, approximate, tiles, interpret):
            ctx.save_for_backward(x, w1, b1, w2, b2)
            ctx.settings = (width, approximate)
            return _launch(x, w1, b1, w2, b2, width, approximate, None, tiles, interpret)

        @staticmethod
        def backward(ctx, upstream):
            # create_graph=True runs this with grad mode on: the gradients are differentiable too
            higher = torch.is_grad_enabled()
            needs = ctx.needs_input_grad[:5]
            saved = [t if higher or t is None else t.detach().requires_grad_(need)
                     for t, need in zip(ctx.saved_tensors, needs)]
            wanted = [t for t, need in zip(saved, needs) if t is not None and need]
            with torch.enable_grad():
                output = plain_nested_mlp(*saved, *ctx.settings)
                grads = iter(torch.autograd.grad(output, wanted, upstream, create_graph=higher))
            return (*(next(grads) if t is not None and need else None for t, need in zip(saved, needs)),
                    None, None, None, None)

    return NestedMLP


def compile_for_cuda(width, hidden, dtype="bf16", block_rows=None, block_hidden=None, num_warps=None,
                     num_stages=None, capability=90, approximate=False):
    """The kernel for a group of ``width`` compiled by Triton for a CUDA card of compute
    ``capability`` (90: H100/H200), without one: Triton's ``CompiledKernel`` (``.asm["ptx"]``,
    ``.metadata.shared``). ``dtype``: Triton's name ("bf16", "fp16", "fp32")."""
    itemsize = 4 if dtype == "fp32" else 2
    block_rows, block_hidden, num_warps, num_stages = resolved_tiles(
        width, hidden, itemsize, block_rows, block_hidden, num_warps, num_stages, kernel="triton")
    chunk = feature_chunk(width)
    constants = dict(HIDDEN=hidden, BLOCK_ROWS=block_rows, BLOCK_HIDDEN=block_hidden,
                     CHUNK=chunk, CHUNKS=width // chunk, HAS_B1=True, HAS_B2=True, APPROXIMATE=approximate,
                     PRECISION="tf32", UPCAST=False)
    signature = {name: f"*{dtype}" for name in ("x_ptr", "w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr", "out_ptr")}
    signature.update({name: "i32" for name in ("rows", "x_stride", "w1_stride", "w2_stride", "out_stride")})
    return triton_build.compile_for_cuda(_nested_mlp_tile, signature, constants,
                                         {"num_warps": num_warps, "num_stages": num_stages}, capability)


def _kernel(interpret):
    """The Triton kernel, compiled (``triton.jit``) or for Triton's interpreter."""
    return triton_build.jitted(_nested_mlp_tile, interpret)


try:  # the kernel is defined where Triton is installed (``available``)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the plain path runs
    triton = tl = None

if tl is not None:

    def _nested_mlp_tile(x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr, rows,
                         x_stride, w1_stride, w2_stride, out_stride,
                         HIDDEN: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HIDDEN: tl.constexpr,
                         CHUNK: tl.constexpr,
                         CHUNKS: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr,
                         APPROXIMATE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """One tile of ``BLOCK_ROWS`` rows: fc1 block, GELU, fc2 block, over the hidden width.
        Builtins only (``tl.full``, not ``tl.zeros``; no ``tl.sigmoid``): Triton's own ``@jit``
        helpers do not run under an interpreter chosen after Triton was imported. ``UPCAST``
        (the interpreter): 16-bit operands go to ``tl.dot`` as float32, whose products of
        bf16 values are exact, as on tensor cores (Triton 3.5's interpreter misreads bf16 there)."""
        # 64-bit row offsets: rows x stride passes 2^31 elements from about 2.8 M rows at D = 768
        row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = (row < rows)[:, None]
        feature = tl.arange(0, CHUNK)
        column = tl.arange(0, BLOCK_HIDDEN)
        x_tile = x_ptr + row[:, None] * x_stride + feature[None, :]
        # the row tile's chunks, loaded once; chunks past CHUNKS are never used (constexpr branches)
        dot_type = tl.float32 if UPCAST else x_ptr.dtype.element_ty
        x0 = tl.load(x_tile, mask=live, other=0.0).to(dot_type)
        x1, x2, x3 = x0, x0, x0
        if CHUNKS > 1:
            x1 = tl.load(x_tile + CHUNK, mask=live, other=0.0).to(dot_type)
        if CHUNKS > 2:
            x2 = tl.load(x_tile + 2 * CHUNK, mask=live, other=0.0).to(dot_type)
        if CHUNKS > 3:
            x3 = tl.load(x_tile + 3 * CHUNK, mask=live, other=0.0).to(dot_type)
        acc0 = tl.full((BLOCK_ROWS, CHUNK), 0.0, tl.float32)
        acc1, acc2, acc3 = acc0, acc0, acc0
        for start in range(0, HIDDEN, BLOCK_HIDDEN):
            columns = start + column
            pre = tl.full((BLOCK_ROWS, BLOCK_HIDDEN), 0.0, tl.float32)
            if HAS_B1:
                pre += tl.load(b1_ptr + columns).to(tl.float32)[None, :]
            w1_block = w1_ptr + feature[:, None] * w1_stride + columns[None, :]
            pre = tl.dot(x0, tl.load(w1_block).to(dot_type), pre, input_precision=PRECISION)
            if CHUNKS > 1:
                pre = tl.dot(x1, tl.load(w1_block + CHUNK * w1_stride).to(dot_type), pre, input_precision=PRECISION)
            if CHUNKS > 2:
                pre = tl.dot(x2, tl.load(w1_block + 2 * CHUNK * w1_stride).to(dot_type), pre, input_precision=PRECISION)
            if CHUNKS > 3:
                pre = tl.dot(x3, tl.load(w1_block + 3 * CHUNK * w1_stride).to(dot_type), pre, input_precision=PRECISION)
            if APPROXIMATE:  # 0.5 x (1 + tanh(u)) = x sigmoid(2u)
                activated = pre / (1.0 + tl.exp(-1.5957691216057308 * (pre + 0.044715 * pre * pre * pre)))
            else:
                activated = 0.5 * pre * (1.0 + tl.math.erf(pre * 0.7071067811865476))
            activated = activated.to(x_ptr.dtype.element_ty).to(dot_type)  # rounded as torch's path rounds
            w2_block = w2_ptr + columns[:, None] * w2_stride + feature[None, :]
            acc0 = tl.dot(activated, tl.load(w2_block).to(dot_type), acc0, input_precision=PRECISION)
            if CHUNKS > 1:
                acc1 = tl.dot(activated, tl.load(w2_block + CHUNK).to(dot_type), acc1, input_precision=PRECISION)
            if CHUNKS > 2:
                acc2 = tl.dot(activated, tl.load(w2_block + 2 * CHUNK).to(dot_type), acc2, input_precision=PRECISION)
            if CHUNKS > 3:
                acc3 = tl.dot(activated, tl.load(w2_block + 3 * CHUNK).to(dot_type), acc3, input_precision=PRECISION)
        out_tile = out_ptr + row[:, None] * out_stride + feature[None, :]
        if HAS_B2:  # fc2's bias, chunk by chunk
            acc0 += tl.load(b2_ptr + feature).to(tl.float32)[None, :]
            if CHUNKS > 1:
                acc1 += tl.load(b2_ptr + CHUNK + feature).to(tl.float32)[None, :]
            if CHUNKS > 2:
                acc2 += tl.load(b2_ptr + 2 * CHUNK + feature).to(tl.float32)[None, :]
            if CHUNKS > 3:
                acc3 += tl.load(b2_ptr + 3 * CHUNK + feature).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        tl.store(out_tile, acc0.to(dtype), mask=live)
        if CHUNKS > 1:
            tl.store(out_tile + CHUNK, acc1.to(dtype), mask=live)
        if CHUNKS > 2:
            tl.store(out_tile + 2 * CHUNK, acc2.to(dtype), mask=live)
        if CHUNKS > 3:
            tl.store(out_tile + 3 * CHUNK, acc3.to(dtype), mask=live)
