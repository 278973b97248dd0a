"""Forward wall clock of ACM-ViT-B/16 with ACM on the MLPs and the Q, K, V, O projections, against dense.

Issue 25 item 3 target: grouped inference at beta 0.5, 224x224, batch 8,
jax, speed-up over the dense ViT-B/16 in one interleaved run, efficiency
(speed-up / FLOP ratio) at least 0.8. The MLP-only ACM runs beside them for
comparison. Gates are untrained: grouped execution's cost is fixed by the
static quotas from beta, whatever the gates choose. Quote ratios::

    KERAS_BACKEND=jax python bench/acm_projections_speed.py --beta 0.5 --batch-size 8 --repeats 7
"""

import argparse
import sys

import keras
import numpy as np

from interleaved import TABLE_HEADER, speed_rows, time_models
from new_methods_speed import build
from training_targets import write_section

SECTION = "## ACM on the MLPs and projections: forward speed against dense"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    dense = f"ViT-{args.variant} (dense)"
    named = {dense: build("vit", args.variant)}
    for projections, label in ((False, "MLP"), (True, "MLP + projections")):
        named[f"ACM-ViT-{args.variant} grouped beta={args.beta:g}, {label}"] = build(
            "acm_vit", args.variant, beta=args.beta, execution="grouped", acm_projections=projections
        )
    x = np.random.default_rng(0).normal(size=(args.batch_size, 224, 224, 3)).astype("float32")
    times = time_models(named, x, args.repeats)
    lines = [
        SECTION, "",
        f"Command: `KERAS_BACKEND={keras.backend.backend()} python bench/acm_projections_speed.py --beta {args.beta:g} "
        f"--batch-size {args.batch_size} --repeats {args.repeats}`; 224x224, compiled `predict_on_batch`, median of "
        "interleaved repeats on a shared 2-core CPU; speed-up and FLOP ratio against the dense model; efficiency = "
        "speed-up / FLOP ratio (1.0 = the dense model's time per GMAC). GMACs count the gates "
        "(`keras_mone.methods.acm.flops`).", "",
        *TABLE_HEADER,
    ]
    lines += speed_rows(named, times, dense)
    text = "\n".join(lines) + "\n"
    write_section(text, args.benchmarks, SECTION)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
