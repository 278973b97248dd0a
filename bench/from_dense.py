"""Every routed method converted from the shipped dense ``vit_digits``: equal steps, matched GMACs (issue 25 target 1).

For each seed and each target ratio of the dense ViT's GMACs (``--targets``,
default 0.75: MoD / A-MoD at C 0.5, ACM at beta 0.5), every method starts from
the weights of ``vit_digits`` and trains the same number of steps
(``--epochs`` epochs of the CPU recipes' renderings, 179 steps each):

* MoNE (``cluttered_digits_mone_from_dense``, fixed e_c), MoD and A-MoD
  (``cluttered_digits_{mod,amod}_from_dense``, capacity C), each at the
  budget whose GMACs equal the target (bisection on ``keras_mone.flops``);
* ACM in the paper's three phases (``cluttered_digits_acm_convert``: distill,
  gates, end to end; ``--epochs`` split 1 + 1 + rest) and ACM end to end only
  (``cluttered_digits_acm_from_dense``), at the beta whose grouped GMACs equal
  the target, scored in grouped execution (exact beside it).

Writes ``--output``/from_dense.json (after every run) and a BENCHMARKS.md section::

    KERAS_BACKEND=jax python bench/from_dense.py --seeds 0,1,2 --epochs 3
"""

import argparse
import json
import os
import statistics

import keras

from budget_sweep import beta_gmacs, capacity_gmacs, dense_gmacs, probe, solve_budget
from new_methods import accuracy, test_split, train
from keras_mone import flops
from training_targets import write_section

SECTION = "## Every method converted from vit_digits: equal steps, matched GMACs (issue 25)"
CAPACITY_METHODS = {  # method -> (recipe, its routed budget is the capacity)
    "MoNE": "cluttered_digits_mone_from_dense",
    "MoD": "cluttered_digits_mod_from_dense",
    "A-MoD": "cluttered_digits_amod_from_dense",
}
ACM_METHODS = {
    "ACM, 3 phases": "cluttered_digits_acm_convert",
    "ACM, end to end": "cluttered_digits_acm_from_dense",
}


def plan(targets, dense):
    """``{(method, target): (recipe, budget key, budget)}``; targets a method cannot reach are absent."""
    runs = {}
    for target in targets:
        for name, recipe in CAPACITY_METHODS.items():
            capacity = solve_budget(capacity_gmacs(probe(recipe)), target * dense)
            if capacity is not None:
                runs[(name, target)] = (recipe, "capacity", capacity)
        beta = solve_budget(beta_gmacs(probe(ACM_METHODS["ACM, end to end"])), target * dense)
        if beta is not None:
            for name, recipe in ACM_METHODS.items():
                runs[(name, target)] = (recipe, "beta_target", beta)
    return runs


def training_length(recipe, epochs):
    """Recipe overrides giving ``epochs`` epochs in all (three-phase recipes: 1 + 1 + the rest)."""
    if recipe == ACM_METHODS["ACM, 3 phases"]:
        if epochs < 3:
            raise SystemExit("--epochs: the three-phase ACM conversion needs at least 3 epochs")
        return {"phase_epochs": [1, 1, epochs - 2]}
    return {"epochs": epochs}


def score(model, images, labels, acm):
    """Accuracy and GMACs of the trained model; ACM: grouped execution, exact beside it."""
    row = {}
    if acm:
        model.backbone.set_execution("exact")
        row["exact_accuracy"] = accuracy(model, images, labels)
        model.backbone.set_execution("grouped")
    row.update(accuracy=accuracy(model, images, labels), gmacs=flops(model).gmacs)
    return row


def run(args, seeds, targets):
    images, labels, _ = test_split()
    dense = dense_gmacs()
    runs = plan(targets, dense)
    path = os.path.join(args.output, "from_dense.json")
    rows = json.load(open(path))["rows"] if os.path.exists(path) else []
    done = {(r["method"], r["target"], r["seed"]) for r in rows}
    for seed in seeds:
        for (name, target), (recipe, key, budget) in runs.items():
            if (name, target, seed) in done:
                continue
            folder = os.path.join(args.output, f"{name.replace(' ', '_').replace(',', '')}_{target}_s{seed}")
            print(f"seed {seed}: {name} at {target}x dense ({key} {budget}) -> {folder}", flush=True)
            model = train(recipe, folder, seed=seed, **{key: budget}, **training_length(recipe, args.epochs))
            row = score(model, images, labels, acm=key == "beta_target")
            rows.append(dict(method=name, target=target, seed=seed, setting=budget, **row))
            os.makedirs(args.output, exist_ok=True)
            with open(path, "w") as f:
                json.dump(dict(dense_gmacs=dense, rows=rows), f, indent=2)
    return dense, [r for r in rows if r["seed"] in seeds and r["target"] in targets]


def report(rows, dense, args, seeds):
    def spread(values):
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{100 * statistics.mean(values):.2f} +- {100 * sd:.2f}"

    table = {}
    for row in rows:
        table.setdefault((row["target"], row["method"]), []).append(row)
    lines = [
        SECTION, "",
        f"Command: `KERAS_BACKEND={keras.backend.backend()} python bench/from_dense.py --seeds {args.seeds} "
        f"--epochs {args.epochs} --targets {args.targets}`. Every model starts from the shipped `vit_digits` "
        f"(97.59%, {dense:.5f} GMACs) and trains {args.epochs} epochs = {179 * args.epochs} steps of 128 fresh "
        "renderings (ACM 3 phases: 1 distill + 1 gates + the rest end to end); 5026 test images (one image is "
        f"0.02 points); mean +- sample sd over seeds {seeds}. ACM is scored in grouped execution (its static "
        "per-count quotas), exact execution beside it.", "",
        "| target x dense | method | budget | GMACs | x dense | accuracy % | ACM exact % |", "|---|---|---|---|---|---|---|",
    ]
    for (target, method), group in sorted(table.items()):
        gmacs = statistics.mean(r["gmacs"] for r in group)
        exact = spread([r["exact_accuracy"] for r in group]) if "exact_accuracy" in group[0] else "-"
        lines.append(f"| {target} | {method} | {group[0]['setting']} | {gmacs:.5f} | {gmacs / dense:.2f} | "
                     f"{spread([r['accuracy'] for r in group])} | {exact} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=3, help="epochs every method trains (ACM 3 phases: >= 3)")
    parser.add_argument("--targets", default="0.75", help="ratios of the dense GMACs, comma-separated")
    parser.add_argument("--output", default="runs/from_dense")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    targets = [float(t) for t in args.targets.split(",")]
    dense, rows = run(args, seeds, targets)
    text = report(rows, dense, args, seeds)
    write_section(text, args.benchmarks, SECTION)
    print(text)


if __name__ == "__main__":
    main()
