"""Issue-4 accuracy target: small MoNE-ViViT vs dense ViViT on the bundled moving digits.

Trains, on the CPU, the ``vivit_fe_digits`` dense ViViT-FE and MoNE-ViViT-FE
models of the same size on ``keras_mone.data.load_moving_digits`` (label =
digit x direction of motion, 40 classes, so both space and time matter), and
reports test accuracy against GMACs per clip:

* dense ViViT-FE;
* MoNE-ViViT-FE trained from scratch at ``--capacity``, from the same
  initial weights as the dense model (routers and alphas aside);
* MoNE-ViViT-FE initialised from the trained dense model and fine-tuned at
  ``--capacity`` (the paper starts its video MoNE models from a pre-trained
  nested model, Sec. 4.5), evaluated at several capacities.

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
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--append", default=None, metavar="BENCHMARKS.md", help="append the report here")
    return parser.parse_args(argv)


def load(args):
    common = dict(
        num_frames=8, image_size=32, digit_scale=2, clutter=2, target="digit_direction", seed=args.seed
    )
    x_train, y_train = load_moving_digits(samples_per_digit=args.samples_per_digit, split="train", **common)
    x_test, y_test = load_moving_digits(samples_per_digit=1, split="test", **common)
    return (x_train * 2 - 1, y_train), (x_test * 2 - 1, y_test)


def fit(model, data, args, epochs, learning_rate):
    steps = epochs * int(np.ceil(len(data[0]) / args.batch_size))
    model.compile(
        optimizer=adamw_kernels_only(learning_rate, steps, max(steps // 10, 1), weight_decay=0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    start = time.perf_counter()
    model.fit(*data, batch_size=args.batch_size, epochs=epochs, shuffle=True, verbose=2)
    return time.perf_counter() - start


def evaluate(model, data, name):
    _, accuracy = model.evaluate(*data, batch_size=128, verbose=0)
    row = dict(model=name, capacity=float(model.capacity), accuracy=float(accuracy), gmacs=flops(model).gmacs)
    print(f"{name:<32} e_c {row['capacity']:.2f}  accuracy {100 * accuracy:6.2f}%  GMACs {row['gmacs']:.4f}")
    return row


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
    dense(train[0][:1])  # build both before copying weights
    scratch(train[0][:1])
    # Same starting point: the runs differ by MoNE only, not by the draw of
    # the initial weights (at this size some draws sit on the label-prior
    # plateau for many epochs, dense or MoNE alike).
    transfer_weights(dense, scratch)
    seconds["dense"] = fit(dense, train, args, args.epochs, args.learning_rate)
    rows.append(evaluate(dense, test, "dense ViViT-FE"))

    seconds["mone_scratch"] = fit(scratch, train, args, args.epochs, args.learning_rate)
    rows.append(evaluate(scratch, test, "MoNE-ViViT-FE (scratch)"))

    tuned = presets.from_preset(
        "mone_vivit_fe_digits", load_weights=False, capacity=args.capacity,
        class_token_to_full_expert=args.class_token_to_full_expert,
    )
    tuned(train[0][:1])
    transfer_weights(dense, tuned)  # backbone and head; routers and alphas keep their init
    seconds["mone_finetune"] = fit(tuned, train, args, args.finetune_epochs, args.learning_rate / 2)
    for capacity in [float(c) for c in args.eval_capacities.split(",")]:
        tuned.set_capacity(capacity)
        rows.append(evaluate(tuned, test, "MoNE-ViViT-FE (from dense, tuned)"))
    return dict(rows=rows, seconds=seconds, settings=vars(args), backend=keras.backend.backend())


def markdown(result, command):
    dense = result["rows"][0]
    lines = [
        "### Issue 4: small MoNE-ViViT-FE vs dense ViViT-FE on moving digits (CPU)",
        "",
        f"`{command}`",
        "",
        f"Backend {result['backend']}; presets `vivit_fe_digits` / `mone_vivit_fe_digits` (8x32x32 clips, "
        "tubelet 2x4x4, D=64, 4 spatial + 1 temporal layers); 40 classes (digit x direction). "
        f"Training seconds: {', '.join(f'{k} {v:.0f}' for k, v in result['seconds'].items())}.",
        "",
        "| model | e_c | test accuracy | GMACs / clip | vs dense GMACs | accuracy - dense |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['model']} | {row['capacity']:g} | {100 * row['accuracy']:.2f}% | {row['gmacs']:.4f} | "
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
