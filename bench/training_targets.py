"""Issue-5 training targets on cluttered digits with the CPU recipes, over seeds; writes BENCHMARKS.md.

For every recipe seed of ``--seeds`` it trains seven models with the recipes
cluttered_digits_{vit,mone,mone_adaptive} (the quickstart's sizes and schedule):

1. the dense ViT and MoNE trained at e_c 0.5: test accuracy and GMACs;
2. the learned vs the random router, both trained and evaluated at e_c 0.2
   (MoNE Fig. 7c; the learned one is the fixed model of 3 at 0.2);
3. one adaptive-capacity model (MoNE Sec. 5; mode "adaptive_isoflops": e_c
   drawn per step from 0.15..0.95, the dense model's training MACs) vs the
   models trained at a fixed e_c, evaluated at e_c 0.2, 0.3, 0.5 and 0.75.

Training noise at this scale is several points, so each target is read off the
mean over seeds. Every trained model's accuracies are saved to
``--output/seed_<s>/accuracies.json`` as soon as it is evaluated, and a later
run with the same epochs and backend reuses them (``--retrain`` overrides), so
seeds can run in parallel processes (one per core) and one last call writes the
section "Training targets (issue 5)" of BENCHMARKS.md::

    KERAS_BACKEND=jax python bench/training_targets.py --seeds 0,2 --benchmarks /dev/null &
    KERAS_BACKEND=jax python bench/training_targets.py --seeds 1,3 --benchmarks /dev/null &
    wait; KERAS_BACKEND=jax python bench/training_targets.py --seeds 0,1,2,3
"""

import argparse
import json
import os
import sys
import time

import keras

from keras_mone import recipes
from keras_mone.analysis import flops

CAPACITIES = (0.2, 0.3, 0.5, 0.75)
SECTION = "## Training targets (issue 5)"


def model_specs():
    """``{model name: (recipe, overrides, capacities it is evaluated at)}`` of one seed."""
    specs = {
        "dense": ("cluttered_digits_vit", {}, (1.0,)),
        "random_0.2": ("cluttered_digits_mone", {"capacity": 0.2, "router_type": "random"}, (0.2,)),
        "adaptive": ("cluttered_digits_mone_adaptive", {}, CAPACITIES),
    }
    for capacity in CAPACITIES:
        specs[f"mone_{capacity}"] = ("cluttered_digits_mone", {"capacity": capacity}, (capacity,))
    return specs


def train_and_evaluate(recipe, overrides, capacities, output, epochs, seed):
    """``{capacity: accuracy}``, ``{capacity: GMACs}`` and the epochs trained."""
    setup = recipes.load(recipe, resume=False, epochs=epochs, output_dir=output, seed=seed, **overrides)
    started = time.time()
    setup.fit(verbose=0)
    print(f"  seed {seed} {recipe} {overrides}: {time.time() - started:.0f} s", flush=True)
    accuracy, gmacs = {}, {}
    for capacity in capacities:
        if capacity != 1.0:
            setup.model.set_capacity(capacity)
        metrics = setup.model.evaluate(setup.eval_data, verbose=0, return_dict=True)
        accuracy[str(capacity)] = float(metrics["accuracy"])
        gmacs[str(capacity)] = flops(setup.model).gmacs
    return dict(accuracy=accuracy, gmacs=gmacs, epochs=setup.epochs)


def run_seed(seed, epochs, output, reuse=True):
    """Trains (or reuses) every model of ``seed``; returns its record."""
    directory = os.path.join(output, f"seed_{seed}")
    path = os.path.join(directory, "accuracies.json")
    record = dict(backend=keras.backend.backend(), epochs=epochs, models={})
    if reuse and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if (saved["backend"], saved["epochs"]) == (record["backend"], epochs):
            record = saved
    for name, (recipe, overrides, capacities) in model_specs().items():
        if name in record["models"]:
            print(f"  seed {seed} {name}: reusing {path}", flush=True)
            continue
        record["models"][name] = train_and_evaluate(
            recipe, overrides, capacities, os.path.join(directory, name), epochs, seed
        )
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
    return record


def _mean(values):
    return sum(values) / len(values)


def markdown(records, command):
    seeds = list(records)
    models = {s: records[s]["models"] for s in seeds}

    def acc(seed, name, capacity):
        return 100 * models[seed][name]["accuracy"][str(capacity)]

    first = models[seeds[0]]
    dense_gmacs, mone_gmacs = first["dense"]["gmacs"]["1.0"], first["mone_0.5"]["gmacs"]["0.5"]
    seed_cols = " | ".join(f"seed {s}" for s in seeds)
    lines = [
        SECTION, "",
        f"Command: `{command}` (backend {records[seeds[0]]['backend']}; recipes `cluttered_digits_*`, "
        f"{records[seeds[0]]['epochs']} epochs per model, the adaptive model "
        f"{first['adaptive']['epochs']} epochs (mode adaptive_isoflops: the dense model's training MACs); "
        "recipe `seed` sets the initial weights, the rendered images, the data order and the routers' draws). "
        "Cells are test accuracy (718 test images: one image is 0.14 points).", "",
        f"Target 1, MoNE at e_c 0.5 ({mone_gmacs:.5f} GMACs, {mone_gmacs / dense_gmacs:.2f}x) vs the dense ViT "
        f"({dense_gmacs:.5f} GMACs):", "",
        f"| model | {seed_cols} | mean |", "| --- |" + " --- |" * (len(seeds) + 1),
    ]
    for label, name, c in (("dense ViT", "dense", 1.0), ("MoNE-ViT, e_c 0.5", "mone_0.5", 0.5)):
        values = [acc(s, name, c) for s in seeds]
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}%" for v in values) + f" | {_mean(values):.1f}% |")
    diffs = [acc(s, "mone_0.5", 0.5) - acc(s, "dense", 1.0) for s in seeds]
    lines.append("| difference | " + " | ".join(f"{d:+.1f}" for d in diffs) + f" | {_mean(diffs):+.1f} |")
    lines += ["", "Target 2, learned vs random router, trained and evaluated at e_c 0.2:", "",
              f"| router | {seed_cols} | mean |", "| --- |" + " --- |" * (len(seeds) + 1)]
    for label, name in (("learned", "mone_0.2"), ("random", "random_0.2")):
        values = [acc(s, name, 0.2) for s in seeds]
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}%" for v in values) + f" | {_mean(values):.1f}% |")
    lines += [
        "", "Target 3, one adaptive model vs a model trained at each fixed e_c (cells: adaptive / fixed):", "",
        f"| e_c | {seed_cols} | mean adaptive | mean fixed | mean difference |",
        "| --- |" + " --- |" * (len(seeds) + 3),
    ]
    for c in CAPACITIES:
        adaptive = [acc(s, "adaptive", c) for s in seeds]
        fixed = [acc(s, f"mone_{c}", c) for s in seeds]
        cells = " | ".join(f"{a:.1f}% / {f:.1f}%" for a, f in zip(adaptive, fixed))
        lines.append(
            f"| {c} | {cells} | {_mean(adaptive):.1f}% | {_mean(fixed):.1f}% | {_mean(adaptive) - _mean(fixed):+.1f} |"
        )
    return "\n".join(lines) + "\n"


def write_section(text, path="BENCHMARKS.md", section=SECTION):
    """Replaces ``section`` of ``path`` (up to the next ``## ``) with ``text``, or appends it."""
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    start = old.find(section)
    if start >= 0:
        end = old.find("\n## ", start + len(section))
        old = old[:start].rstrip("\n") + ("\n\n" + old[end + 1:] if end >= 0 else "\n")
    with open(path, "w") as f:
        f.write(old.rstrip("\n") + "\n\n" + text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12, help="epochs per model (recipe: 12)")
    parser.add_argument("--seeds", default="0", help="recipe seeds, e.g. 0,1,2,3")
    parser.add_argument("--output", default="runs/training_targets")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    parser.add_argument("--retrain", action="store_true", help="retrain models already saved in --output")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    records = {str(s): run_seed(s, args.epochs, args.output, reuse=not args.retrain) for s in seeds}
    command = (
        f"KERAS_BACKEND={keras.backend.backend()} python bench/training_targets.py --epochs {args.epochs} "
        f"--seeds {args.seeds}"
    )
    text = markdown(records, command)
    if args.benchmarks != os.devnull:
        write_section(text, args.benchmarks)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
