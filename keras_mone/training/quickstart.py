"""The CPU quickstart: MoNE vs dense ViT on cluttered digits, in a few minutes.

Trains a small dense ViT and a MoNE-ViT of the same size (trained at
``train_capacity``) on the bundled cluttered-digits data, evaluates MoNE at
several effective capacities, and writes ``results.json``,
``accuracy_vs_gmacs.png`` and ``routing.png`` (tokens sent to the full expert,
as in Fig. 1 and 8 of the MoNE paper).
"""

import dataclasses
import json
import os
import time

import keras
import numpy as np

from keras_mone.analysis import flops
from keras_mone.analysis.throughput import images_per_second
from keras_mone.data import load_cluttered_digits
from keras_mone.models import ImageClassifier, MoNEViTBackbone, ViTBackbone
from keras_mone.training.optimizers import adamw_kernels_only


@dataclasses.dataclass
class QuickstartConfig:
    """Sizes and schedule of the CPU recipe (about 5 minutes on 2 cores with jax)."""

    image_size: int = 32
    patch_size: int = 4
    hidden_dim: int = 64
    depth: int = 4
    num_heads: int = 4
    mlp_dim: int = 256
    train_capacity: float = 0.5
    eval_capacities: tuple = (0.2, 0.3, 0.5, 1.0)
    digit_scale: int = 2
    clutter: int = 2
    samples_per_digit: int = 4
    test_samples_per_digit: int = 2
    epochs: int = 12
    batch_size: int = 64
    learning_rate: float = 3e-3
    weight_decay: float = 0.05
    warmup_fraction: float = 0.1
    seed: int = 0

    def backbone_config(self):
        return dict(
            image_size=self.image_size, patch_size=self.patch_size, hidden_dim=self.hidden_dim,
            depth=self.depth, num_heads=self.num_heads, mlp_dim=self.mlp_dim,
        )


def load_data(config):
    """Train / test arrays with images scaled to ``[-1, 1]`` (as in AugReg)."""
    common = dict(
        image_size=config.image_size, digit_scale=config.digit_scale, clutter=config.clutter,
        seed=config.seed,
    )
    x_train, y_train = load_cluttered_digits(
        samples_per_digit=config.samples_per_digit, split="train", **common
    )
    x_test, y_test, masks = load_cluttered_digits(
        samples_per_digit=config.test_samples_per_digit, split="test", return_masks=True, **common
    )
    return (x_train * 2 - 1, y_train), (x_test * 2 - 1, y_test, masks)


def build_classifier(config, capacity=None):
    """Dense ViT (``capacity=None``) or MoNE-ViT classifier of the quickstart size."""
    if capacity is None:
        backbone = ViTBackbone(**config.backbone_config())
    else:
        backbone = MoNEViTBackbone(capacity=capacity, **config.backbone_config())
    model = ImageClassifier(backbone, num_classes=10, pooling="gap")
    model.build()
    return model


def train(model, train_data, config, verbose="auto"):
    steps = config.epochs * int(np.ceil(len(train_data[0]) / config.batch_size))
    model.compile(
        optimizer=adamw_kernels_only(
            config.learning_rate, steps, int(config.warmup_fraction * steps),
            weight_decay=config.weight_decay,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model.fit(
        *train_data, batch_size=config.batch_size, epochs=config.epochs, verbose=verbose,
        shuffle=True,
    )


def evaluate(model, test_data, batch_size=256):
    """Accuracy, GMACs per image and measured images per second at the current capacity."""
    _, accuracy = model.evaluate(*test_data[:2], batch_size=batch_size, verbose=0)
    return dict(
        capacity=model.capacity,
        accuracy=float(accuracy),
        gmacs=flops(model).total / 1e9,
        images_per_second=images_per_second(model, test_data[0], batch_size=batch_size),
    )


def run_quickstart(output_dir, config=None, verbose="auto"):
    """Runs the quickstart and writes its outputs to ``output_dir``; returns the results."""
    config = config or QuickstartConfig()
    os.makedirs(output_dir, exist_ok=True)
    keras.utils.set_random_seed(config.seed)
    train_data, test_data = load_data(config)
    started = time.time()
    results = {"backend": keras.backend.backend(), "config": dataclasses.asdict(config)}

    print(f"Training the dense ViT ({config.epochs} epochs, {len(train_data[0])} images)")
    dense = build_classifier(config)
    train(dense, train_data, config, verbose)
    results["dense"] = evaluate(dense, test_data)

    print(f"Training MoNE-ViT at effective capacity {config.train_capacity}")
    mone = build_classifier(config, capacity=config.train_capacity)
    train(mone, train_data, config, verbose)
    results["mone"] = []
    for capacity in config.eval_capacities:
        mone.set_capacity(capacity)
        results["mone"].append(evaluate(mone, test_data))
    results["seconds"] = time.time() - started

    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    from keras_mone.training import quickstart_plots

    quickstart_plots.plot_accuracy_vs_gmacs(results, os.path.join(output_dir, "accuracy_vs_gmacs.png"))
    mone.set_capacity(min(config.eval_capacities, key=lambda c: abs(c - 0.3)))
    quickstart_plots.plot_routing(
        mone, test_data, config.patch_size, os.path.join(output_dir, "routing.png")
    )
    print(format_results(results))
    print(f"Wrote results.json, accuracy_vs_gmacs.png and routing.png to {output_dir}")
    return results


def format_results(results):
    """The quickstart's results as a plain-text table."""
    dense = results["dense"]
    rows = [("dense ViT", 1.0, dense)] + [("MoNE-ViT", r["capacity"], r) for r in results["mone"]]
    lines = [
        f"{'model':<10} {'e_c':>5} {'accuracy':>9} {'GMACs':>8} {'vs dense':>9} {'images/s':>9}",
    ]
    for name, capacity, r in rows:
        lines.append(
            f"{name:<10} {capacity:>5.2f} {100 * r['accuracy']:>8.2f}% {r['gmacs']:>8.4f} "
            f"{r['gmacs'] / dense['gmacs']:>8.2f}x {r['images_per_second']:>9.0f}"
        )
    return "\n".join(lines)
