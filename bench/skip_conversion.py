"""MoD vs A-MoD converted from the trained dense ``vit_digits``, with no training (A-MoD paper, Sec. 4).

The shipped dense ViT's weights load unchanged into a MoD-ViT (its linear
routers freshly initialised: random scores) and an A-MoD-ViT (no router
parameters: the attention received in the block before decides). Both are
evaluated on the 5026-image cluttered-digits test split at several
capacities, next to the dense model; writes a BENCHMARKS.md section::

    KERAS_BACKEND=jax python bench/skip_conversion.py --capacities 0.25,0.5,0.75 --seeds 0,1,2

``--seeds`` draws the MoD routers' initialisation (A-MoD has nothing to draw).
"""

import argparse
import sys

import keras
import numpy as np

from keras_mone import flops, models, presets
from keras_mone.presets.publish import load_test_split
from training_targets import write_section

SECTION = "## MoD and A-MoD converted from the dense ViT, no training"


def accuracy(model, images, labels):
    logits = model.predict(images, batch_size=512, verbose=0)
    return float(np.mean(np.argmax(logits, axis=-1) == labels))


def converted(dense, cls, capacity, seed):
    keras.utils.set_random_seed(seed)
    config = dense.backbone.get_config()
    names = ("image_size", "patch_size", "hidden_dim", "depth", "num_heads", "mlp_dim", "use_class_token")
    backbone = cls(**{k: config[k] for k in names}, capacity=capacity)
    model = models.ImageClassifier(backbone, num_classes=dense.num_classes, pooling=dense.pooling)
    model.build()
    models.transfer_weights(dense, model)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacities", default="0.25,0.5,0.75")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    capacities = [float(c) for c in args.capacities.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    dense = presets.from_preset("vit_digits")
    split = presets.get_preset("vit_digits")["weights"]["eval"]["test_split"]
    images, labels = load_test_split(split, "cluttered_digits")
    dense_accuracy, dense_gmacs = accuracy(dense, images, labels), flops(dense).gmacs
    lines = [
        SECTION, "",
        f"Command: `KERAS_BACKEND={keras.backend.backend()} python bench/skip_conversion.py --capacities "
        f"{args.capacities} --seeds {args.seeds}`. The shipped `vit_digits` weights (dense: "
        f"{100 * dense_accuracy:.2f}% at {dense_gmacs:.5f} GMACs) in MoD-ViT and A-MoD-ViT (blocks 1 and 3 "
        f"route), no training; 5026 test images (one is 0.02 points). MoD's routers are freshly "
        f"initialised (seeds {args.seeds}: mean and spread); A-MoD has no parameters to draw.", "",
        "| capacity C | GMACs / image | vs dense | A-MoD | MoD (mean +- std over seeds) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for capacity in capacities:
        amod = converted(dense, models.AMoDViTBackbone, capacity, 0)
        mod_runs = [accuracy(converted(dense, models.MoDViTBackbone, capacity, s), images, labels) for s in seeds]
        gmacs = flops(amod).gmacs
        spread = np.std(mod_runs, ddof=1) if len(mod_runs) > 1 else 0.0
        lines.append(
            f"| {capacity:g} | {gmacs:.5f} | {gmacs / dense_gmacs:.2f}x | {100 * accuracy(amod, images, labels):.2f}% "
            f"| {100 * np.mean(mod_runs):.2f}% +- {100 * spread:.2f} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    write_section(text, args.benchmarks, SECTION)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
