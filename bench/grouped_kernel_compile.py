"""What an H100/H200's compiler makes of jax's grouped projection kernels, without a GPU (issue 40).

Lowers ``kernels.grouped_projection`` for CUDA (Pallas' Triton lowering, its ``debug`` dump) at a
MoNE-ViT-B/16 block's projections (batch 256, e_c 0.3's groups), with the prologues and epilogues
``layers.grouped_block`` runs: the LayerNorm from finished statistics or from the previous
out-projection's row sums (``kernels.row_sums``), fc1 keeping its pre-activations (training), the
out-projections with and without row sums, an out-projection keeping its projection for the
gate's gradient, fc2's dX kernel (training: the GELU's derivative, and of a gated fc2 the
factor per row and the gate's gradient in its epilogue) and the dX kernels of q/k/v and fc1
(training: the LayerNorm's statistics' cotangents in their epilogue). ``ptxas -v``
(``kernel_compile.compile_stats``) gives registers per thread, spilled bytes and shared memory
per program at the default tiles, and ``nvdisasm`` the spill instructions inside loops.

    pip install --target /tmp/tritonpkg triton --no-deps   # the compiler, where it is missing
    KERAS_BACKEND=jax python bench/grouped_kernel_compile.py
"""

import argparse

import jax
import jax.numpy as jnp
from kernel_compile import compile_stats, pallas_triton_ir

from keras_mone.kernels.grouped_gradients import dx_tiles
from keras_mone.kernels.grouped_kernel import pallas_projection
from keras_mone.kernels.grouped_projection import default_tiles, grouped_projection
from keras_mone.kernels.row_sums import RowSums
from keras_mone.layers.mlp import _kernel_gelu

GROUPS = ((84, 96), (61, 192), (37, 384), (14, 768))
"""MoNE-ViT-B/16's token groups at e_c 0.3 (tokens, width), as the capacity solver gives them."""

VARIANTS = [
    ("q/k/v, LayerNorm from mean/rstd", "in", 3, dict(norm="statistics", parts=3)),
    ("q/k/v, LayerNorm from row sums", "in", 3, dict(norm="sums", parts=3)),
    ("fc1 + GELU, LayerNorm from mean/rstd", "in", 4, dict(norm="statistics", activation=True)),
    ("fc1 + GELU, LayerNorm from row sums", "in", 4, dict(norm="sums", activation=True)),
    ("fc1 + GELU keeping its pre-activations (training)", "in", 4,
     dict(norm="statistics", activation=True, keep_pre_activation=True)),
    ("attention out + residual", "out", 1, dict(residual=True)),
    ("attention out + residual + row sums", "out", 1, dict(residual=True, statistics_epsilon=1e-6)),
    ("fc2 + residual + gate", "out", 4, dict(residual=True, gate=True)),
    ("fc2 + residual + gate + row sums", "out", 4, dict(residual=True, gate=True, statistics_epsilon=1e-6)),
    ("fc2 + residual + gate + row sums, keeping its projection (training)", "out", 4,
     dict(residual=True, gate=True, statistics_epsilon=1e-6, training=True)),
    ("fc2's dX, GELU derivative (training)", "in", 4, dict(dx=True)),
    ("fc2's dX, GELU derivative, gate and the gate's gradient (training)", "in", 4, dict(dx=True, gate=True)),
    ("q/k/v's dX, the LayerNorm's row sums (training)", "out", 3, dict(norm_dx=3)),
    ("fc1's dX, the LayerNorm's row sums (training)", "out", 4, dict(norm_dx=1)),
]
"""``(label, side, width factor, options)``: ``N = factor * D`` on side "in", ``K = factor * D`` on "out";
``training``: the kernel a gradient's forward pass launches (an out-projection without an input
activation keeps its projection for the gate's gradient); ``dx``: fc2's dX kernel, ``W^T`` read
transposed (``kernels.grouped_gradients.projection_gradients``); ``norm_dx``: the dX kernel of an
in-projection with a LayerNorm prologue, its cotangent read in that many parts."""


def variant_tiles(side, factor, options, dim, dtype):
    """The default tiles of one variant's kernel (a dX kernel's ``dx_tiles``)."""
    contraction, columns = (dim, factor * dim) if side == "in" else (factor * dim, dim)
    if options.get("dx") or options.get("norm_dx"):
        return dx_tiles(contraction, columns, dtype, bool(options.get("dx")), options.get("gate", False))
    return default_tiles(contraction, columns, dtype)


def dx_ir(gated, dim, batch, dtype, tiles):
    """The Triton IR of fc2's dX kernel at ``tiles``: ``d pre = gelu'(pre) * (d out W^T)``, ``gated``:
    times ``alpha g + 1`` per row, and the gate's gradient per column tile (``products``)."""
    tokens, f32 = sum(size for size, _ in GROUPS), jnp.float32
    shapes = [((batch, tokens, dim), dtype), ((4 * dim, dim), f32), ((batch, tokens, 4 * dim), dtype),
              ((batch, tokens), dtype), ((dim,), f32)]

    def dx(dy, w, pre, gate, out_bias):
        scale = (gate, jnp.float32(0.5)) if gated else None
        return pallas_projection(dy, w, jnp.zeros((4 * dim,), f32), None, scale, None, GROUPS, "in", None, 1,
                                 tiles, "default", False, transposed=True,
                                 derivative=(_kernel_gelu(False), pre), products=out_bias if gated else None)

    return pallas_triton_ir(dx, *[jax.ShapeDtypeStruct(shape, kind) for shape, kind in shapes])


def norm_dx_ir(factor, parts, dim, batch, dtype, tiles):
    """The Triton IR of an in-projection's dX kernel at ``tiles`` (``W^T`` of a ``(D, factor D)`` weight) that
    also sums its LayerNorm's statistics' cotangents (``norm_sums``), its cotangent in ``parts``."""
    tokens, f32 = sum(size for size, _ in GROUPS), jnp.float32
    shapes = [((batch, tokens, factor * dim // parts), dtype)] * parts + [
        ((dim, factor * dim), f32), ((batch, tokens, dim), dtype), ((batch, tokens), f32), ((dim,), f32)]

    def dx(*operands):
        dy, (w, x, mean, gamma) = operands[:parts], operands[parts:]
        return pallas_projection(dy if parts > 1 else dy[0], w, jnp.zeros((dim,), f32), None, None, None, GROUPS,
                                 "out", None, 1, tiles, "default", False, transposed=True,
                                 norm_sums=(x, mean, gamma))

    return pallas_triton_ir(dx, *[jax.ShapeDtypeStruct(shape, kind) for shape, kind in shapes])


def variant_ir(side, factor, options, dim, batch, dtype, tiles):
    """The Triton IR of one variant's kernel (the dX kernels at ``tiles``; the others pick their
    default tiles themselves, as ``grouped_projection`` does)."""
    options = dict(options)
    if options.pop("dx", False):
        return dx_ir(options.pop("gate", False), dim, batch, dtype, tiles)
    if options.get("norm_dx"):
        return norm_dx_ir(factor, options["norm_dx"], dim, batch, dtype, tiles)
    contraction, columns = (dim, factor * dim) if side == "in" else (factor * dim, dim)
    tokens = sum(size for size, _ in GROUPS)
    f32 = jnp.float32
    shapes = [((batch, tokens, contraction), dtype), ((contraction, columns), f32), ((columns,), f32)]
    norm, residual, gate = options.pop("norm", None), options.pop("residual", False), options.pop("gate", False)
    if norm:  # the statistics (or one row sum per column tile), gamma, beta
        rows = (batch, tokens) if norm == "statistics" else (columns // 128, batch, tokens)
        shapes += [(rows, f32), (rows, f32), ((contraction,), f32), ((contraction,), f32)]
    if residual:
        shapes.append(((batch, tokens, columns), dtype))
    if gate:
        shapes.append(((batch, tokens), dtype))
    if options.pop("activation", False):
        options["activation"] = _kernel_gelu(False)
    training = options.pop("training", False)

    def projection(x, w, b, *rest):
        extra = dict(options)
        if norm:
            statistics, rest = rest[:2], rest[2:]
            first = (RowSums(*statistics, contraction, 1e-6),) if norm == "sums" else statistics
            extra["norm"], rest = (*first, *rest[:2]), rest[2:]
        if residual:
            extra["residual"], rest = rest[0], rest[1:]
        if gate:
            extra["scale"] = (rest[0], jnp.float32(0.5))
        return grouped_projection(x, w, b, GROUPS, side, **extra)

    def differentiated(x, *rest):  # the forward pass of a gradient: its first kernel
        first = lambda x: jnp.sum(jax.tree_util.tree_leaves(projection(x, *rest))[0].astype(f32))  # noqa: E731
        return jax.grad(first)(x)

    return pallas_triton_ir(differentiated if training else projection,
                            *[jax.ShapeDtypeStruct(shape, kind) for shape, kind in shapes])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--only", default="", help="only the kernels whose label contains this text")
    args = parser.parse_args(argv)
    print("| kernel | rows | tiles | registers | spill bytes | spill instructions in loops | shared KB | mma |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for label, side, factor, options in (v for v in VARIANTS if args.only in v[0]):
            tiles = variant_tiles(side, factor, options, args.dim, dtype)
            stats = compile_stats(variant_ir(side, factor, options, args.dim, args.batch_size, jnp.dtype(dtype), tiles),
                                  tiles[3], tiles[4])
            print(f"| {label} | {dtype} | {tiles} | {stats['registers']} | {stats['spill_bytes']} | "
                  f"{stats['loop_spills']} | {stats['shared_bytes'] / 1e3:.1f} | {stats['mma']} |", flush=True)


if __name__ == "__main__":
    main()
