"""Issue 28's router analyses on the shipped presets, one markdown table each (BENCHMARKS.md).

Usage:
    KERAS_BACKEND=jax python bench/router_analyses.py [--importance-images 256] [--extra NAME=MODEL.keras ...]

1. argmax routing (MoNE App. A.3): Spearman of per-image argmax compute with per-image loss, full test split;
2. leave-one-out importance against the router's score (first ``--importance-images`` test images);
3. budget: the capacity ``capacity_for_budget`` picks for GMACs and latency targets set as shares of the
   dense ``vit_digits`` (measured in the same process), then the chosen model timed against the dense one
   interleaved (``bench/interleaved.py``), as a ratio.

``--extra`` adds models that ship no weights (e.g. a MoD run of ``keras-mone train
cluttered_digits_mod_from_dense``), scored on ``vit_digits``'s test split.
"""

import argparse
import os
import sys
import time

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from interleaved import time_models  # noqa: E402

from keras_mone import flops  # noqa: E402
from keras_mone.analysis import argmax_difficulty, capacity_for_budget, importance_vs_score  # noqa: E402
from keras_mone.presets import evaluation_data, from_preset  # noqa: E402

ROUTED = ["mone_vit_digits", "mone_vit_digits_adaptive", "acm_vit_digits"]


def load(spec):
    if spec.endswith(".keras"):
        return keras.saving.load_model(spec, compile=False)
    return from_preset(spec)


def argmax_rows(models, data):
    rows = ["| model | e_c | examples | Spearman(compute, loss) | Spearman(compute, error) | mean compute correct / wrong |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, model in models.items():
        x, y = data[name]
        try:
            s = argmax_difficulty(model, x, y)
        except ValueError as error:
            rows.append(f"| {name} | | | n/a: {str(error).split(';')[0]} | | |")
            continue
        rows.append(f"| {name} | {model.capacity} | {s['examples']} | {s['spearman_compute_loss']:+.3f} | "
                    f"{s['spearman_compute_error']:+.3f} | {s['mean_compute_correct']:.3f} / {s['mean_compute_wrong']:.3f} |")
        print(rows[-1], flush=True)
    return rows


def importance_rows(models, data, count):
    rows = ["| model | images | Spearman per image (mean +- sd) | pooled | of abs(loss change): per image / pooled | "
            "top-quarter overlap (chance 0.25) |", "| --- | --- | --- | --- | --- | --- |"]
    for name, model in models.items():
        x, y = data[name]
        started = time.perf_counter()
        _, _, s = importance_vs_score(model, x[:count], y[:count])
        rows.append(f"| {name} | {s['examples']} | {s['spearman_per_image_mean']:+.3f} +- {s['spearman_per_image_std']:.3f} | "
                    f"{s['spearman_pooled']:+.3f} | {s['spearman_magnitude_per_image_mean']:+.3f} / "
                    f"{s['spearman_magnitude_pooled']:+.3f} | {s['top_quarter_overlap']:.3f} |")
        print(rows[-1], f"({time.perf_counter() - started:.0f} s)", flush=True)
    return rows


def budget_rows(name, shares, batch=256, repeats=15):
    model, dense = from_preset(name), from_preset("vit_digits")
    x, _ = evaluation_data(name)
    x = x[:batch]
    dense_gmacs = flops(dense).gmacs
    dense_time = float(np.median(time_models({"dense": dense}, x, repeats)["dense"]))
    rows = ["| target | chosen e_c | its cost | GMACs (x dense) | measured vs dense, interleaved (speed-up) |",
            "| --- | --- | --- | --- | --- |"]
    for kind, share in shares:
        target = dict(gmacs=share * dense_gmacs) if kind == "gmacs" else dict(latency=share * dense_time, inputs=x)
        label = f"{share:g} x dense {'GMACs' if kind == 'gmacs' else 'latency'}"
        try:
            choice = capacity_for_budget(model, repeats=repeats, **target)
        except ValueError as error:  # no capacity fits: say so in the table
            rows.append(f"| {label} | none fits | {error} | | |")
            print(rows[-1], flush=True)
            continue
        times = time_models({"dense": dense, "chosen": model}, x, repeats)
        speedup = np.median(times["dense"]) / np.median(times["chosen"])
        unit = f"{1000 * choice['cost']:.1f} ms / {batch}" if kind == "latency" else f"{choice['cost']:.5f} GMACs"
        rows.append(f"| {label} | {choice['capacity']:g} | {unit} | {choice['gmacs']:.5f} ({choice['gmacs'] / dense_gmacs:.2f}x) "
                    f"| {speedup:.2f}x |")
        print(rows[-1], flush=True)
    return rows, dense_time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--importance-images", type=int, default=256)
    parser.add_argument("--extra", action="append", default=[], metavar="NAME=MODEL.keras")
    parser.add_argument("--skip", default="", help="comma list of argmax,importance,budget to skip")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    models = {name: from_preset(name) for name in ROUTED}
    data = {name: evaluation_data(name) for name in ROUTED}
    for spec in args.extra:
        name, path = spec.split("=", 1)
        models[name], data[name] = load(path), evaluation_data("vit_digits")
    print(f"backend {keras.backend.backend()}, {time.strftime('%Y-%m-%d')}", flush=True)
    if "argmax" not in skip:
        print("\n".join(argmax_rows(models, data)), flush=True)
    if "importance" not in skip:
        print("\n".join(importance_rows(models, data, args.importance_images)), flush=True)
    if "budget" not in skip:
        rows, dense_time = budget_rows(
            "mone_vit_digits_adaptive", [("gmacs", 0.6), ("gmacs", 0.4), ("latency", 0.8), ("latency", 0.6)]
        )
        print(f"dense vit_digits: {1000 * dense_time:.1f} ms per batch of 256\n" + "\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
