"""ACM converted from ``vit_digits``, MLP-Mixer and Sparse-MLP from scratch, on cluttered digits, over seeds.

Trains through the recipes (one ``keras-mone train`` run directory per model
and seed under ``--output``; a rerun reuses finished runs) and reports, on
the 5026-image test split the shipped presets are scored on:

* ACM (``cluttered_digits_acm_from_dense`` at each ``--betas`` value): test
  accuracy in exact execution (every token gets its gate's count) and in
  grouped execution (static quotas from beta, the real savings), the share of
  tokens the quotas moved, GMACs of grouped execution, and the correlation
  between a token's learner count (mean over blocks) and its digit pixels;
* Mixer and Sparse-MLP (``cluttered_digits_mixer`` / ``_sparse_mlp``): test
  accuracy, GMACs, the Sparse-MLP's expert load CV^2 and overflow share.

Writes a BENCHMARKS.md section::

    KERAS_BACKEND=jax python bench/new_methods.py --seeds 0,1,2 --betas 0.25,0.5,0.75
"""

import argparse
import json
import os
import statistics
import sys

import keras
import numpy as np

from keras_mone import flops, presets, recipes
from keras_mone.data import load_cluttered_digits
from keras_mone.models.weights_file import load_saved_model
from training_targets import write_section

SECTION = "## ACM, MLP-Mixer and Sparse-MLP on cluttered digits"


def train(recipe, output, **overrides):
    """Trains ``recipe`` into ``output`` unless a finished run is there; returns the trained model."""
    path = os.path.join(output, "model.keras")
    if not os.path.exists(path):
        recipes.load(recipe, output_dir=output, **overrides).fit(verbose=0)
    return load_saved_model(path, compile=False)


def test_split():
    split = presets.get_preset("vit_digits")["weights"]["eval"]["test_split"]
    images, labels, masks = load_cluttered_digits(**split, return_masks=True)
    return images * 2.0 - 1.0, labels, masks


def accuracy(model, images, labels):
    logits = model.predict(images, batch_size=512, verbose=0)
    return float(np.mean(np.argmax(logits, axis=-1) == labels))


def patch_digit_share(masks, patch):
    n, h, w = masks.shape
    return masks.reshape(n, h // patch, patch, w // patch, patch).mean(axis=(2, 4)).reshape(n, -1)


def acm_measures(model, images, labels, masks):
    backbone = model.backbone
    backbone.set_execution("exact")
    exact = accuracy(model, images, labels)
    backbone.set_execution("grouped")
    grouped = accuracy(model, images, labels)
    gmacs = flops(model).gmacs
    sample = images[:512]
    _, exact_record = backbone_record(backbone, sample, "exact")
    _, grouped_record = backbone_record(backbone, sample, "grouped")
    wanted = np.stack([np.asarray(b["assignment"]) for b in exact_record["blocks"]])
    ran = np.stack([np.asarray(b["assignment"]) for b in grouped_record["blocks"]])
    moved = float(np.mean(wanted != ran))
    counts = wanted.mean(axis=0).reshape(-1)
    digit = patch_digit_share(masks[:512], backbone.patch_size).reshape(-1)
    correlation = float(np.corrcoef(counts, digit)[0, 1])
    backbone.set_execution("exact")
    return dict(exact=exact, grouped=grouped, gmacs=gmacs, moved=moved, correlation=correlation)


def backbone_record(backbone, images, execution):
    backbone.set_execution(execution)
    features, record = backbone(images, return_intermediates=True)
    to_numpy = keras.ops.convert_to_numpy
    return features, {"blocks": [{k: to_numpy(v) for k, v in b.items()} for b in record["blocks"]]}


def sparse_measures(model, images):
    _, record = model.backbone(images[:512], return_intermediates=True)
    to_numpy = keras.ops.convert_to_numpy
    loads, overflow = [], []
    for block in record["moe"]:
        for name in ("token_mixing", "channel_mixing"):
            if name in block:
                counts = to_numpy(block[name]["counts"]).sum(axis=0).astype("float64")
                loads.append(float(np.var(counts) / np.mean(counts) ** 2))
                overflow.append(float(to_numpy(block[name]["overflow"])))
    return dict(load_cv2=max(loads), overflow=max(overflow))


def spread(values):
    mean = 100 * statistics.mean(values)
    sd = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f} +- {sd:.2f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--betas", default="0.25,0.5,0.75")
    parser.add_argument("--acm-samples-per-digit", type=int, default=16, help="ACM training renderings per digit")
    parser.add_argument("--epochs", type=int, default=None, help="Mixer / Sparse-MLP epochs (default: the recipe's)")
    parser.add_argument("--output", default="runs/new_methods")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    betas = [float(b) for b in args.betas.split(",")]
    images, labels, masks = test_split()
    dense = presets.from_preset("vit_digits")
    results = {"dense_vit": dict(accuracy=accuracy(dense, images, labels), gmacs=flops(dense).gmacs)}
    for beta in betas:
        rows = []
        for seed in seeds:
            model = train(
                "cluttered_digits_acm_from_dense", os.path.join(args.output, f"acm_b{beta}_s{seed}"),
                beta_target=beta, seed=seed, samples_per_digit=args.acm_samples_per_digit,
            )
            rows.append(acm_measures(model, images, labels, masks))
        results[f"acm_{beta}"] = rows
    extra = {} if args.epochs is None else {"epochs": args.epochs}
    for name in ("mixer", "sparse_mlp"):
        rows = []
        for seed in seeds:
            model = train(f"cluttered_digits_{name}", os.path.join(args.output, f"{name}_s{seed}"), seed=seed, **extra)
            row = dict(accuracy=accuracy(model, images, labels), gmacs=flops(model).gmacs)
            if name == "sparse_mlp":
                row.update(sparse_measures(model, images))
            rows.append(row)
        results[name] = rows
    with open(os.path.join(args.output, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    write_section(report(results, args, seeds), args.benchmarks, SECTION)


def report(results, args, seeds):
    dense = results["dense_vit"]
    lines = [
        SECTION, "",
        f"Command: `KERAS_BACKEND={keras.backend.backend()} python bench/new_methods.py --seeds {args.seeds} "
        f"--betas {args.betas} --acm-samples-per-digit {args.acm_samples_per_digit}"
        + (f" --epochs {args.epochs}" if args.epochs else "") + "`. "
        f"5026 test images (one image is 0.02 points); mean +- sd over seeds {seeds}. Dense `vit_digits`: "
        f"{100 * dense['accuracy']:.2f}% at {dense['gmacs']:.5f} GMACs.", "",
        "ACM converted from `vit_digits` (learners = slices of its MLPs, gates new), trained end to end for one "
        "epoch of the dense recipe's data at `--acm-samples-per-digit` renderings per digit:", "",
        "| beta | exact accuracy % | grouped accuracy % | grouped GMACs | tokens moved by quotas | corr(learners, digit pixels) |",
        "|---|---|---|---|---|---|",
    ]
    for key, rows in results.items():
        if key.startswith("acm_"):
            lines.append(
                f"| {key[4:]} | {spread([r['exact'] for r in rows])} | {spread([r['grouped'] for r in rows])} | "
                f"{rows[0]['gmacs']:.5f} | {statistics.mean(r['moved'] for r in rows):.1%} | "
                f"{statistics.mean(r['correlation'] for r in rows):+.3f} |"
            )
    lines += [
        "", "MLP-Mixer and Sparse-MLP from scratch (the dense ViT recipe's data and schedule):", "",
        "| model | accuracy % | GMACs | expert load CV^2 (max over MoE layers) | overflow share |", "|---|---|---|---|---|",
    ]
    for name in ("mixer", "sparse_mlp"):
        rows = results[name]
        cv2 = f"{max(r['load_cv2'] for r in rows):.3f}" if "load_cv2" in rows[0] else "-"
        over = f"{max(r['overflow'] for r in rows):.1%}" if "overflow" in rows[0] else "-"
        lines.append(f"| {name} | {spread([r['accuracy'] for r in rows])} | {rows[0]['gmacs']:.5f} | {cv2} | {over} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
