"""Accuracy targets of the CPU recipes on cluttered digits, over seeds; writes BENCHMARKS.md.

For every recipe seed of ``--seeds`` it trains the models of ``--models``
(default: all) with the recipes cluttered_digits_{vit,mone,mone_adaptive}
(the quickstart's sizes and schedule, fresh renderings every epoch, one
5026-image test split shared by every seed):

1. ``dense`` and ``mone_0.5`` (MoNE trained at e_c 0.5, evaluated at 0.5 and
   0.3): the quickstart's two models and its targets (issue 12: MoNE within 1
   point of dense at 0.5 and within 3 at 0.3, on every seed);
2. ``mone_0.2`` vs ``random_0.2``: learned vs random router, trained and
   evaluated at e_c 0.2 (MoNE Fig. 7c);
3. ``adaptive`` (MoNE Sec. 5; mode "adaptive_isoflops": e_c drawn per step from
   0.15..0.95, the dense model's training MACs) vs ``mone_<c>`` trained at a
   fixed e_c, evaluated at e_c 0.2, 0.3, 0.5 and 0.75.

Every trained model's accuracies are saved to
``--output/seed_<s>/accuracies.json`` as soon as it is evaluated, and a later
run with the same epochs and backend reuses them (``--retrain`` overrides), so
seeds can run in parallel processes and one last call writes the section
"Training targets (CPU recipes)" of BENCHMARKS.md, with the tables whose models
exist::

    KERAS_BACKEND=jax python bench/training_targets.py --models dense,mone_0.5 --seeds 0,1,2
"""

import argparse
import json
import os
import sys
import time

import keras

from keras_mone import recipes
from keras_mone.analysis import expert_share_of_tokens, flops
from keras_mone.cli.quickstart import ROUTING_IMAGES, load_test_data

CAPACITIES = (0.2, 0.3, 0.5, 0.75)
SECTION = "## Training targets (CPU recipes)"


def model_specs():
    """``{model name: (recipe, overrides, capacities it is evaluated at)}`` of one seed."""
    specs = {
        "dense": ("cluttered_digits_vit", {}, (1.0,)),
        "mone_0.5": ("cluttered_digits_mone", {}, (0.5, 0.3)),
        # alpha starts at 0 in the paper (Eq. 1), which slows the router's start from scratch
        "mone_0.5_alpha0.5": ("cluttered_digits_mone", {"model_args": {"alpha_init": 0.5}}, (0.5, 0.3)),
        "random_0.2": ("cluttered_digits_mone", {"capacity": 0.2, "router_type": "random"}, (0.2,)),
        "adaptive": ("cluttered_digits_mone_adaptive", {}, CAPACITIES),
    }
    for capacity in CAPACITIES:
        specs.setdefault(f"mone_{capacity}", ("cluttered_digits_mone", {"capacity": capacity}, (capacity,)))
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
    record = dict(accuracy=accuracy, gmacs=gmacs, epochs=setup.epochs)
    learned = getattr(setup.model.backbone, "router_type", None) == "learned"
    if learned and setup.recipe["dataset"] == "cluttered_digits":
        record["digit_share"] = digit_shares(setup.model, setup.recipe, capacities)
    return record


def digit_shares(model, recipe, capacities):
    """``{capacity: [share of digit tokens sent to the full expert, its share of all tokens]}``
    on the first test images (a random router's share equals the second number)."""
    (images, _), digit_tokens = load_test_data(recipe)
    shares = {}
    for capacity in capacities:
        model.set_capacity(capacity)
        share = expert_share_of_tokens(model, images[:ROUTING_IMAGES], digit_tokens[:ROUTING_IMAGES])
        shares[str(capacity)] = [float(share[-1]), float(model.backbone.expert_capacities[-1])]
    return shares


def run_seed(seed, epochs, output, models, reuse=True, train=True, specs=None):
    """Trains (or reuses) the ``models`` of ``seed`` (names of ``specs``,
    default :func:`model_specs`); returns its record (with ``train=False``,
    only the models already saved)."""
    directory = os.path.join(output, f"seed_{seed}")
    path = os.path.join(directory, "accuracies.json")
    record = dict(backend=keras.backend.backend(), epochs=epochs, models={})
    if reuse and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if (saved["backend"], saved["epochs"]) == (record["backend"], epochs):
            record = saved
    for name, (recipe, overrides, capacities) in (specs or model_specs()).items():
        if name not in models:
            continue
        if name in record["models"]:
            print(f"  seed {seed} {name}: reusing {path}", flush=True)
            saved = record["models"][name]
            if recipe == "cluttered_digits_mone" and overrides.get("router_type") != "random" and "digit_share" not in saved:
                run = os.path.join(directory, name)  # saved before the routing shares were recorded
                model = keras.saving.load_model(os.path.join(run, "model.keras"), compile=False)
                saved["digit_share"] = digit_shares(model, recipes.resolve(os.path.join(run, "recipe.toml"))[0], capacities)
                with open(path, "w") as f:
                    json.dump(record, f, indent=2)
            continue
        if not train:
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


def _std(values):
    """Sample standard deviation (0 for one value)."""
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def markdown(records, command):
    """The section: one table per target whose models every seed has."""
    seeds = list(records)
    models = {s: records[s]["models"] for s in seeds}

    def having(*names):
        """The seeds whose record has every model of ``names``."""
        return [s for s in seeds if all(name in models[s] for name in names)]

    def columns(seed_list):
        return " | ".join(f"seed {s}" for s in seed_list)

    def header(seed_list):
        return [f"| model | {columns(seed_list)} | mean | std |", "| --- |" + " --- |" * (len(seed_list) + 2)]

    def acc(seed, name, capacity):
        return 100 * models[seed][name]["accuracy"][str(capacity)]

    def row(label, values):
        return f"| {label} | " + " | ".join(f"{v:.1f}%" for v in values) + f" | {_mean(values):.1f}% | {_std(values):.1f} |"

    first = models[seeds[0]]
    lines = [
        SECTION, "",
        f"Command: `{command}` (backend {records[seeds[0]]['backend']}; recipes `cluttered_digits_*`, "
        f"{records[seeds[0]]['epochs']} epochs per model; recipe `seed` sets the initial weights, the "
        "rendered training images, their order and the routers' draws). Cells are test accuracy on the "
        "5026-image test split (one image is 0.02 points), the same for every seed; std is the sample "
        "standard deviation over seeds.", "",
    ]
    if having("dense", "mone_0.5"):
        seeds = having("dense", "mone_0.5")
        first = models[seeds[0]]
        dense_gmacs, mone_gmacs = first["dense"]["gmacs"]["1.0"], first["mone_0.5"]["gmacs"]["0.5"]
        mone_03 = first["mone_0.5"]["gmacs"]["0.3"]
        lines += [
            f"Quickstart targets: MoNE trained at e_c 0.5, evaluated at 0.5 ({mone_gmacs / dense_gmacs:.2f}x the "
            f"dense GMACs) and 0.3 ({mone_03 / dense_gmacs:.2f}x), vs the dense ViT ({dense_gmacs:.5f} GMACs):", "",
            *header(seeds),
            row("dense ViT", [acc(s, "dense", 1.0) for s in seeds]),
            row("MoNE-ViT at 0.5", [acc(s, "mone_0.5", 0.5) for s in seeds]),
            row("MoNE-ViT at 0.3", [acc(s, "mone_0.5", 0.3) for s in seeds]),
        ]
        for c in (0.5, 0.3):
            diffs = [acc(s, "mone_0.5", c) - acc(s, "dense", 1.0) for s in seeds]
            lines.append(f"| difference at {c} | " + " | ".join(f"{d:+.1f}" for d in diffs) + f" | {_mean(diffs):+.1f} | |")
        lines.append("")
    if having("mone_0.5", "mone_0.5_alpha0.5"):
        seeds = having("mone_0.5", "mone_0.5_alpha0.5")
        lines += [
            "Does the router learn? alpha starts at 0 (the paper, Eq. 1), so the router gets no gradient "
            "until alpha moves; `model_args.alpha_init=0.5` starts it at 0.5. Cells: test accuracy, and the "
            "share of digit tokens (tokens holding digit pixels, 6.2% of all) that the router sends to the full "
            "expert, against that expert's share of all tokens (what a random router gives):", "",
            f"| model, e_c | {columns(seeds)} |", "| --- |" + " --- |" * len(seeds),
        ]
        for label, name in (("alpha_init 0", "mone_0.5"), ("alpha_init 0.5", "mone_0.5_alpha0.5")):
            for c in (0.5, 0.3):
                cells = []
                for s in seeds:
                    share = models[s][name].get("digit_share", {}).get(str(c))
                    routing = f" ({100 * share[0]:.0f}% of digit tokens to D; D holds {100 * share[1]:.0f}%)" if share else ""
                    cells.append(f"{acc(s, name, c):.1f}%{routing}")
                lines.append(f"| {label}, {c} | " + " | ".join(cells) + " |")
        lines.append("")
    if having("mone_0.2", "random_0.2"):
        seeds = having("mone_0.2", "random_0.2")
        lines += ["Learned vs random router, trained and evaluated at e_c 0.2:", "", *header(seeds),
                  row("learned", [acc(s, "mone_0.2", 0.2) for s in seeds]),
                  row("random", [acc(s, "random_0.2", 0.2) for s in seeds]), ""]
    seeds = having("adaptive")
    fixed = [c for c in CAPACITIES if seeds and having("adaptive", f"mone_{c}") == seeds]
    if fixed:
        first = models[seeds[0]]
        lines += [
            f"One adaptive model ({first['adaptive']['epochs']} epochs, mode adaptive_isoflops: the dense "
            "model's training MACs) vs a model trained at each fixed e_c (cells: adaptive / fixed):", "",
            f"| e_c | {columns(seeds)} | mean adaptive | mean fixed | mean difference |",
            "| --- |" + " --- |" * (len(seeds) + 3),
        ]
        for c in fixed:
            adaptive = [acc(s, "adaptive", c) for s in seeds]
            trained = [acc(s, f"mone_{c}", c) for s in seeds]
            cells = " | ".join(f"{a:.1f}% / {f:.1f}%" for a, f in zip(adaptive, trained))
            lines.append(
                f"| {c} | {cells} | {_mean(adaptive):.1f}% | {_mean(trained):.1f}% | {_mean(adaptive) - _mean(trained):+.1f} |"
            )
    return "\n".join(lines).rstrip("\n") + "\n"


def write_section(text, path="BENCHMARKS.md", section=SECTION):
    """Replaces ``section`` of ``path`` (up to the next ``## ``) with ``text`` where it stands, or appends it."""
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    start = old.find(section)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(section))
        rest = old[end + 1:] if end >= 0 else ""
        new = old[:start] + text.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    with open(path, "w") as f:
        f.write(new)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=None, help="epochs per model (default: the recipe's)")
    parser.add_argument("--seeds", default="0,1,2", help="recipe seeds, e.g. 0,1,2")
    parser.add_argument("--models", default=",".join(model_specs()), help=f"subset of {','.join(model_specs())}")
    parser.add_argument("--output", default="runs/training_targets")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    parser.add_argument("--retrain", action="store_true", help="retrain models already saved in --output")
    parser.add_argument("--report-only", action="store_true", help="train nothing; report the saved models")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    models = args.models.split(",")
    unknown = sorted(set(models) - set(model_specs()))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(model_specs())}")
    epochs = args.epochs or recipes.resolve("cluttered_digits_vit")[0]["epochs"]
    records = {
        str(s): run_seed(s, epochs, args.output, models, reuse=not args.retrain, train=not args.report_only)
        for s in seeds
    }
    command = (
        f"KERAS_BACKEND={keras.backend.backend()} python bench/training_targets.py --epochs {epochs} "
        f"--seeds {args.seeds} --models {args.models}"
    )
    text = markdown(records, command)
    if args.benchmarks != os.devnull:
        write_section(text, args.benchmarks)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
