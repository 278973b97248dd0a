"""ACM's auxiliary losses ablated (the ACM paper's Fig. 8): which terms make computation vary.

Issue 25 item 6. ``vit_digits`` converted by ``cluttered_digits_acm_from_dense``
(learners = slices of the dense MLPs, new gates, end-to-end training at
``--beta``) with the recipe key ``acm_loss_weights`` set to each combination
of the paper's terms (weights of L_budget, L_entropy, L_diversity; CE always):

* ``budget``: ``[0.1, 0, 0]`` (the paper: every token ends with the same count);
* ``budget + entropy``: ``[0.1, 0.05, 0]``;
* ``budget + diversity``: ``[0.1, 0, -0.05]``;
* ``all``: ``[0.1, 0.05, -0.05]`` (the paper's, the only one with diversity).

For each run, on the first ``--images`` test images in exact execution: the
share of tokens on the most common learner count (1.0 = collapsed), the mean
within-image spread (std) of the tokens' learner counts, the spread across
images of the per-image compute (std of the mean count / N, the width of the
paper's histograms) and test accuracy; the per-image compute histograms go to
``--plot``. A rerun reuses finished run directories::

    KERAS_BACKEND=jax python bench/acm_loss_ablation.py --seeds 0 --samples-per-digit 4
"""

import argparse
import os
import statistics

import numpy as np

from new_methods import accuracy, backbone_record, test_split, train
from training_targets import write_section

SECTION = "## ACM's auxiliary losses ablated (ACM paper Fig. 8)"
VARIANTS = {
    "budget": [0.1, 0.0, 0.0],
    "budget + entropy": [0.1, 0.05, 0.0],
    "budget + diversity": [0.1, 0.0, -0.05],
    "all (the paper's)": [0.1, 0.05, -0.05],
}


def count_statistics(model, images):
    """Learner-count statistics of ``model`` (exact execution) on ``images`` and the per-image compute."""
    backbone = model.backbone
    _, record = backbone_record(backbone, images, "exact")
    counts = np.stack([np.asarray(b["assignment"]) for b in record["blocks"]], axis=1)  # (n, blocks, tokens)
    values, frequency = np.unique(counts, return_counts=True)
    per_image = counts.reshape(len(counts), -1).mean(axis=1) / backbone.num_learners
    return dict(
        modal_share=float(frequency.max() / counts.size),
        modal_count=int(values[frequency.argmax()]),
        within_image_std=float(counts.std(axis=2).mean()),
        across_image_std=float(per_image.std()),
        mean_compute=float(per_image.mean()),
        count_shares={int(v): float(f / counts.size) for v, f in zip(values, frequency)},
        per_image=per_image.tolist(),
    )


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 2.8), sharex=True)
    for axis, (name, rows) in zip(np.atleast_1d(axes), results.items()):
        axis.hist(rows[0]["per_image"], bins=np.linspace(0, 1, 41), color="tab:blue")
        axis.set_title(name, fontsize=9)
        axis.set_xlabel("per-image compute (mean k / N)")
    np.atleast_1d(axes)[0].set_ylabel("test images")
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=120)


def markdown(results, command, beta):
    def cell(rows, key, scale=1.0, digits=3):
        values = [scale * r[key] for r in rows]
        spread = f" +- {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
        return f"{statistics.mean(values):.{digits}f}{spread}"

    lines = [
        f"Command: `{command}`. `vit_digits` converted by `cluttered_digits_acm_from_dense` at beta_target "
        f"{beta}, the recipe key `acm_loss_weights` = (budget, entropy, diversity) weights; statistics of the "
        "learner counts in exact execution (N = 4; k = 0 adds nothing) over the first test images, accuracy on "
        "the 5026-image split (mean +- sd over seeds where several).",
        "",
        "| losses (weights) | accuracy % | mean compute | tokens on the modal count | within-image std of k "
        "| across-image std of compute |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, rows in results.items():
        modal = ", ".join(f"k={r['modal_count']}" for r in rows)
        lines.append(
            f"| {name} {VARIANTS[name]} | {cell(rows, 'accuracy', 100, 2)} | {cell(rows, 'mean_compute')} "
            f"| {cell(rows, 'modal_share')} ({modal}) | {cell(rows, 'within_image_std')} "
            f"| {cell(rows, 'across_image_std')} |"
        )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--samples-per-digit", type=int, default=16, help="training renderings per digit (one epoch)")
    parser.add_argument("--images", type=int, default=1024, help="test images whose learner counts are read")
    parser.add_argument("--output", default="runs/acm_loss_ablation")
    parser.add_argument("--plot", default="bench/figures/acm_loss_ablation.png")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    images, labels, _ = test_split()
    results = {}
    for name, weights in VARIANTS.items():
        rows = []
        for seed in seeds:
            run = os.path.join(args.output, name.split(" ")[0] + "_" + "_".join(f"{w:g}" for w in weights) + f"_s{seed}")
            model = train(
                "cluttered_digits_acm_from_dense", run, beta_target=args.beta, seed=seed,
                samples_per_digit=args.samples_per_digit, acm_loss_weights=weights,
            )
            row = count_statistics(model, images[: args.images])
            row["accuracy"] = accuracy(model, images, labels)
            rows.append(row)
            print(name, seed, {k: v for k, v in row.items() if k != "per_image"}, flush=True)
        results[name] = rows
    plot(results, args.plot)
    command = (
        f"KERAS_BACKEND=jax python bench/acm_loss_ablation.py --seeds {args.seeds} --beta {args.beta:g} "
        f"--samples-per-digit {args.samples_per_digit} --images {args.images}"
    )
    lines = [SECTION, "", *markdown(results, command, args.beta), "", f"Per-image compute histograms: `{args.plot}`."]
    text = "\n".join(lines) + "\n"
    write_section(text, args.benchmarks, SECTION)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
