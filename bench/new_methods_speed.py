"""Forward wall clock of ACM-ViT (grouped), MLP-Mixer and Sparse-MLP against dense models, one interleaved run.

Targets (issues 25, 26): ACM-ViT-B/16 in grouped execution at beta 0.5 runs
at least 0.8 of its FLOP ratio faster than the dense ViT-B/16; Mixer-B/16
within 10% of the dense ViT-B/16's time per GMAC; Sparse-MLP-B against the
Mixer-B/16, efficiency reported. Models are compiled ``predict_on_batch``
functions, timed round-robin so machine noise hits all alike; quote ratios::

    KERAS_BACKEND=jax python bench/new_methods_speed.py --betas 0.25,0.5 --batch-size 8
"""

import argparse
import sys

import keras
import numpy as np

from keras_mone import flops
from keras_mone.methods.registry import architectures
from interleaved import TABLE_HEADER, speed_rows, time_models
from training_targets import write_section

SECTION = "## ACM, Mixer and Sparse-MLP: forward speed against dense"


def build(architecture, variant, **kwargs):
    entry = architectures()[architecture]
    model = entry.task(entry.build_backbone(**entry.decode_variant(variant), **kwargs), num_classes=1000)
    model.build()
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--betas", default="0.25,0.5")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    named = {"ViT-B/16 (dense)": build("vit", "B/16")}
    for beta in [float(b) for b in args.betas.split(",")]:
        named[f"ACM-ViT-B/16 grouped beta={beta:g}"] = build("acm_vit", "B/16", beta=beta, execution="grouped")
    named["Mixer-B/16"] = build("mixer", "B/16")
    named["Sparse-MLP-B"] = build("sparse_mlp", "B/16")
    x = np.random.default_rng(0).normal(size=(args.batch_size, 224, 224, 3)).astype("float32")
    times = time_models(named, x, args.repeats)
    lines = [
        SECTION, "",
        f"Command: `KERAS_BACKEND={keras.backend.backend()} python bench/new_methods_speed.py --betas {args.betas} "
        f"--batch-size {args.batch_size} --repeats {args.repeats}`; 224x224, compiled `predict_on_batch`, median "
        "of interleaved repeats; speed-up and FLOP ratio against the dense ViT-B/16; efficiency = speed-up / FLOP "
        "ratio (1.0 = time per GMAC of the dense ViT).", "",
        *TABLE_HEADER,
    ]
    lines += speed_rows(named, times, "ViT-B/16 (dense)")
    mixer, sparse = "Mixer-B/16", "Sparse-MLP-B"
    mixer_ratio = flops(named[mixer]).total / flops(named[sparse]).total
    mixer_speedup = np.median(times[mixer]) / np.median(times[sparse])
    lines += ["", f"Sparse-MLP-B against Mixer-B/16: FLOP ratio {mixer_ratio:.2f}x, speed-up {mixer_speedup:.2f}x, "
              f"efficiency {mixer_speedup / mixer_ratio:.2f}."]
    text = "\n".join(lines) + "\n"
    write_section(text, args.benchmarks, SECTION)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
