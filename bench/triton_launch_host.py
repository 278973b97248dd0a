"""Host time of torch's Triton launches (issue 40 item 3): the Python of each call of
``kernels.triton_grouped_projection.grouped_projection`` and ``kernels.triton_row_statistics.row_statistics``
before the launch, with Triton's launcher stubbed (its own host time is not counted, and no kernel runs);
with ``--launch`` on a CUDA card, whole calls, Triton's launcher and the kernels included (at
batch 1 each kernel takes a few microseconds, so the figure is mostly host time).

An eager MoNE-ViT-B/16 forward with ``$KERAS_MONE_PROJECTIONS=grouped_kernel`` makes 48 projection
calls and 24 statistics calls; at batch 64 on a card its GPU work is a few milliseconds, so
host time per call decides whether the GPU waits. Measured at ViT-B/16's four projections with
MoNE's token groups at ``--capacity``, ``--batch-size`` images (batch 1: the output allocation
is small, so the figure is the wrapper's), rows on this machine's CPU; medians of ``--repeats``
rounds of ``--calls`` calls::

    KERAS_BACKEND=torch python bench/triton_launch_host.py
    KERAS_BACKEND=torch python bench/triton_launch_host.py --launch      # a CUDA card
"""

import argparse
import statistics
import time

from torch_op_count import TritonLaunches
from triton_grouped_tiles import group_shapes, projections

from keras_mone.kernels import triton_grouped_projection, triton_grouped_tile, triton_row_statistics


def _median_us(call, calls, repeats, synchronize):
    call()  # (a launch compiles the kernel first)
    synchronize()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize()
        rounds.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(rounds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=197)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--launch", action="store_true", help="launch the kernels (a CUDA card): whole calls")
    args = parser.parse_args(argv)
    import torch

    if args.launch and not torch.cuda.is_available():
        parser.error("--launch needs a CUDA card")
    if not args.launch:
        triton_grouped_tile.kernel = triton_row_statistics._kernel = TritonLaunches()  # (counts, runs nothing)
    on = {"device": "cuda" if args.launch else "cpu"}  # (not torch.set_default_device: a mode on every op)
    synchronize = torch.cuda.synchronize if args.launch else (lambda: None)
    interpret = not args.launch
    groups = group_shapes(args.capacity, args.tokens, args.dim)
    what = f"whole calls on {torch.cuda.get_device_name()}" if args.launch else "launch stubbed, this CPU"
    lines = [f"Host time per call ({what}): MoNE e_c {args.capacity:g}, batch {args.batch_size}, D = "
             f"{args.dim}, torch {torch.__version__}\n", "| call | us per call |", "|---|---|"]
    rows = sum(tokens for tokens, _ in groups) * args.batch_size
    with torch.no_grad():
        for label, side, contraction, columns, epilogue in projections(args.dim, 4 * args.dim):
            limit = contraction if side == "in" else columns
            spans, widths, start = [], [], 0
            for tokens, width in groups:
                spans.append((start, start + tokens * args.batch_size))
                widths.append(min(width, limit))
                start += tokens * args.batch_size
            x, w, b = (torch.randn(*shape, **on) for shape in ((rows, contraction), (contraction, columns), (columns,)))
            options = {}
            if epilogue.get("residual"):
                options["residual"] = torch.randn(rows, columns, **on)
            if epilogue.get("scale"):
                options["scale"] = (torch.rand(rows, **on), torch.tensor(0.5, **on))
            if epilogue.get("norm"):
                options["norm"] = (torch.zeros(rows, **on), torch.ones(rows, **on), torch.ones(contraction, **on),
                                   torch.zeros(contraction, **on))
            activation = epilogue.get("activation")

            def call():
                triton_grouped_projection.grouped_projection(x, w, b, spans, widths, side, activation,
                                                             interpret=interpret, **options)

            lines.append(f"| {label} | {_median_us(call, args.calls, args.repeats, synchronize):.1f} |")
        x = torch.randn(rows, args.dim, **on)
        statistics_us = _median_us(lambda: triton_row_statistics.row_statistics(x, 1e-6, interpret), args.calls,
                                   args.repeats, synchronize)
        lines.append(f"| row statistics | {statistics_us:.1f} |")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
