"""Tile settings of a fused kernel against XLA's plain path, timed on this device (jax).

On an H200 the block kernel (``kernels/fused_residual_mlp``) at its first tiles took 0.5 ms
per launch, 3x XLA's MLP (BENCHMARKS.md, "MoNE on an H200, measured"); this screen found
tiles 1.5x faster than XLA's path at d = 96 (2026-11-28, "measured again"), now the
defaults (``kernels.tiles.CARD_TILES``). This times
the kernel for a grid of ``(block_rows, block_hidden, num_warps, num_stages)`` at the token
groups of MoNE-ViT-B/16 at e_c 0.3 and batch 256 (rows of width 96, 192, 384), each against
``plain_residual_mlp`` compiled by XLA, and prints the best setting per width as a
``$KERAS_MONE_MLP_TILES`` value, which ``bench/gpu_forms.py --forms fused_mlp`` then times in
the whole model. A width where XLA's path beat every tile (or no tile matched it) is named
``plain`` there: the tuned model runs the kernel only where it pays. ``--kernel mlp`` does
the same for the MLP kernel alone (``kernels/fused_nested_mlp`` against
``plain_nested_mlp``; ``--forms mlp_kernel``). A setting the compiler rejects (shared
memory, registers) is listed as failed and the sweep goes on. Each setting's output is
checked against the plain path's (``bench/kernel_check.py``'s error and bounds): a setting
off by more is listed as wrong and never chosen, however fast.

    KERAS_BACKEND=jax python bench/kernel_tiles.py                       # a GPU
    KERAS_BACKEND=jax python bench/kernel_tiles.py --rows 64 --repeats 1 \\
        --dim 96 --hidden 384 --widths 12,24 --grid 16,32:64:4:2         # a CPU smoke test (interpreted)
"""

import argparse
import itertools
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from kernel_check import BOUNDS, GPU_BOUNDS, kernel_inputs, relative_error

from keras_mone.kernels.fused_nested_mlp import fused_nested_mlp, plain_nested_mlp
from keras_mone.kernels.tiles import PLAIN, default_tiles
from keras_mone.kernels.fused_residual_mlp import fused_residual_mlp, plain_residual_mlp
from keras_mone.layers.mlp import _kernel_gelu

GROUP_ROWS = {96: 256 * 84, 192: 256 * 61, 384: 256 * 37}
"""Rows of each nested group of MoNE-ViT-B/16 at e_c 0.3, batch 256 (196 tokens; optimised HLO, BENCHMARKS.md)."""
GRID = "32,64,128:64,128:4,8:2,3"
"""block_rows : block_hidden : num_warps : num_stages, each a comma-separated list (``--grid``)."""

SCREENED = {
    "residual": {
        96: [(64, 128, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (32, 64, 4, 2), (128, 64, 4, 2), (128, 32, 8, 2)],
        192: [(64, 64, 4, 2), (64, 32, 4, 3), (64, 16, 4, 2), (32, 64, 4, 2), (128, 32, 4, 2), (128, 16, 8, 2)],
        384: [(32, 64, 4, 2), (64, 32, 4, 2), (32, 64, 8, 3), (64, 16, 4, 2), (32, 32, 4, 2)],
    },
    "mlp": {
        96: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 3), (128, 64, 8, 2)],
        192: [(64, 32, 4, 2), (128, 32, 8, 2), (32, 64, 4, 2), (32, 64, 8, 3), (32, 64, 8, 2), (64, 64, 8, 2)],
        384: [(32, 32, 4, 2), (32, 64, 8, 3), (64, 16, 8, 2), (32, 32, 8, 2)],
    },
}
"""The tiles timed per kernel and width when ``--grid`` is not given, after the kernel's
default (``tiles.default_tiles``), which is timed first.

* The block kernel (``residual``): the neighbours of the tiles an H200 timed fastest on
  2026-11-28, now its defaults (``tiles.CARD_TILES``: one warpgroup of 4 warps on 64 rows):
  other hidden blocks and stages, 32 and 128 rows at 4 warps, and the 8-warp, 128-row
  default before them (``default_blocks``).
* The MLP kernel alone (``mlp``), never screened on a card: tiles compiled for sm_90 here
  (``bench/kernel_compile.py --kernel mlp`` with ``--block-rows 32,64,128 --block-hidden
  16,32,64 --warps 4,8``, BENCHMARKS.md), most without spills or copies of the GELU, and
  earlier defaults that compute it twice (32 rows at 8 warps: where a tile is small for its
  warps, Triton gives several warps copies of the same product).
"""


def median_ms(function, arguments, repeats):
    jax.block_until_ready(function(*arguments))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(function(*arguments))
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def timed_setting(make_kernel, arguments, expected, bound, repeats, is_default):
    """``(ms or None, error or None, note)`` of one tile setting: ``make_kernel()`` builds the
    jitted kernel, whose output is checked against ``expected`` before it is timed. An error
    past ``bound`` (the largest difference over the largest value) gives a note starting
    "wrong"; a setting that fails to build or compile gives "failed: ..." and no time, so a
    sweep lists it and goes on."""
    try:
        kernel = make_kernel()
        error = relative_error(kernel(*arguments), expected)
        ms, note = median_ms(kernel, arguments, repeats), "default" if is_default else ""
        if not error <= bound:  # NaN included
            note = f"wrong: error {error:.1e} > {bound:.1e}" + (", default" if note else "")
        return ms, error, note
    except Exception as failure:  # a tile the compiler rejects, or one that does not fit the shape
        return None, None, f"failed: {type(failure).__name__}: {(str(failure).splitlines() or [''])[0][:120]}"


def sweep(width, rows, args, interpret, log):
    """``[(tiles, ms or None, error or None, note)]`` for one width, the plain path first (tiles
    ``"plain (XLA)"``); ``error``: the largest difference from the plain path's output over its
    largest value. A setting past the dtype's bound gets a note starting "wrong"."""
    gelu = _kernel_gelu(False)
    z, norm, mlp, scale = kernel_inputs(rows, args.dim, args.hidden, jnp.dtype(args.dtype))
    if args.kernel == "mlp":  # the token rows and the MLP's weights only
        arguments = (z, *mlp)
        plain = jax.jit(lambda *a: plain_nested_mlp(*a, width, gelu))
        fused = fused_nested_mlp
    else:
        arguments = (z, *norm, *mlp, scale)
        plain = jax.jit(lambda *a: plain_residual_mlp(*a, width, gelu, 1e-6))
        fused = fused_residual_mlp
    expected = plain(*arguments)
    bound = (BOUNDS if interpret else GPU_BOUNDS)[args.dtype]
    results = [("plain (XLA)", median_ms(plain, arguments, args.repeats), 0.0, "")]
    log(f"d={width}: plain {results[0][1]:.3f} ms")
    default = default_tiles(width, args.hidden, jnp.dtype(args.dtype).itemsize, args.kernel)
    if args.grid is None and width in SCREENED[args.kernel]:
        candidates = SCREENED[args.kernel][width]
    else:
        axes = (args.grid or GRID).split(":")
        candidates = itertools.product(*[tuple(int(v) for v in axis.split(",")) for axis in axes])
    for tiles in dict.fromkeys([default, *candidates]):
        def kernel(t=tiles):
            return jax.jit(lambda *a: fused(
                *a, width, gelu, block_rows=t[0], block_hidden=t[1], num_warps=t[2], num_stages=t[3],
                interpret=interpret))
        ms, error, note = timed_setting(kernel, arguments, expected, bound, args.repeats, tiles == default)
        results.append((tiles, ms, error, note))
        log(f"d={width} {tiles}: {'-' if ms is None else f'{ms:.3f} ms'} {note}")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", choices=("residual", "mlp"), default="residual",
                        help="the block kernel (fused_residual_mlp) or the MLP kernel alone (fused_nested_mlp)")
    parser.add_argument("--widths", default="96,192,384")
    parser.add_argument("--rows", type=int, default=None, help="rows per width (default: GROUP_ROWS)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--grid", default=None,
                        help=f"rows:hidden:warps:stages lists, e.g. {GRID} (default: SCREENED's tiles per width)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    log = (lambda message: print(f"[kernel_tiles] {message}", file=sys.stderr, flush=True))
    device = jax.devices()[0]
    name = "MLP kernel" if args.kernel == "mlp" else "Block kernel"
    print(f"{name} tiles on {device.device_kind if not interpret else 'cpu (interpreted)'}, jax "
          f"{jax.__version__}, {args.dtype}, D={args.dim}, H={args.hidden}, medians of {args.repeats}; "
          f"`KERAS_BACKEND=jax python bench/kernel_tiles.py {' '.join(argv or sys.argv[1:])}`\n")
    print("| d | rows | tiles (rows, hidden, warps, stages) | ms | plain / kernel | error / max value | note |\n"
          "|---|---|---|---|---|---|---|")
    best = []
    for width in (int(w) for w in args.widths.split(",")):
        rows = args.rows or GROUP_ROWS.get(width, 16384)
        results = sweep(width, rows, args, interpret, log)
        plain_ms = results[0][1]  # errors are over max(1, the largest plain value), as kernel_check's
        for tiles, ms, error, note in results:
            ratio = "" if ms is None else f"{plain_ms / ms:.2f}"
            shown = "" if error is None else f"{error:.1e}"
            print(f"| {width} | {rows} | {tiles} | {'-' if ms is None else f'{ms:.3f}'} | {ratio} | {shown} | {note} |")
        timed = [(ms, tiles) for tiles, ms, _, note in results[1:] if ms is not None and not note.startswith("wrong")]
        if not timed:  # the tuned model keeps XLA's path at this width
            best.append(f"{width}:{PLAIN}")
            print(f"| {width} | | **no tile setting both ran and matched the plain path**: {PLAIN} | | | | |")
            log(f"d={width}: no tile setting ran and matched the plain path; the tuned model keeps the plain path")
            continue
        ms, tiles = min(timed)
        print(f"| {width} | | **best** {tiles} | **{ms:.3f}** | **{plain_ms / ms:.2f}** | | |")
        if plain_ms <= ms:  # the kernel does not pay at this width: the tuned model keeps XLA's path
            best.append(f"{width}:{PLAIN}")
            print(f"| {width} | | **plain (XLA) is faster than every tile**: {PLAIN} | | | | |")
        else:
            best.append(f"{width}:{','.join(map(str, tiles))}")
    print(f"\nKERAS_MONE_MLP_TILES=\"{';'.join(best)}\"")


if __name__ == "__main__":
    main()
