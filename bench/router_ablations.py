"""MoNE router ablations at CPU scale (Sec. 6 / Fig. 7, App. A.3); writes BENCHMARKS.md.

1. Trained variants of recipe cluttered_digits_mone at e_c ``--capacity``
   (default 0.3, where routing matters), ``--epochs`` each, per seed of
   ``--seeds``: the router at block 0 (the paper's default), at block 1 or 2
   (Fig. 7a: blocks before it run at full width, so GMACs grow), two routers
   (blocks 0 and 2) or four (every block; Fig. 7b), and the random router
   (Fig. 7c), each evaluated at the capacity it was trained at.
2. Learned-router models evaluated under a random router at the same
   capacities (App. A.3: about 6 points lost on ImageNet-1K), with
   ``keras_mone.analysis.router_ablation``: the block-0 models of step 1 at
   their capacity and the shipped presets mone_vit_digits(_adaptive) at
   e_c 0.2, 0.3 and 0.5, random draws of seeds 0, 1, 2.

Trained runs are kept under ``--output/seed_<s>/<variant>`` and reused by a
later call (``bench/training_targets.py``'s ``run_seed``)::

    KERAS_BACKEND=jax python bench/router_ablations.py --epochs 1 --seeds 0,1
"""

import argparse
import json
import os
import sys
import time

import keras

from keras_mone import presets, recipes
from keras_mone.analysis.router_ablation import learned_vs_random_router
from keras_mone.data.cluttered_digits import source_indices
from training_targets import _mean, _std, run_seed, write_section

SECTION = "## Router ablations: position, number of routers, random router (MoNE Sec. 6, App. A.3)"
VARIANTS = {
    "block0": ("router at block 0 (default)", {}),
    "block1": ("router at block 1", {"model_args": {"router_positions": [1]}}),
    "block2": ("router at block 2", {"model_args": {"router_positions": [2]}}),
    "blocks0_2": ("routers at blocks 0 and 2", {"model_args": {"router_positions": [0, 2]}}),
    "every_block": ("routers at every block", {"model_args": {"router_positions": [0, 1, 2, 3]}}),
    "random": ("random router", {"router_type": "random"}),
}
SHIPPED = ("mone_vit_digits", "mone_vit_digits_adaptive")
RANDOM_SEEDS = (0, 1, 2)


def specs(capacity):
    return {
        name: ("cluttered_digits_mone", {"capacity": capacity, **overrides}, (capacity,))
        for name, (_, overrides) in VARIANTS.items()
    }


def random_router_rows(output, seeds, capacity, x, y, shipped):
    """``{label: records}``: the trained block-0 models, then the ``shipped`` presets, under random routers.

    A shipped preset's records are read from ``--output/shipped_<name>/random_router.json`` when that
    exists (what ``keras-mone analyze random-router <name> --output <that folder>`` writes)."""
    rows = {}
    for seed in seeds:
        path = os.path.join(output, f"seed_{seed}", "block0", "model.keras")
        if os.path.exists(path):
            model = keras.saving.load_model(path, compile=False)
            rows[f"block 0 trained here, seed {seed}"] = learned_vs_random_router(model, x, y, (capacity,), RANDOM_SEEDS)
    for name in shipped:
        cached = os.path.join(output, f"shipped_{name}", "random_router.json")
        if os.path.exists(cached):
            with open(cached) as f:
                rows[name] = json.load(f)["records"]
        else:
            rows[name] = learned_vs_random_router(presets.from_preset(name), x, y, (0.2, 0.3, 0.5), RANDOM_SEEDS)
    return rows


def split_sizes(recipe_name="cluttered_digits_mone"):
    """``(training renderings per epoch, test images)`` of the recipe: its renderings per
    source digit times the fixed split's digit counts (``data.cluttered_digits.source_indices``)."""
    recipe = recipes.resolve(recipe_name)[0]
    return (len(source_indices("train")) * recipe["samples_per_digit"],
            len(source_indices("test")) * recipe["test_samples_per_digit"])


def markdown(records, random_rows, command, capacity):
    seeds = list(records)
    renderings, test_images = split_sizes()
    lines = [
        SECTION, "",
        f"Command: `{command}` (backend {keras.backend.backend()}; recipe cluttered_digits_mone, "
        f"{records[seeds[0]]['epochs']} epoch(s) of {renderings:,} fresh renderings per model, e_c {capacity}; "
        "two cores shared with other jobs, which changes times, not results). Cells: test accuracy on the "
        f"{test_images}-image split (one image is {100 / test_images:.2f} points); std over seeds (sample).", "",
        "| variant | GMACs / image | accuracy per seed | mean | std |",
        "| --- | --- | --- | --- | --- |",
    ]
    key = str(capacity)
    for name, (label, _) in VARIANTS.items():
        have = [s for s in seeds if name in records[s]["models"]]
        if not have:
            continue
        accs = [records[s]["models"][name]["accuracy"][key] for s in have]
        gmacs = records[have[0]]["models"][name]["gmacs"][key]
        cells = ", ".join(f"{100 * a:.1f}% (seed {s})" for s, a in zip(have, accs))
        lines.append(f"| {label} | {gmacs:.5f} | {cells} | {100 * _mean(accs):.1f}% | {100 * _std(accs):.1f} |")
    lines += [
        "", "Learned-router models evaluated under a random router at the same capacity (App. A.3). "
        "`learned`: as trained; `gate 1`: same routing, Eq. 1's gate alpha r + 1 set to 1; `random`: "
        f"random assignment with the same token counts and no gate, mean +- std over draws {list(RANDOM_SEEDS)}:", "",
        "| model | e_c | learned | gate 1 | random | learned - random |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, rows in random_rows.items():
        for r in rows:
            lines.append(
                f"| {label} | {r['capacity']:g} | {100 * r['learned']:.2f}% | {100 * r['learned_no_gate']:.2f}% | "
                f"{100 * r['random_mean']:.2f}% +- {100 * r['random_std']:.2f} | {100 * r['drop']:+.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--output", default="runs/router_ablations")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    parser.add_argument("--shipped", default=",".join(SHIPPED), help="shipped presets evaluated under random routers")
    parser.add_argument("--report-only", action="store_true", help="train nothing; report the models already trained")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.time()
    records = {s: run_seed(
        s, args.epochs, args.output, list(VARIANTS), train=not args.report_only, specs=specs(args.capacity)
    ) for s in seeds}
    print(f"trained in {time.time() - started:.0f} s", flush=True)
    x, y = presets.evaluation_data("mone_vit_digits")
    random_rows = random_router_rows(
        args.output, seeds, args.capacity, x, y, [n for n in args.shipped.split(",") if n]
    )
    with open(os.path.join(args.output, "random_router.json"), "w") as f:
        json.dump(random_rows, f, indent=2)
    command = (
        f"KERAS_BACKEND={keras.backend.backend()} python bench/router_ablations.py --epochs {args.epochs} "
        f"--seeds {args.seeds} --capacity {args.capacity}"
    )
    text = markdown(records, random_rows, command, args.capacity)
    if args.benchmarks != os.devnull:
        write_section(text, args.benchmarks, SECTION)
    print(text)
    print(f"total {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
