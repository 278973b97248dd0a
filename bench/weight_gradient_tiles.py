"""Tile settings of the grouped weight-gradient kernel against XLA's per-group products, timed on this device (jax).

The training step through the grouped kernels (``$KERAS_MONE_PROJECTIONS=grouped_kernel``)
computes each nested projection's ``dW`` and ``db`` in one launch over all token groups
(``kernels.grouped_gradients.grouped_weight_gradient``, ``bias=True``). Its default tiles were
chosen from the code compiled for sm_90 without a card (wgmma, no spills: BENCHMARKS.md).
This times the four weights of a ViT-B/16 block (q/k/v with its cotangent in three parts, the
attention's out-projection, fc1, fc2) at MoNE-ViT-B/16's token groups at e_c 0.3 and the
training batch 128, for the default tiles and a list of others, against
``plain_weight_gradient`` and ``plain_bias_gradient`` compiled by XLA (one product and one
reduction per group), and prints the fastest tiles of each weight as a
``$KERAS_MONE_WEIGHT_GRADIENT_TILES`` value, which ``bench/gpu_forms.py --train-forms
grouped_kernel`` then times in the training step. Each setting's ``dW`` and ``db`` are checked
against XLA's first; a setting off by more than the bound is listed as wrong and never chosen,
one the compiler rejects as failed. ``--budget`` bounds the sweep's seconds (a quarter per weight).

    KERAS_BACKEND=jax python bench/weight_gradient_tiles.py                          # a GPU
    KERAS_BACKEND=jax python bench/weight_gradient_tiles.py --batch-size 2 --dim 32 --hidden 64 \\
        --groups 5x4,3x8,2x16,1x32 --repeats 1 --tiles 16,16,32,4,2                  # a CPU smoke test
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
from grouped_tiles import GROUPS, add_screen_options, report, screen, screen_setup
from kernel_check import BOUNDS, GPU_BOUNDS

from keras_mone.kernels.grouped_gradients import (
    WEIGHT_TILES_ENV, check_weight_tiles, default_weight_tiles, grouped_weight_gradient, plain_bias_gradient,
    plain_weight_gradient,
)

CANDIDATES = [(64, 128, 128, 8, 2), (128, 128, 128, 8, 3), (32, 128, 128, 8, 3), (64, 128, 64, 4, 3),
              (64, 64, 128, 4, 3), (64, 64, 64, 4, 3), (128, 64, 128, 8, 3), (64, 128, 256, 8, 3)]
"""Timed after each weight's default (``default_weight_tiles``: 64 token rows into a 128 x 128
tile of ``dW`` on 8 warps, 3 stages): 32-128 rows per step, 64-256-wide tiles of ``dW`` on one
or two warpgroups, 2-3 stages. Not compiled for sm_90 beforehand: a setting that does not
compile is listed as failed."""


def weights(dim, hidden):
    """``[(label, side, K, N, parts)]`` of a ViT block's four nested weights."""
    return [("q/k/v", "in", dim, 3 * dim, 3), ("attention out", "out", dim, dim, 1), ("fc1", "in", dim, hidden, 1),
            ("fc2", "out", hidden, dim, 1)]


def sweep(batch, groups, weight, candidates, dtype, repeats, interpret, deadline, log):
    """``[(tiles, ms or None, error or None, note)]`` for one weight, XLA's path first."""
    label, side, contraction, columns, parts = weight
    groups = groups if side == "in" else tuple((size, min(width, columns)) for size, width in groups)
    tokens = sum(size for size, _ in groups)
    keys = jax.random.split(jax.random.PRNGKey(0), 1 + parts)
    x = jax.random.normal(keys[0], (batch, tokens, contraction), dtype)
    cotangents = [jax.random.normal(key, (batch, tokens, columns // parts), dtype) for key in keys[1:]]
    arguments = (x, *cotangents)

    def plain(x, *dy):  # dW and db as one vector, so that one number says how far a setting lies
        dy = dy[0] if parts == 1 else jnp.concatenate(dy, axis=-1)
        return jnp.concatenate([plain_weight_gradient(x, dy, groups, side).ravel(),
                                plain_bias_gradient(dy, groups, side)])

    def kernel(tiles):
        check_weight_tiles(tiles, contraction, columns // parts)

        def run(x, *dy):
            dw, db = grouped_weight_gradient(x, dy if parts > 1 else dy[0], groups, side, tiles=tiles, bias=True,
                                             interpret=interpret)
            return jnp.concatenate([dw.ravel(), db])
        return jax.jit(run)

    bound = (BOUNDS if interpret else GPU_BOUNDS)["float32"]  # float32 sums of the same products
    return screen(label, jax.jit(plain), kernel, arguments, bound, default_weight_tiles(contraction, columns // parts,
                  dtype), candidates, repeats, deadline, log, time_default=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--groups", default=GROUPS, help="tokens x width per group, in token order")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--dtype", default="bfloat16")
    add_screen_options(parser, "rows,k,n,warps,stages", "seconds, shared equally by the four weights; each "
                       "weight's settings past its share are listed untimed (its default always timed)")
    args = parser.parse_args(argv)
    candidates, interpret, device, log = screen_setup(parser, args, CANDIDATES, "weight_gradient_tiles")
    groups = tuple(tuple(int(v) for v in pair.split("x")) for pair in args.groups.split(","))
    print(f"Weight-gradient tiles on {device}, jax {jax.__version__}, {args.dtype}, batch {args.batch_size}, "
          f"groups {args.groups}, D={args.dim}, H={args.hidden}, medians of {args.repeats}; "
          f"`KERAS_BACKEND=jax python bench/weight_gradient_tiles.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("| weight | K x N | tiles (rows, k, n, warps, stages) | ms | XLA / kernel | error / max value | note |\n"
          "|---|---|---|---|---|---|---|")
    best = []
    for weight in weights(args.dim, args.hidden):
        label, _, contraction, columns, _ = weight
        shape = f"{contraction}x{columns}"
        deadline = time.monotonic() + args.budget / 4
        results = sweep(args.batch_size, groups, weight, candidates, jnp.dtype(args.dtype), args.repeats, interpret,
                        deadline, log)
        entry = report(label, shape, results)
        if entry:
            best.append(entry)
    print(f"\n{WEIGHT_TILES_ENV}=\"{';'.join(best)}\"")


if __name__ == "__main__":
    main()
