"""ACM's two initialisations, converted from ``vit_digits`` in three phases with the same steps each.

Runs ``cluttered_digits_acm_convert`` (distill -> gates -> end_to_end in one
run directory, ``keras_mone.recipes.phases``) with ``acm_init = "slices"``
(learners = slices of the dense MLPs, exact at k = N before any training) and
``"random"`` (the paper's: learners drawn afresh, then distilled), same phase
epochs, learning rates and data, and reports on the 5026-image test split
the shipped presets are scored on, beside the dense ``vit_digits`` scored in
the same run:

* after phase 1: accuracy with every token forced to ``k = 2`` and ``k = 4``
  learners (the paper's check of distillation, Sec. 3.2) and the distillation
  loss of the last epoch;
* after phases 2 and 3: accuracy in exact and grouped execution at beta, grouped GMACs.

Writes a BENCHMARKS.md section::

    KERAS_BACKEND=jax python bench/acm_init.py --seeds 0 --phase-epochs 1,1,1
"""

import argparse
import csv
import json
import os
import statistics
import sys

import keras
import numpy as np

from keras_mone import flops, presets, recipes
from keras_mone.models.weights_file import load_saved_model
from new_methods import accuracy, test_split
from training_targets import write_section

SECTION = "## ACM initialisations: slices of the dense MLP vs random + distillation"
RECIPE = "cluttered_digits_acm_convert"
PHASES = ("distill", "gates", "end_to_end")


def convert(output, acm_init, seed, beta, phase_epochs):
    """Runs (or resumes) the three phases; returns the run directory."""
    if not os.path.exists(os.path.join(output, "results.json")):
        recipes.load(
            RECIPE, output_dir=output, acm_init=acm_init, seed=seed, beta_target=beta, phase_epochs=phase_epochs,
        ).fit(verbose=0)
    return output


def forced(model, k):
    """Every MLP gate picks ``k`` learners for every token (huge bias on choice ``k``)."""
    for gate in model.backbone.acm_gates:
        gate.fc3.kernel.assign(np.zeros(gate.fc3.kernel.shape, "float32"))
        bias = np.zeros(gate.fc3.bias.shape, "float32")
        bias[k] = 1e4
        gate.fc3.bias.assign(bias)
    return model


def phase_model(run, index):
    return load_saved_model(os.path.join(run, "phases", f"{index + 1}_{PHASES[index]}", "model.keras"), compile=False)


def measure(run, images, labels):
    distilled = phase_model(run, 0)
    with open(os.path.join(run, "history.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r["phase"] == "distill"]
    with open(os.path.join(run, "results.json")) as f:
        steps = [phase["steps"] for phase in json.load(f)["phases"]]
    row = {"distill_loss": float(rows[-1]["acm_distill"]), "steps": steps}
    for k in (2, 4):
        row[f"k{k}"] = accuracy(forced(distilled, k), images, labels)
    for index, name in ((1, "gates"), (2, "end_to_end")):
        model = phase_model(run, index)
        backbone = model.backbone
        backbone.set_execution("exact")
        row[f"{name}_exact"] = accuracy(model, images, labels)
        backbone.set_execution("grouped")
        row[f"{name}_grouped"] = accuracy(model, images, labels)
        row["gmacs"] = flops(model).gmacs
        keras.backend.clear_session()
    return row


def mean(rows, key):
    return statistics.mean(r[key] for r in rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--phase-epochs", default="1,1,1", help="epochs of distill, gates, end_to_end")
    parser.add_argument("--output", default="runs/acm_init")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    phase_epochs = [int(e) for e in args.phase_epochs.split(",")]
    images, labels, _ = test_split()
    results = {"dense": dict(accuracy=accuracy(presets.from_preset("vit_digits"), images, labels))}
    for acm_init in ("slices", "random"):
        rows = []
        for seed in seeds:
            run = convert(os.path.join(args.output, f"{acm_init}_s{seed}"), acm_init, seed, args.beta, phase_epochs)
            rows.append(measure(run, images, labels))
        results[acm_init] = rows
    with open(os.path.join(args.output, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    write_section(report(results, args, seeds, phase_epochs), args.benchmarks, SECTION)


def report(results, args, seeds, phase_epochs):
    dense = results["dense"]["accuracy"]
    lines = [
        SECTION, "",
        f"Command: `KERAS_BACKEND={keras.backend.backend()} python bench/acm_init.py --seeds {args.seeds} "
        f"--beta {args.beta} --phase-epochs {args.phase_epochs}`. Recipe `{RECIPE}` (distill -> gates -> end_to_end, "
        f"{'/'.join(map(str, phase_epochs))} epochs = {'/'.join(map(str, results['slices'][0]['steps']))} steps, batch 128, learning rates 1e-3 / 1e-2 / 5e-4), "
        f"beta_target {args.beta}; both initialisations get the same steps and data. 5026 test images; mean over "
        f"seeds {seeds}. Dense `vit_digits` in the same run: {100 * dense:.2f}%. Ratios are accuracy / dense.", "",
        "| initialisation | distill loss (last epoch) | after phase 1, k = 2 | after phase 1, k = 4 | after gates (exact / grouped) | after end to end (exact / grouped) | ratio (grouped) | grouped GMACs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("slices", "random"):
        rows = results[name]
        pct = lambda key: f"{100 * mean(rows, key):.2f}%"  # noqa: E731
        lines.append(
            f"| {name} | {mean(rows, 'distill_loss'):.4f} | {pct('k2')} | {pct('k4')} | "
            f"{pct('gates_exact')} / {pct('gates_grouped')} | {pct('end_to_end_exact')} / {pct('end_to_end_grouped')} | "
            f"{mean(rows, 'end_to_end_grouped') / dense:.3f} | {rows[0]['gmacs']:.5f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
