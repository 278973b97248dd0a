"""What an H100/H200's compiler makes of torch's grouped projection kernels, without a GPU (issue 40).

Compiles ``kernels.triton_grouped_tile`` (each nested projection of a packed MoNE block as one
Triton launch over all token groups) for sm_90 at a ViT-B/16 block's four projections, with
their prologues and epilogues as ``layers.packed_kernels`` runs them, for the default tiles and
any given, and ``kernels.triton_row_statistics``; ``ptxas -v`` (``kernel_compile.compile_stats``)
gives registers per thread, spilled bytes and shared memory per program, and ``nvdisasm`` the
spill instructions inside loops (each iteration's). Rows in ``--dtypes``,
weights in the rows' dtype (what a model's call passes: Keras' autocast casts them under mixed
precision), float32 rows at TF32 (torch's ``float32_matmul_precision`` "high") and at torch's
default "highest" (no tensor cores).

    KERAS_BACKEND=torch python bench/triton_grouped_compile.py
    KERAS_BACKEND=torch python bench/triton_grouped_compile.py --tiles "128,128,64,8,3;64,64,64,4,3"
"""

import argparse

from kernel_compile import compile_stats
from triton_mlp import _Lines

from keras_mone.kernels import triton_grouped_tile, triton_row_statistics

PROJECTIONS = [("LN + q/k/v", "in", 1, 3, dict(norm=True)), ("attention out + residual", "out", 1, 1,
                                                                dict(residual=True)),
               ("attention out + residual, batch-major rows (SDPA's)", "out", 1, 1,
                dict(residual=True, split_rows=True)),
               ("LN + fc1 + GELU", "in", 1, 4, dict(norm=True, activation="gelu")),
               ("fc2 + gate + residual", "out", 4, 1, dict(residual=True, scale="gate")),
               ("LN (partials) + q/k/v", "in", 1, 3, dict(norm=True, norm_tiles="fc2")),
               ("attention out + residual + partials", "out", 1, 1, dict(residual=True, statistics=True)),
               ("attention out + residual + partials, batch-major rows", "out", 1, 1,
                dict(residual=True, split_rows=True, statistics=True)),
               ("LN (partials) + fc1 + GELU", "in", 1, 4, dict(norm=True, activation="gelu", norm_tiles="out")),
               ("fc2 + gate + residual + partials", "out", 4, 1, dict(residual=True, scale="gate", statistics=True))]
"""``(label, side, K / D, N / D, options)`` of a ViT block's four nested projections: with each
LayerNorm's statistics from a kernel of their own (with autograd, under ``torch.compile``, with
``$KERAS_MONE_STATISTICS=kernel``), then as ``layers.packed_kernels`` runs them eagerly without
autograd, the LayerNorms' statistics from the partials of the out-projection before (``norm_tiles``
names the one whose default column tiles they are; the first block's LN1 takes the kernel's)."""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--row-align", type=int, default=None,
                        help="the rows' alignment the kernel is compiled for (triton_grouped_tile.tile_table; default "
                        "block_rows: every group's rows a multiple of it, as ViT-B/16's at batch 256)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="Triton's names of the rows' dtypes")
    parser.add_argument("--tiles", default="", help="';'-separated tile settings after each shape's default")
    args = parser.parse_args(argv)
    extra = [tuple(int(v) for v in entry.split(",")) for entry in args.tiles.split(";") if entry.strip()]
    lines = _Lines()  # each printed as it comes
    lines += [f"Grouped projections (Triton) compiled for sm_90: D = {args.dim}, rows aligned to "
              f"{args.row_align or 'block_rows'} (one program for every layout of the token groups so aligned: the "
              "tile table is data), weights in the rows' dtype\n",
              "| rows | projection | tiles | mma | registers | spill bytes | spill instructions in loops | shared KB |",
              "|---|---|---|---|---|---|---|---|"]
    settings = [(dtype, precision) for dtype in args.dtypes.split(",")
                for precision in (("tf32", "ieee") if dtype == "fp32" else ("tf32",))]
    for dtype, precision in settings:
        for label, side, k, n, options in PROJECTIONS:
            contraction, columns = k * args.dim, n * args.dim
            source = {"fc2": 4, "out": 1}.get(options.get("norm_tiles"))
            if source:  # partials over the default column tiles of the out-projection before
                options = dict(options, norm_tiles=args.dim // triton_grouped_tile.default_tiles(source * args.dim,
                                                                                                 args.dim)[1])
            for tiles in dict.fromkeys([triton_grouped_tile.default_tiles(contraction, columns), *extra]):
                compiled = triton_grouped_tile.compile_for_cuda(contraction, columns, side, dtype, tiles,
                                                                precision=precision, row_align=args.row_align,
                                                                **options)
                stats = compile_stats(compiled.asm["ttir"], tiles[3], tiles[4])
                rows = dtype if dtype != "fp32" else f"fp32 ({'TF32' if precision == 'tf32' else 'highest'})"
                lines.append(f"| {rows} | {label} | {tiles} | {stats['mma']} | {stats['registers']} | "
                             f"{stats['spill_bytes']} | {stats['loop_spills']} | {stats['shared_bytes'] / 1024:.1f} |")
    statistics = compile_stats(triton_row_statistics.compile_for_cuda(args.dim).asm["ttir"], 4, 1)
    lines.append(f"\nRow statistics (D = {args.dim}, bf16 rows): {statistics['registers']} registers, "
                 f"{statistics['spill_bytes']} spill bytes")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
