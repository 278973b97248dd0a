"""Forward wall clock of MoD / A-MoD ViT against the dense ViT, same run, interleaved (issue 16 speed target).

Skipping whole blocks leaves no thin matmuls, so a MoD-ViT-B/16 at C = 12.5%
should run close to its FLOP ratio faster than the dense model. Models are
compiled ``predict_on_batch`` functions (jit on jax), timed round-robin so
machine noise hits all alike; the figures to quote are ratios::

    KERAS_BACKEND=jax python bench/skip_speed.py --variant B/16 --capacities 0.125,0.5 --batch-size 8
"""

import argparse
import sys

import keras
import numpy as np

from keras_mone import models
from keras_mone.models import decode_variant
from interleaved import TABLE_HEADER, speed_rows, time_models
from training_targets import write_section

SECTION = "## Token skipping: forward speed against dense"


def build(cls, variant, **kwargs):
    model = models.ImageClassifier(cls(**decode_variant(variant), use_class_token=True, **kwargs),
                                   num_classes=1000, pooling="token")
    model.build()
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--capacities", default="0.125,0.5")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    named = {"dense": build(models.ViTBackbone, args.variant)}
    for capacity in [float(c) for c in args.capacities.split(",")]:
        named[f"MoD C={capacity:g}"] = build(models.MoDViTBackbone, args.variant, capacity=capacity)
        named[f"A-MoD C={capacity:g}"] = build(models.AMoDViTBackbone, args.variant, capacity=capacity)
    x = np.random.default_rng(0).normal(size=(args.batch_size, 224, 224, 3)).astype("float32")
    times = time_models(named, x, args.repeats)
    lines = [
        SECTION, "",
        f"Command: `KERAS_BACKEND={keras.backend.backend()} python bench/skip_speed.py --variant {args.variant} "
        f"--capacities {args.capacities} --batch-size {args.batch_size} --repeats {args.repeats}`; 224x224, "
        "compiled `predict_on_batch`, median of interleaved repeats; efficiency = speed-up / FLOP ratio.", "",
        *TABLE_HEADER,
    ]
    lines += speed_rows(named, times, "dense")
    text = "\n".join(lines) + "\n"
    write_section(text, args.benchmarks, SECTION)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
