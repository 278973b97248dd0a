"""Issue-5 training targets on cluttered digits with the CPU recipes; appends to BENCHMARKS.md.

1. MoNE trained at e_c 0.5 vs the dense ViT: test accuracy and GMACs.
2. Learned vs random router, both trained and evaluated at e_c 0.2 (MoNE Fig. 7c).
3. One adaptive-capacity model (MoNE Sec. 5; recipe mode "adaptive_isoflops":
   the dense model's training MACs, as in the paper) vs models trained at a
   fixed e_c for the recipe's epochs, evaluated at e_c 0.2, 0.3, 0.5 and 0.75.

    KERAS_BACKEND=jax nice -n 10 python bench/training_targets.py [--epochs N] [--output runs/training_targets]
    KERAS_BACKEND=jax python bench/training_targets.py --only-adaptive --seeds 0,1

``--only-adaptive`` runs comparison 3 alone, once per recipe seed of
``--seeds`` (training noise at this scale is several points), and writes the
section "Adaptive vs fixed capacity over seeds (issue 5)" with every seed's
accuracies and their mean. A seed already run into ``--output`` is reused
(``--retrain`` overrides), so seeds can run in parallel processes::

    KERAS_BACKEND=jax python bench/training_targets.py --only-adaptive --seeds 0,2 --benchmarks /dev/null &
    KERAS_BACKEND=jax python bench/training_targets.py --only-adaptive --seeds 1,3 --benchmarks /dev/null &
    wait; KERAS_BACKEND=jax python bench/training_targets.py --only-adaptive --seeds 0,1,2,3

Every model uses the recipes cluttered_digits_{vit,mone,mone_adaptive}
(the quickstart's sizes and schedule). Writes results.json to --output and the
section "Training targets (issue 5)" to BENCHMARKS.md (replacing an old one).
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
SEEDS_SECTION = "## Adaptive vs fixed capacity over seeds (issue 5)"


def train(name, output, epochs, **overrides):
    setup = recipes.load(name, resume=False, epochs=epochs, output_dir=output, **overrides)
    started = time.time()
    setup.fit(verbose=0)
    print(f"  {name} {overrides}: {time.time() - started:.0f} s", flush=True)
    return setup


def accuracy_at(setup, capacity=None):
    model = setup.model
    if capacity is not None:
        model.set_capacity(capacity)
    metrics = model.evaluate(setup.eval_data, verbose=0, return_dict=True)
    return dict(capacity=capacity or 1.0, accuracy=float(metrics["accuracy"]), gmacs=flops(model).gmacs)


def run(epochs, output):
    results = {"backend": keras.backend.backend(), "epochs": epochs}
    dense = train("cluttered_digits_vit", os.path.join(output, "dense"), epochs)
    results["dense"] = accuracy_at(dense)
    mone = train("cluttered_digits_mone", os.path.join(output, "mone_0.5"), epochs, capacity=0.5)
    results["mone_0.5"] = accuracy_at(mone, 0.5)
    routers, fixed = {}, {0.5: mone}
    for router in ("learned", "random"):
        setup = train("cluttered_digits_mone", os.path.join(output, f"{router}_0.2"), epochs, capacity=0.2, router_type=router)
        routers[router] = accuracy_at(setup, 0.2)
        if router == "learned":
            fixed[0.2] = setup  # also the fixed-capacity model at 0.2
    results["router_at_0.2"] = routers
    adaptive = train("cluttered_digits_mone_adaptive", os.path.join(output, "adaptive"), epochs)
    results["adaptive_epochs"] = adaptive.epochs
    for capacity in CAPACITIES:
        if capacity not in fixed:
            fixed[capacity] = train("cluttered_digits_mone", os.path.join(output, f"mone_{capacity}"), epochs, capacity=capacity)
    results["adaptive_vs_fixed"] = [
        dict(capacity=c, adaptive=accuracy_at(adaptive, c)["accuracy"], fixed=accuracy_at(fixed[c], c)["accuracy"],
             gmacs=accuracy_at(fixed[c], c)["gmacs"])
        for c in CAPACITIES
    ]
    return results


def run_adaptive_over_seeds(epochs, output, seeds, reuse=True):
    """Comparison 3 for every recipe seed: ``{seed: {capacity: (adaptive, fixed)}}``.

    Each seed's accuracies are saved to ``output/seed_<s>/accuracies.json`` as
    soon as its five models are evaluated; with ``reuse`` a later call with the
    same ``epochs`` reads them back instead of retraining, so seeds can run in
    separate processes (one per core) and one last call writes the joint table.
    """
    results = {"backend": keras.backend.backend(), "epochs": epochs, "seeds": {}}
    for seed in seeds:
        directory = os.path.join(output, f"seed_{seed}")
        saved = os.path.join(directory, "accuracies.json")
        if reuse and os.path.exists(saved):
            with open(saved) as f:
                record = json.load(f)
            if record["epochs"] == epochs and record["backend"] == results["backend"]:
                print(f"  seed {seed}: reusing {saved}", flush=True)
                results["adaptive_epochs"] = record["adaptive_epochs"]
                results["seeds"][str(seed)] = record["rows"]
                continue
        adaptive = train("cluttered_digits_mone_adaptive", os.path.join(directory, "adaptive"), epochs, seed=seed)
        rows = {}
        for capacity in CAPACITIES:
            fixed = train(
                "cluttered_digits_mone", os.path.join(directory, f"mone_{capacity}"), epochs,
                capacity=capacity, seed=seed,
            )
            rows[str(capacity)] = dict(
                adaptive=accuracy_at(adaptive, capacity)["accuracy"], fixed=accuracy_at(fixed, capacity)["accuracy"]
            )
        record = dict(backend=results["backend"], epochs=epochs, adaptive_epochs=adaptive.epochs, rows=rows)
        os.makedirs(directory, exist_ok=True)
        with open(saved, "w") as f:
            json.dump(record, f, indent=2)
        results["adaptive_epochs"] = adaptive.epochs
        results["seeds"][str(seed)] = rows
    return results


def seeds_markdown(results, command):
    seeds = list(results["seeds"])
    lines = [
        SEEDS_SECTION, "",
        f"Command: `{command}` (backend {results['backend']}; per seed one adaptive model, mode "
        f"adaptive_isoflops, {results['adaptive_epochs']} epochs, and one model trained at each e_c for "
        f"{results['epochs']} epochs; recipe `seed` sets the initial weights, the rendered images, the data order and the "
        "routers' draws).", "",
        "| e_c | " + " | ".join(f"adaptive / fixed, seed {s}" for s in seeds) + " | mean adaptive | mean fixed | mean difference |",
        "| --- |" + " --- |" * (len(seeds) + 3),
    ]
    for capacity in CAPACITIES:
        pairs = [results["seeds"][s][str(capacity)] for s in seeds]
        mean_a = sum(p["adaptive"] for p in pairs) / len(pairs)
        mean_f = sum(p["fixed"] for p in pairs) / len(pairs)
        cells = " | ".join(f"{100 * p['adaptive']:.1f}% / {100 * p['fixed']:.1f}%" for p in pairs)
        lines.append(
            f"| {capacity} | {cells} | {100 * mean_a:.1f}% | {100 * mean_f:.1f}% | {100 * (mean_a - mean_f):+.1f} |"
        )
    return "\n".join(lines) + "\n"


def markdown(results, command):
    d, m = results["dense"], results["mone_0.5"]
    lines = [
        SECTION, "",
        f"Command: `{command}` (backend {results['backend']}, {results['epochs']} epochs per model, "
        "recipes `cluttered_digits_*`).", "",
        "| model | e_c | test accuracy | GMACs | vs dense |", "| --- | --- | --- | --- | --- |",
        f"| dense ViT | 1.0 | {100 * d['accuracy']:.1f}% | {d['gmacs']:.5f} | 1.00x |",
        f"| MoNE-ViT | 0.5 | {100 * m['accuracy']:.1f}% | {m['gmacs']:.5f} | {m['gmacs'] / d['gmacs']:.2f}x |",
        "", "Learned vs random router, trained and evaluated at e_c 0.2:", "",
        "| router | test accuracy | GMACs |", "| --- | --- | --- |",
    ]
    for router, r in results["router_at_0.2"].items():
        lines.append(f"| {router} | {100 * r['accuracy']:.1f}% | {r['gmacs']:.5f} |")
    lines += [
        "",
        f"One adaptive-capacity model (e_c drawn per step from 0.15..0.95, {results['adaptive_epochs']} epochs: "
        f"the dense model's training MACs, mode adaptive_isoflops) vs a model trained at each e_c "
        f"({results['epochs']} epochs):", "",
        "| e_c | adaptive | fixed | GMACs |", "| --- | --- | --- | --- |",
    ]
    for r in results["adaptive_vs_fixed"]:
        lines.append(f"| {r['capacity']} | {100 * r['adaptive']:.1f}% | {100 * r['fixed']:.1f}% | {r['gmacs']:.5f} |")
    return "\n".join(lines) + "\n"


def write_section(text, path="BENCHMARKS.md", section=SECTION):
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
    parser.add_argument("--output", default="runs/training_targets")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    parser.add_argument("--only-adaptive", action="store_true", help="run comparison 3 alone, per seed")
    parser.add_argument("--seeds", default="0", help="recipe seeds of --only-adaptive, e.g. 0,1")
    parser.add_argument(
        "--retrain", action="store_true",
        help="--only-adaptive: retrain seeds whose accuracies.json exists in --output (default: reuse them)",
    )
    args = parser.parse_args(argv)
    if args.only_adaptive:
        seeds = [int(s) for s in args.seeds.split(",")]
        results = run_adaptive_over_seeds(args.epochs, args.output, seeds, reuse=not args.retrain)
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "adaptive_seeds.json"), "w") as f:
            json.dump(results, f, indent=2)
        command = (
            f"KERAS_BACKEND={keras.backend.backend()} python bench/training_targets.py --epochs {args.epochs} "
            f"--only-adaptive --seeds {args.seeds}"
        )
        text = seeds_markdown(results, command)
        write_section(text, args.benchmarks, SEEDS_SECTION)
        print(text)
        return 0
    results = run(args.epochs, args.output)
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    command = f"KERAS_BACKEND={keras.backend.backend()} python bench/training_targets.py --epochs {args.epochs}"
    text = markdown(results, command)
    write_section(text, args.benchmarks)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
