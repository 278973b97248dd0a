"""The Triton nested-MLP kernel (torch) against torch's own ops, per MoNE token group (issue 40).

For each nested group of MoNE-ViT-B/16 at ``--capacity`` (its rows: batch x the group's
tokens; its width D/8, D/4, D/2), times torch's path (``addmm``, GELU, ``addmm``: the
``(rows, 4D)`` hidden activations through device memory) and the kernel
(``kernels.triton_nested_mlp``: fc1, GELU and fc2 in one launch) at its default tiles and,
with ``--sweep``, at every tile setting of a small grid. Each kernel's output is checked
against torch's path first (a setting that differs is reported, not timed). Medians of
interleaved calls, each synchronised. It prints a markdown table with FLOP rates, the best
setting per width and a ``KERAS_MONE_MLP_TILES`` line for the model (``$KERAS_MONE_MLP=fused``
on torch takes it).

    KERAS_BACKEND=torch python bench/triton_mlp.py --sweep                 # on a CUDA card
    KERAS_BACKEND=torch python bench/triton_mlp.py --sweep --budget 60     # the same within about a minute
    KERAS_BACKEND=torch python bench/triton_mlp.py --batch-size 1 --tokens 24 --dim 192 \\
        --hidden 128 --repeats 2   # anywhere: the kernel interpreted (a smoke test, not a timing)
"""

import argparse
import itertools
import statistics
import time

SWEEP = {"block_rows": (64, 128), "block_hidden": (16, 32, 64), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
"""The tile grid of ``--sweep``: 36 settings per width (those that do not fit the width are skipped)."""


def group_shapes(capacity, tokens, dim, experts=4):
    """``[(tokens_j, width_j)]`` of MoNE's nested groups (not the full width) at ``capacity``:
    the capacity solver's token counts (MoNE Eq. 4), widths ``D / 2^(E-1-j)``."""
    from keras_mone.routing.capacity import capacity_distribution
    from keras_mone.routing.epr import expert_token_counts

    counts, _ = expert_token_counts(capacity_distribution(capacity, experts), tokens)
    widths = [dim // 2 ** (experts - 1 - j) for j in range(experts)]
    return [(n, w) for n, w in zip(counts, widths) if n and w < dim]


def timed_pair(first, second, repeats, synchronize):
    """Median seconds of ``first`` and of ``second``, called in turn ``repeats`` times each
    (after one warm-up call of each), every call synchronised."""
    for function in (first, second):
        function()
    synchronize()
    times = ([], [])
    for _ in range(repeats):
        for function, kept in zip((first, second), times):
            start = time.perf_counter()
            function()
            synchronize()
            kept.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def settings(width, hidden, sweep):
    """The tile settings to time for ``width``: the defaults (``{}``), then the sweep's grid."""
    from keras_mone.kernels.tiles import MIN_CHUNK

    grid = [{}]
    if sweep:
        for values in itertools.product(*SWEEP.values()):
            tile = dict(zip(SWEEP, values))
            if hidden % tile["block_hidden"] == 0 and tile["block_hidden"] >= MIN_CHUNK:
                grid.append(tile)
    return grid


class _Lines(list):
    """The report's lines, each printed as it comes (a run cut short keeps what it measured)."""

    def append(self, line):
        print(line, flush=True)
        super().append(line)

    def __iadd__(self, lines):
        for line in lines:
            self.append(line)
        return self


def run(args):
    import torch

    from keras_mone.kernels import triton_nested_mlp as kernel

    if not kernel.available():
        raise SystemExit("Triton is not installed (`pip install triton`; torch's CUDA wheels bring it).")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator(device="cpu").manual_seed(0)
    w1, b1, w2, b2 = ((torch.randn(shape, generator=generator) / shape[0] ** 0.5).to(device, dtype)
                      for shape in ((args.dim, args.hidden), (args.hidden,), (args.hidden, args.dim), (args.dim,)))
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton's interpreter: not a timing)"
    lines = _Lines()
    lines += [f"Triton nested MLP against torch's ops on {name}; torch {torch.__version__}; {args.dtype}, "
             f"D {args.dim}, H {args.hidden}, batch {args.batch_size} x {args.tokens} tokens, MoNE e_c "
             f"{args.capacity:g}; medians of {args.repeats} interleaved calls; {time.strftime('%Y-%m-%d')}.", "",
             "| width | rows | setting | torch ms | kernel ms | speed-up | kernel TFLOP/s | max error / max |",
             "|---|---|---|---|---|---|---|---|"]
    best, skipped = {}, []
    shapes = group_shapes(args.capacity, args.tokens, args.dim)
    fitting = [width for _, width in shapes if kernel.kernel_fits(width, args.hidden)]
    started = time.perf_counter()
    for tokens, width in shapes:
        rows = args.batch_size * tokens
        if not kernel.kernel_fits(width, args.hidden):
            lines.append(f"| {width} | {rows} | does not fit the kernel (`kernel_fits`): torch's ops | | | | | |")
            continue
        # each fitting width gets an equal share of what is left of --budget (defaults always timed)
        widths_left = len(fitting) - fitting.index(width)
        deadline = (None if args.budget is None else
                    time.perf_counter() + (args.budget - (time.perf_counter() - started)) / widths_left)
        x = torch.randn(rows, args.dim, generator=generator).to(device, dtype)
        with torch.inference_mode():
            reference = kernel.plain_nested_mlp(x, w1, b1, w2, b2, width)
            scale = float(reference.abs().max().float())
            grid = settings(width, args.hidden, args.sweep)
            for index, tile in enumerate(grid):
                label = ",".join(str(tile[k]) for k in SWEEP) if tile else "defaults"
                if tile and deadline is not None and time.perf_counter() > deadline:
                    skipped.append(f"d = {width}: {len(grid) - index} of {len(grid) - 1} settings")
                    break
                try:
                    error = float((kernel.nested_mlp(x, w1, b1, w2, b2, width, **tile) - reference).abs().max()) / scale
                except Exception as failure:  # a setting Triton cannot compile (shared memory, registers)
                    lines.append(f"| {width} | {rows} | {label} | | | | | {type(failure).__name__} |")
                    continue
                if error > args.tolerance:
                    lines.append(f"| {width} | {rows} | {label} | | | | | **{error:.2e}** (not timed) |")
                    continue
                plain_s, kernel_s = timed_pair(lambda: kernel.plain_nested_mlp(x, w1, b1, w2, b2, width),
                                               lambda: kernel.nested_mlp(x, w1, b1, w2, b2, width, **tile),
                                               args.repeats, synchronize)
                rate = 4 * rows * width * args.hidden / kernel_s / 1e12
                lines.append(f"| {width} | {rows} | {label} | {plain_s * 1e3:.3f} | {kernel_s * 1e3:.3f} | "
                             f"{plain_s / kernel_s:.2f}x | {rate:.0f} | {error:.1e} |")
                if tile and (width not in best or kernel_s < best[width][1]):
                    best[width] = (label, kernel_s, plain_s)
    if skipped:
        lines += ["", f"Not timed (--budget {args.budget:g} s spent): " + "; ".join(skipped) + "."]
    if best:
        lines += ["", "Best setting per width (block_rows, block_hidden, num_warps, num_stages):", ""]
        lines += [f"- d = {w}: {label}, {plain_s / s:.2f}x torch's ops" for w, (label, s, plain_s) in best.items()]
        winners = ";".join(f"{w}:{label}" for w, (label, s, plain_s) in best.items() if s < plain_s)
        lines += ["", f'KERAS_MONE_MLP_TILES="{winners}"' if winners else "No setting beat torch's ops."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=196, help="tokens per image (ViT-B/16 at 224: 196)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="time the tile grid SWEEP too")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="stop the sweep after about this long, each width of the kernel an equal share of "
                        "what is left (every width's defaults are still timed); the report names what was not")
    parser.add_argument("--tolerance", type=float, default=2e-2,
                        help="largest error / largest value a setting may show against torch's ops (bf16: 2e-2)")
    args = parser.parse_args(argv)
    if args.budget is not None and not args.budget >= 0:  # (NaN too)
        parser.error(f"--budget must be 0 or more seconds, got {args.budget:g}.")
    return run(args)


if __name__ == "__main__":
    main()
