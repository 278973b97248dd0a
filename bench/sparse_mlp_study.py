"""Sparse-MLP on cluttered digits: with and without the load-balancing loss, with and without Re-represent layers.

Issue 26 item 6. Three variants of ``cluttered_digits_sparse_mlp``, each over
``--seeds`` (one ``keras-mone train`` run directory per variant and seed under
``--output``; a rerun reuses finished runs, and the default ``--output`` is
``bench/new_methods.py``'s, whose ``sparse_mlp_s<seed>`` runs are the
``aux`` variant):

* ``aux``: the recipe (aux loss weight 0.01, Re-represent layers);
* ``no_aux``: ``aux_loss_weight = 0`` (the loss is still computed and logged,
  it just does not train the gates): expert load CV^2 without balancing;
* ``no_rr``: ``re_represent = "none"`` (Table 7's "w/o r_layers"): the sparse
  block runs on the Mixer's ``(S, C)``.

Reports test accuracy, GMACs, expert load CV^2 (max over MoE layers, over the
first 512 test images) and the overflow share, then the Re-represent layers'
MACs and what they change in the sparse blocks for Sparse-S / B / L::

    KERAS_BACKEND=jax python bench/sparse_mlp_study.py --seeds 0,1,2 --epochs 2
"""

import argparse
import json
import os
import statistics

import keras

from keras_mone import flops, presets
from keras_mone.models import SparseMLPBackbone
from new_methods import accuracy, sparse_measures, spread, test_split, train
from training_targets import write_section

SECTION = "## Sparse-MLP: load-balancing loss and Re-represent layers (issue 26)"
#: The digits Sparse-MLP has 64 tokens of 64 channels (Digits/4 at 32x32): without RR the sparse block keeps them.
VARIANTS = {
    "aux": {},
    "no_aux": {"model_args": {"aux_loss_weight": 0.0}},
    "no_rr": {"model_args": {"re_represent": "none", "sparse_tokens": 64, "sparse_hidden_dim": 64}},
}


def run_directory(output, variant, seed):
    return os.path.join(output, "sparse_mlp" + ("" if variant == "aux" else f"_{variant}") + f"_s{seed}")


def re_represent_costs():
    """Per paper size: GMACs of the RR layers and of the sparse blocks with and without them."""
    rows = []
    for name in ("sparse_mlp_s", "sparse_mlp_b", "sparse_mlp_l"):
        config = presets.from_preset(name, load_weights=False).backbone.get_config()
        with_rr = flops(SparseMLPBackbone.from_config(config)).breakdown
        without = flops(SparseMLPBackbone.from_config(
            {**config, "re_represent": "none", "sparse_tokens": None, "sparse_hidden_dim": None}
        )).breakdown
        sparse = ("moe_gates", "token_moe", "channel_moe")
        rows.append(dict(
            name=name, rr=with_rr["re_represent"] / 1e9,
            sparse_with=sum(with_rr[k] for k in sparse) / 1e9, sparse_without=sum(without[k] for k in sparse) / 1e9,
            total_with=sum(with_rr.values()) / 1e9, total_without=sum(without.values()) / 1e9,
        ))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per run (default: the recipe's)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--output", default="runs/new_methods")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    images, labels, _ = test_split()
    extra = {} if args.epochs is None else {"epochs": args.epochs}
    results = {}
    for variant in args.variants.split(","):
        rows = []
        for seed in seeds:
            model = train("cluttered_digits_sparse_mlp", run_directory(args.output, variant, seed), seed=seed,
                          **VARIANTS[variant], **extra)
            rows.append(dict(accuracy=accuracy(model, images, labels), gmacs=flops(model).gmacs,
                             **sparse_measures(model, images)))
        results[variant] = rows
    results["re_represent_costs"] = re_represent_costs()
    with open(os.path.join(args.output, "sparse_mlp_study.json"), "w") as f:
        json.dump(results, f, indent=2)
    write_section(report(results, args, seeds), args.benchmarks, SECTION)


def report(results, args, seeds):
    lines = [
        SECTION, "",
        f"Command: `KERAS_BACKEND={keras.backend.backend()} python bench/sparse_mlp_study.py --seeds {args.seeds}"
        + (f" --epochs {args.epochs}" if args.epochs else "") + "`. 5026 test images; mean +- sd over seeds "
        f"{seeds}; CV^2 and overflow: mean (max) over seeds of the max over MoE layers, first 512 test images.", "",
        "| variant | accuracy % | GMACs | expert load CV^2 | overflow share |", "|---|---|---|---|---|",
    ]
    for variant, rows in results.items():
        if variant == "re_represent_costs":
            continue
        cv2 = [r["load_cv2"] for r in rows]
        over = [r["overflow"] for r in rows]
        lines.append(
            f"| {variant} | {spread([r['accuracy'] for r in rows])} | {rows[0]['gmacs']:.5f} | "
            f"{statistics.mean(cv2):.3f} ({max(cv2):.3f}) | {statistics.mean(over):.1%} ({max(over):.1%}) |"
        )
    lines += [
        "", "What the Re-represent layers cost and save at the paper's sizes (224x224, capacity factor 1.25, "
        "`keras_mone.flops`; one RR pair per sparse block):", "",
        "| model | RR layers GMACs | sparse blocks GMACs with RR | without RR | whole model with RR | without RR |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["re_represent_costs"]:
        lines.append(
            f"| {row['name']} | {row['rr']:.3f} | {row['sparse_with']:.3f} | {row['sparse_without']:.3f} | "
            f"{row['total_with']:.2f} | {row['total_without']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
