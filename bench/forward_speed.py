"""Forward-pass wall clock of dense ViT vs MoNE-ViT on the current Keras backend.

    KERAS_BACKEND=jax python bench/forward_speed.py            # ViT-B/16, batch 8, 224
    KERAS_BACKEND=jax python bench/forward_speed.py --write    # also update BENCHMARKS.md

Dense and MoNE models run interleaved in the same process (round-robin over
repeats), so machine noise hits all of them alike; the figures to quote are
the ratios to the dense model of the same run.
"""

import argparse
import os
import platform
import statistics
import sys
import time

import keras
import numpy as np

import keras_mone
from keras_mone.models import decode_variant

HERE = os.path.dirname(os.path.abspath(__file__))


def build(variant, capacity, image_size, num_classes=1000):
    name = ("vit_" if capacity is None else "mone_vit_") + variant.replace("/", "").lower()
    overrides = dict(image_size=image_size, num_classes=num_classes)
    if capacity is not None:
        overrides["capacity"] = capacity
    model = keras_mone.presets.from_preset(name, load_weights=False, **overrides)
    model.compile(jit_compile="auto")
    return model


def time_models(models, images, repeats, warmup):
    for model in models.values():
        for _ in range(warmup):
            model.predict_on_batch(images)
    timings = {label: [] for label in models}
    for _ in range(repeats):
        for label, model in models.items():
            start = time.perf_counter()
            model.predict_on_batch(images)
            timings[label].append(time.perf_counter() - start)
    return timings


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--capacities", default="0.3,0.5,1.0")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="append the table to BENCHMARKS.md")
    args = parser.parse_args(argv)
    decode_variant(args.variant)
    capacities = [float(c) for c in args.capacities.split(",")]
    models = {"dense": build(args.variant, None, args.image_size)}
    for c in capacities:
        models[f"mone e_c={c:g}"] = build(args.variant, c, args.image_size)
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (args.batch_size, args.image_size, args.image_size, 3)).astype("float32")
    timings = time_models(models, images, args.repeats, args.warmup)
    dense_median = statistics.median(timings["dense"])
    flops = getattr(keras_mone, "flops", None)
    dense_flops = flops(models["dense"]).total if flops else None
    rows = []
    for label, times in timings.items():
        median = statistics.median(times)
        spread = (max(times) - min(times)) / median
        speedup = dense_median / median
        row = [label, f"{median * 1e3:.0f}", f"{spread * 100:.0f}%", f"{args.batch_size / median:.1f}", f"{speedup:.2f}x"]
        if flops:
            ratio = dense_flops / flops(models[label]).total
            row += [f"{ratio:.2f}x", f"{speedup / ratio:.2f}"]
        rows.append(row)
    header = ["model", "median ms/batch", "spread", "images/s", "speedup vs dense"]
    if flops:
        header += ["FLOP ratio", "efficiency"]
    table = _markdown_table(header, rows)
    command = (
        f"KERAS_BACKEND={keras.backend.backend()} python bench/forward_speed.py --variant {args.variant} "
        f"--capacities {args.capacities} --batch-size {args.batch_size} --image-size {args.image_size} "
        f"--repeats {args.repeats} --write"
    )
    title = (
        f"### Forward pass, {args.variant} at {args.image_size}x{args.image_size}, batch {args.batch_size}, "
        f"backend {keras.backend.backend()}"
    )
    context = (
        f"{time.strftime('%Y-%m-%d')}, keras {keras.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, {args.repeats} interleaved repeats after {args.warmup} warm-up calls."
    )
    report = f"{title}\n\n`{command}`\n\n{context}\n\n{table}\n"
    print(report)
    if args.write:
        path = os.path.join(HERE, os.pardir, "BENCHMARKS.md")
        with open(path, "a") as f:
            f.write("\n" + report)
    return 0


def _markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
