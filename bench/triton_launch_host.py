"""Host time of torch's Triton launches (issue 40 item 3): the Python of each call of
``kernels.triton_grouped_projection.grouped_projection`` and ``kernels.triton_row_statistics.row_statistics``
before the launch, with Triton's launcher stubbed (its own host time is not counted, and no kernel runs).

An eager MoNE-ViT-B/16 forward with ``$KERAS_MONE_PROJECTIONS=grouped_kernel`` makes 48 projection
calls and 24 statistics calls; at batch 64 on a card its GPU work is a few milliseconds, so
host time per call decides whether the GPU waits. Measured at ViT-B/16's four projections with
MoNE's token groups at ``--capacity``, ``--batch-size`` images (batch 1: the output allocation
is small, so the figure is the wrapper's), rows on this machine's CPU; medians of ``--repeats``
rounds of ``--calls`` calls::

    KERAS_BACKEND=torch python bench/triton_launch_host.py
"""

import argparse
import statistics
import time

from triton_grouped_tiles import group_shapes, projections

from keras_mone.kernels import triton_grouped_projection, triton_grouped_tile, triton_row_statistics


class _Stub:
    """Stands in for a Triton kernel: takes the launch's grid and arguments, runs nothing."""

    def __call__(self, interpret):
        return self

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _median_us(call, calls, repeats):
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
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
    args = parser.parse_args(argv)
    import torch

    triton_grouped_tile.kernel = triton_row_statistics._kernel = _Stub()
    groups = group_shapes(args.capacity, args.tokens, args.dim)
    lines = [f"Host time per call, launch stubbed: MoNE e_c {args.capacity:g}, batch {args.batch_size}, D = "
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
            x, w, b = torch.randn(rows, contraction), torch.randn(contraction, columns), torch.randn(columns)
            options = {}
            if epilogue.get("residual"):
                options["residual"] = torch.randn(rows, columns)
            if epilogue.get("scale"):
                options["scale"] = (torch.rand(rows), torch.tensor(0.5))
            if epilogue.get("norm"):
                options["norm"] = (torch.zeros(rows), torch.ones(rows), torch.ones(contraction), torch.zeros(contraction))
            activation = epilogue.get("activation")

            def call():
                triton_grouped_projection.grouped_projection(x, w, b, spans, widths, side, activation, interpret=True,
                                                             **options)

            lines.append(f"| {label} | {_median_us(call, args.calls, args.repeats):.1f} |")
        x = torch.randn(rows, args.dim)
        lines.append(f"| row statistics | "
                     f"{_median_us(lambda: triton_row_statistics.row_statistics(x, 1e-6, True), args.calls, args.repeats):.1f} |")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
