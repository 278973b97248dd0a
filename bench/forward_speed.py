"""Forward-pass wall clock of dense ViT vs MoNE-ViT on the current Keras backend.

A thin wrapper of ``keras_mone.bench.benchmark.run_benchmark`` (the same as
``keras-mone bench --no-train-step``):

    KERAS_BACKEND=jax python bench/forward_speed.py            # ViT-B/16, batch 8, 224
    KERAS_BACKEND=jax python bench/forward_speed.py --write    # also append to BENCHMARKS.md

Any other ``keras-mone bench`` option passes through (``--train-step`` turns
the training-step timing back on). Dense and MoNE models run interleaved in
the same process (round-robin over repeats), so machine noise hits all of
them alike; the figures to quote are the ratios to the dense model of the
same run.
"""

import os
import sys

from keras_mone.cli.main import main as cli_main

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "BENCHMARKS.md")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--write" in argv:
        argv.remove("--write")
        argv += ["--append-benchmarks", os.path.normpath(BENCHMARKS)]
    if "--train-step" in argv:
        argv.remove("--train-step")
    else:
        argv.append("--no-train-step")
    return cli_main(["bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
