"""Issue-4 accuracy target: small MoNE-ViViT vs dense ViViT on the bundled moving digits.

Trains, on the CPU, models of the ``vivit_fe_digits`` size on
``keras_mone.data.load_moving_digits`` (label = digit x direction of motion,
40 classes, so both space and time matter), and reports test accuracy
against GMACs per clip:

* dense ViViT-FE;
* MoNE-ViViT-FE trained from scratch at ``--capacity``;
* MatViT-ViViT-FE, the widths D/8 .. D trained jointly (summed losses), the
  nested baseline the paper starts its video MoNE models from (Sec. 4.4),
  evaluated at every width;
* MoNE-ViViT-FE initialised from that MatViT-ViViT and fine-tuned at
  ``--capacity`` (the paper's video protocol), evaluated at several capacities;
* MoNE-ViViT-FE initialised from the trained dense model and fine-tuned the
  same way (a plain dense model has no trained narrow widths).

Every model starts from the same initial weights (routers and alphas aside),
so the runs differ by the method only.

    KERAS_BACKEND=jax python bench/video_targets.py --append BENCHMARKS.md
"""

import argparse
import json
import sys
import time

import keras
import numpy as np

from keras_mone import flops, presets
from keras_mone.data import load_moving_digits
from keras_mone.models import transfer_weights
from keras_mone.training import FullWidthAccuracy, SumOverWidths
from keras_mone.training.optimizers import adamw_kernels_only


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--finetune-epochs", type=int, default=5)
    parser.add_argument("--capacity", type=float, default=0.5)
    parser.add_argument("--eval-capacities", default="0.3,0.5,0.75,1.0")
    parser.add_argument("--samples-per-digit", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--class-token-to-full-expert", action=argparse.BooleanOptionalAction, default=False,
        help="route each frame's class token to the largest expert (MoNEViTBackbone option)",
    )
    parser.add_argument(
        "--scratch", action=argparse.BooleanOptionalAction, default=True,
        help="also train MoNE from scratch at --capacity",
    )
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--append", default=None, metavar="BENCHMARKS.md", help="append the report here")
    return parser.parse_args(argv)


def load(args):
    common = dict(
        num_frames=8, image_size=32, digit_scale=2, clutter=2, target="digit_direction", seed=args.seed
    )
    x_train, y_train = load_moving_digits(samples_per_digit=args.samples_per_digit, split="train", **common)
    x_test, y_test = load_moving_digits(samples_per_digit=1, split="test", **common)
    one_hot = np.eye(40, dtype="float32")  # one-hot labels: the joint (stacked-logits) loss needs them
    return (x_train * 2 - 1, one_hot[y_train]), (x_test * 2 - 1, one_hot[y_test])


def fit(model, data, args, epochs, learning_rate, joint=False):
    """AdamW, warm-up + cosine; ``joint`` sums the loss over MatViT's widths."""
    steps = epochs * int(np.ceil(len(data[0]) / args.batch_size))
    loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=adamw_kernels_only(learning_rate, steps, max(steps // 10, 1), weight_decay=0.05),
        loss=SumOverWidths(loss) if joint else loss,
        metrics=[FullWidthAccuracy()],
    )
    start = time.perf_counter()
    model.fit(*data, batch_size=args.batch_size, epochs=epochs, shuffle=True, verbose=2)
    return time.perf_counter() - start


def evaluate(model, data, name, setting=None):
    """One table row; ``setting`` defaults to the model's effective capacity."""
    _, accuracy = model.evaluate(*data, batch_size=128, verbose=0)
    setting = setting or f"e_c {float(model.capacity):g}"
    row = dict(model=name, setting=setting, accuracy=float(accuracy), gmacs=flops(model).gmacs)
    print(f"{name:<40} {setting:<10} accuracy {100 * accuracy:6.2f}%  GMACs {row['gmacs']:.4f}")
    return row


def tune_mone(source, name, train, test, args):
    """MoNE-ViViT initialised from ``source`` (classifier, head included), fine-tuned at
    ``--capacity`` and evaluated at ``--eval-capacities``; returns (rows, seconds)."""
    tuned = presets.from_preset(
        "mone_vivit_fe_digits", load_weights=False, capacity=args.capacity,
        class_token_to_full_expert=args.class_token_to_full_expert,
    )
    tuned(train[0][:1])
    transfer_weights(source, tuned)  # routers and alphas keep their init
    seconds = fit(tuned, train, args, args.finetune_epochs, args.learning_rate / 2)
    rows = []
    for capacity in [float(c) for c in args.eval_capacities.split(",")]:
        tuned.set_capacity(capacity)
        rows.append(evaluate(tuned, test, name))
    return rows, seconds


def run(args):
    keras.utils.set_random_seed(args.seed)
    train, test = load(args)
    print(f"moving digits: {len(train[0])} train / {len(test[0])} test clips of {train[0].shape[1:]}")
    rows, seconds = [], {}

    dense = presets.from_preset("vivit_fe_digits", load_weights=False)
    scratch = presets.from_preset(
        "mone_vivit_fe_digits", load_weights=False, capacity=args.capacity,
        class_token_to_full_expert=args.class_token_to_full_expert,
    )
    nested = presets.from_preset("matvivit_fe_digits", load_weights=False)
    for model in (dense, scratch, nested):
        model(train[0][:1])  # build before copying weights
    # Same starting point: the runs differ by the method only, not by the draw
    # of the initial weights (at this size some draws sit on the label-prior
    # plateau for many epochs, whatever the model).
    transfer_weights(dense, scratch)
    transfer_weights(dense, nested)
    seconds["dense"] = fit(dense, train, args, args.epochs, args.learning_rate)
    rows.append(evaluate(dense, test, "dense ViViT-FE"))

    if args.scratch:
        seconds["mone_scratch"] = fit(scratch, train, args, args.epochs, args.learning_rate)
        rows.append(evaluate(scratch, test, "MoNE-ViViT-FE (scratch)"))

    seconds["matvit_joint"] = fit(nested, train, args, args.epochs, args.learning_rate, joint=True)
    for fraction in nested.backbone.nested_fractions:
        nested.set_width(fraction)
        rows.append(evaluate(nested, test, "MatViT-ViViT-FE (joint)", f"width {fraction:g}"))
    nested.set_width(1.0)

    tuned_rows, seconds["mone_from_matvit"] = tune_mone(
        nested, "MoNE-ViViT-FE (from MatViT, tuned)", train, test, args
    )
    rows += tuned_rows
    tuned_rows, seconds["mone_from_dense"] = tune_mone(
        dense, "MoNE-ViViT-FE (from dense, tuned)", train, test, args
    )
    rows += tuned_rows
    return dict(rows=rows, seconds=seconds, settings=vars(args), backend=keras.backend.backend())


def markdown(result, command):
    dense = result["rows"][0]
    lines = [
        "### Issue 4: small MoNE-ViViT-FE vs dense ViViT-FE on moving digits (CPU)",
        "",
        f"`{command}`",
        "",
        f"Backend {result['backend']}; presets `vivit_fe_digits` / `mone_vivit_fe_digits` / `matvivit_fe_digits` (8x32x32 clips, "
        "tubelet 2x4x4, D=64, 4 spatial + 1 temporal layers); 40 classes (digit x direction). "
        f"Training seconds: {', '.join(f'{k} {v:.0f}' for k, v in result['seconds'].items())}.",
        "",
        "| model | e_c / width | test accuracy | GMACs / clip | vs dense GMACs | accuracy - dense |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['model']} | {row['setting']} | {100 * row['accuracy']:.2f}% | {row['gmacs']:.4f} | "
            f"{row['gmacs'] / dense['gmacs']:.2f}x | {100 * (row['accuracy'] - dense['accuracy']):+.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = run(args)
    command = f"KERAS_BACKEND={keras.backend.backend()} python bench/video_targets.py " + " ".join(argv)
    report = markdown(result, command.strip())
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
