"""Accuracy targets of the CPU video recipes on moving digits, over seeds; writes BENCHMARKS.md.

Trains, for every seed of ``--seeds``, the models of ``--models`` with the
recipes moving_digits_{vivit,mone_vivit} (8x32x32 clips, label = digit x
direction, 40 classes, fresh clips every epoch, one 5026-clip test split
shared by every seed):

* ``dense``: ViViT-FE, spatial transformer from the shipped ``vit_digits``
  preset (ViViT's image initialisation);
* ``mone_0.5``: MoNE-ViViT-FE trained at e_c 0.5 from the shipped
  ``mone_vit_digits`` preset, evaluated at e_c 0.5 and 0.3 (issue 12 target:
  within 1 point of dense at 0.5);
* ``dense_scratch``: the dense recipe with no image initialisation, what the
  initialisation is worth.

Trained models' accuracies are saved under ``--output/seed_<s>/`` and reused
as in ``bench/training_targets.py``::

    KERAS_BACKEND=jax python bench/video_targets.py --models dense,mone_0.5 --seeds 0,1,2
"""

import argparse
import os
import sys

import keras

from keras_mone import recipes
from training_targets import _mean, _std, run_seed, write_section

SECTION = "## Video targets (CPU recipes)"


def model_specs():
    """``{model name: (recipe, overrides, capacities it is evaluated at)}`` of one seed."""
    return {
        "dense": ("moving_digits_vivit", {}, (1.0,)),
        "mone_0.5": ("moving_digits_mone_vivit", {}, (0.5, 0.3)),
        "dense_scratch": ("moving_digits_vivit", {"init_from": ""}, (1.0,)),
    }


def markdown(records, command):
    seeds = list(records)
    models = {s: records[s]["models"] for s in seeds}

    def having(*names):
        return [s for s in seeds if all(name in models[s] for name in names)]

    def acc(seed, name, capacity):
        return 100 * models[seed][name]["accuracy"][str(capacity)]

    def row(label, values):
        return f"| {label} | " + " | ".join(f"{v:.1f}%" for v in values) + f" | {_mean(values):.1f}% | {_std(values):.1f} |"

    lines = [
        SECTION, "",
        f"Command: `{command}` (backend {records[seeds[0]]['backend']}; recipes `moving_digits_*`, "
        f"{records[seeds[0]]['epochs']} epochs per model). Cells are test accuracy on the 5026-clip test "
        "split (40 classes; one clip is 0.02 points), the same for every seed; std is the sample standard "
        "deviation over seeds.", "",
    ]
    rows = [("dense ViViT-FE (from vit_digits)", "dense", 1.0),
            ("MoNE-ViViT-FE at 0.5 (from mone_vit_digits)", "mone_0.5", 0.5),
            ("MoNE-ViViT-FE at 0.3", "mone_0.5", 0.3),
            ("dense ViViT-FE from scratch", "dense_scratch", 1.0)]
    for names in (("dense", "mone_0.5"), ("dense_scratch",)):
        present = having(*names)
        if not present:
            continue
        first = models[present[0]]
        lines += ["| model | GMACs / clip | " + " | ".join(f"seed {s}" for s in present) + " | mean | std |",
                  "| --- | --- |" + " --- |" * (len(present) + 2)]
        for label, name, capacity in rows:
            if name in names:
                gmacs = first[name]["gmacs"][str(capacity)]
                lines.append(row(f"{label} | {gmacs:.4f}", [acc(s, name, capacity) for s in present]))
        if names[0] == "dense":
            for c in (0.5, 0.3):
                diffs = [acc(s, "mone_0.5", c) - acc(s, "dense", 1.0) for s in present]
                lines.append(f"| MoNE at {c} minus dense | | " + " | ".join(f"{d:+.1f}" for d in diffs)
                             + f" | {_mean(diffs):+.1f} | |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=None, help="epochs per model (default: the recipe's)")
    parser.add_argument("--seeds", default="0,1,2", help="recipe seeds, e.g. 0,1,2")
    parser.add_argument("--models", default="dense,mone_0.5", help=f"subset of {','.join(model_specs())}")
    parser.add_argument("--output", default="runs/video_targets")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    parser.add_argument("--retrain", action="store_true", help="retrain models already saved in --output")
    parser.add_argument("--report-only", action="store_true", help="train nothing; report the saved models")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    models = args.models.split(",")
    unknown = sorted(set(models) - set(model_specs()))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(model_specs())}")
    epochs = args.epochs or recipes.resolve("moving_digits_vivit")[0]["epochs"]
    records = {
        str(s): run_seed(s, epochs, args.output, models, reuse=not args.retrain, train=not args.report_only,
                         specs=model_specs())
        for s in seeds
    }
    command = (
        f"KERAS_BACKEND={keras.backend.backend()} python bench/video_targets.py --epochs {epochs} "
        f"--seeds {args.seeds} --models {args.models}"
    )
    text = markdown(records, command)
    if args.benchmarks != os.devnull:
        write_section(text, args.benchmarks, section=SECTION)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
