"""Tile settings of the grouped nested projections against XLA's per-group GEMMs, timed on this device (jax).

``kernels.grouped_projection`` runs each nested projection of a MoNE block as one launch over
all token groups (``$KERAS_MONE_PROJECTIONS=grouped_kernel``). Its default tiles were chosen
from the code compiled for sm_90 without a card (wgmma, no spills: BENCHMARKS.md). This times
each of a ViT-B/16 block's four projections (q/k/v written as three tensors, the attention's
out-projection with the residual, fc1 with the GELU, fc2 with the residual and the gate) at
MoNE-ViT-B/16's token groups at e_c 0.3 and batch 256, for the default tiles and a list of
others, against ``plain_grouped_projection`` compiled by XLA (one GEMM per group), and prints
the fastest tiles of each kernel shape as a ``$KERAS_MONE_PROJECTION_TILES`` value, which
``bench/gpu_forms.py --forms grouped_kernel`` then times in the whole model. Each setting's
output is checked against XLA's first (``bench/kernel_check.py``'s bounds); a setting off by
more is listed as wrong and never chosen. A setting the compiler rejects is listed as failed.
``--budget`` stops the sweep after that many seconds and names what it left.

    KERAS_BACKEND=jax python bench/grouped_tiles.py                               # a GPU
    KERAS_BACKEND=jax python bench/grouped_tiles.py --batch-size 2 --dim 32 --hidden 64 \\
        --groups 5x4,3x8,2x16,1x32 --repeats 1 --tiles 16,32,16,4,2                # a CPU smoke test
"""

import argparse
import math
import sys
import time

import jax
import jax.numpy as jnp

from kernel_check import BOUNDS, GPU_BOUNDS
from kernel_tiles import median_ms, timed_setting

from keras_mone.kernels.grouped_projection import (
    TILES_ENV, check_tiles, default_tiles, grouped_projection, plain_grouped_projection,
)
from keras_mone.layers.mlp import _kernel_gelu

GROUPS = "84x96,61x192,37x384,14x768"
"""(tokens, width) of MoNE-ViT-B/16's groups at e_c 0.3 (196 tokens; the optimised HLO, BENCHMARKS.md)."""
CANDIDATES = [(64, 128, 64, 4, 3), (64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (64, 128, 32, 4, 4),
              (128, 128, 32, 8, 4), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3), (64, 128, 64, 4, 2)]
"""Timed after each shape's default (``default_tiles``: 128 x 128 x 64 on 8 warps, 3 stages) where
``--tiles`` is not given: 64- and 128-row tiles (one or two warpgroups), 64-256 columns, 32-64
contraction steps, 2-4 stages. Compiled for sm_90 here at these shapes (bf16 rows, float32
weights; ``bench/kernel_compile.py``'s ``compile_stats``, BENCHMARKS.md) all take wgmma without
spills; 128 x 256 tiles and 128 x 128 on 4 warps spilled and are left out."""


def projections(dim, hidden):
    """``[(label, side, K, N, options)]`` of a ViT block's four nested projections."""
    gelu = _kernel_gelu(False)
    return [("q/k/v", "in", dim, 3 * dim, {"parts": 3}), ("attention out", "out", dim, dim, {"residual": True}),
            ("fc1 + GELU", "in", dim, hidden, {"activation": gelu}),
            ("fc2", "out", hidden, dim, {"residual": True, "scale": True})]


def inputs(batch, groups, side, contraction, columns, options, dtype, seed=0):
    """Random ``(x, w, b[, residual][, scale])``: ``x`` and the epilogue's tensors in ``dtype``,
    the weights in float32 (as mixed precision's variables)."""
    tokens = sum(size for size, _ in groups)
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    arrays = [jax.random.normal(keys[0], (batch, tokens, contraction), dtype),
              jax.random.normal(keys[1], (contraction, columns), jnp.float32) / math.sqrt(contraction),
              0.1 * jax.random.normal(keys[2], (columns,), jnp.float32)]
    if options.get("residual"):
        arrays.append(jax.random.normal(keys[3], (batch, tokens, columns), dtype))
    if options.get("scale"):
        arrays.append((1.0 + jax.random.uniform(keys[4], (batch, tokens))).astype(dtype))
    return arrays


def sweep(batch, groups, projection, candidates, dtype, repeats, interpret, deadline, log):
    """``[(tiles, ms or None, error or None, note)]`` for one projection, XLA's path first."""
    label, side, contraction, columns, options = projection
    groups = groups if side == "in" else tuple((size, min(width, columns)) for size, width in groups)
    fixed = {k: v for k, v in options.items() if k in ("parts", "activation")}
    arguments = inputs(batch, groups, side, contraction, columns, options, dtype)

    def call(function, **tiles):
        def run(x, w, b, *epilogue):
            extra = dict(zip([k for k in ("residual", "scale") if options.get(k)], epilogue))
            if "scale" in extra:  # MoNE's gate per row and alpha, as the model passes them
                extra["scale"] = (extra["scale"], jnp.float32(0.5))
            return function(x, w, b, groups, side, **fixed, **extra, **tiles)
        return jax.jit(run)

    def kernel(tiles):
        check_tiles(tiles, contraction, columns)
        return call(grouped_projection, tiles=tiles, interpret=interpret)

    bound = (BOUNDS if interpret else GPU_BOUNDS)[jnp.dtype(dtype).name]
    return screen(label, call(plain_grouped_projection), kernel, arguments, bound,
                  default_tiles(contraction, columns, dtype), candidates, repeats, deadline, log)


def screen(label, plain, make_kernel, arguments, bound, default, candidates, repeats, deadline, log,
           time_default=False):
    """``[(tiles, ms or None, error or None, note)]``: XLA's path ``plain`` first, then each tile
    setting (``make_kernel(tiles)`` the jitted kernel, checked against ``plain``'s output within
    ``bound`` by ``timed_setting``), the default first; settings after ``deadline`` are listed
    untimed (``time_default``: the default is timed all the same)."""
    expected = plain(*arguments)
    results = [("plain (XLA)", median_ms(plain, arguments, repeats), 0.0, "")]
    log(f"{label}: plain {results[0][1]:.3f} ms")
    for tiles in dict.fromkeys([default, *candidates]):
        if time.monotonic() > deadline and not (time_default and tiles == default):
            results.append((tiles, None, None, "not timed: --budget spent"))
            continue
        ms, error, note = timed_setting(lambda t=tiles: make_kernel(t), arguments, expected, bound, repeats,
                                        tiles == default)
        results.append((tiles, ms, error, note))
        log(f"{label} {tiles}: {'-' if ms is None else f'{ms:.3f} ms'} {note}")
    return results


def report(label, shape, results):
    """Prints ``results``' rows and the best setting's (the fastest that ran and matched XLA's
    path); returns its ``shape=tiles`` entry for a tiles variable, or ``None`` (the defaults stay)."""
    plain_ms = results[0][1]
    for tiles, ms, error, note in results:
        ratio = "" if ms is None else f"{plain_ms / ms:.2f}"
        shown = "" if error is None else f"{error:.1e}"
        print(f"| {label} | {shape} | {tiles} | {'-' if ms is None else f'{ms:.3f}'} | {ratio} | {shown} | {note} |")
    timed = [(ms, tiles) for tiles, ms, _, note in results[1:] if ms is not None and not note.startswith("wrong")]
    if not timed:
        print(f"| {label} | {shape} | **no tile setting both ran and matched XLA's path**: the defaults stay | | | | |")
        return None
    ms, tiles = min(timed)
    print(f"| {label} | {shape} | **best** {tiles} | **{ms:.3f}** | **{plain_ms / ms:.2f}** | | |")
    return f"{shape}={','.join(map(str, tiles))}"


def add_screen_options(parser, fields, budget_help="seconds; later settings are listed untimed"):
    """The options every tile screen takes: ``--tiles`` (``fields`` names a setting's values),
    ``--repeats`` and ``--budget``."""
    parser.add_argument("--tiles", default=None, help=f"settings to time after the default, {fields} separated "
                        "by ';' (default: CANDIDATES)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--budget", type=float, default=math.inf, help=budget_help)


def screen_setup(parser, args, candidates, name):
    """``(settings, interpret, device name, log)`` of a screen's parsed ``args``: ``--tiles``'
    settings (else ``candidates``), Pallas' interpreter off a GPU, and a log to stderr
    prefixed ``[name]``; a bad ``--budget`` or ``--tiles`` is a usage error naming it."""
    if not args.budget >= 0:  # NaN included
        parser.error(f"--budget must be a number of seconds >= 0, got {args.budget}")
    try:
        settings = candidates if args.tiles is None else [
            tuple(int(v) for v in entry.split(",")) for entry in args.tiles.split(";") if entry]
    except ValueError:
        parser.error(f"--tiles must be comma-separated ints, settings separated by ';', got {args.tiles!r}")
    interpret = jax.default_backend() != "gpu"
    device = jax.devices()[0].device_kind if not interpret else "cpu (interpreted)"
    return settings, interpret, device, (lambda message: print(f"[{name}] {message}", file=sys.stderr, flush=True))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--groups", default=GROUPS, help="tokens x width per group, in token order")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--dtype", default="bfloat16")
    add_screen_options(parser, "rows,cols,k,warps,stages")
    args = parser.parse_args(argv)
    candidates, interpret, device, log = screen_setup(parser, args, CANDIDATES, "grouped_tiles")
    groups = tuple(tuple(int(v) for v in pair.split("x")) for pair in args.groups.split(","))
    dtype = jnp.dtype(args.dtype)
    deadline = time.monotonic() + args.budget
    print(f"Grouped projection tiles on {device}, jax {jax.__version__}, {args.dtype}, batch {args.batch_size}, "
          f"groups {args.groups}, D={args.dim}, H={args.hidden}, medians of {args.repeats}; "
          f"`KERAS_BACKEND=jax python bench/grouped_tiles.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("| projection | K x N | tiles (rows, cols, k, warps, stages) | ms | XLA / kernel | error / max value | note |\n"
          "|---|---|---|---|---|---|---|")
    best = []
    for projection in projections(args.dim, args.hidden):
        label, _, contraction, columns, _ = projection
        shape = f"{contraction}x{columns}"
        results = sweep(args.batch_size, groups, projection, candidates, dtype, args.repeats, interpret, deadline, log)
        entry = report(label, shape, results)
        if entry:
            best.append(entry)
    print(f"\n{TILES_ENV}=\"{';'.join(best)}\"")


if __name__ == "__main__":
    main()
