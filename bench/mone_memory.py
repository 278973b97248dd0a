"""MoNE-ViT memory and forward speed against the dense ViT, with and without the issue-27 ordering (jax).

Issue 27: XLA's CPU scheduler computed the nested weight slices of every
block at the start of the compiled program and held them all. Since then
``layers.nested_dense.after`` ties each slice to its block's input and
``MoNEBlock`` runs its MLP groups one after the other. This script compiles
four models in one process: dense, MoNE as it runs now ("ordered") and MoNE
with ``after`` replaced by the identity while it is traced ("unordered", the
code before the change), and MoNE with the slices tied but the MLP groups
free to run concurrently, and MoNE with ``jax.nn.gelu`` (the erfc form) after the
nested in-projections instead of the erf form (``layers.activations.gelu``,
the code before that change), and reports for each the compiled temporaries of the
forward pass and of forward + backward (XLA ``memory_analysis()``; jax only)
and forward wall clock, interleaved round-robin (ratios against dense)::

    KERAS_BACKEND=jax python bench/mone_memory.py --capacity 0.3 --batch-size 8 --repeats 10
"""

import argparse
import contextlib

import jax
import keras
import numpy as np

from keras_mone import models
from keras_mone.analysis.bench_memory import peak_allocation_bytes
from keras_mone.layers import block as block_module
from keras_mone.layers import mlp as mlp_module
from keras_mone.layers import nested_dense
from keras_mone.models import decode_variant
from interleaved import TABLE_HEADER, speed_rows, time_models


@contextlib.contextmanager
def unordered(modules=(nested_dense, block_module)):
    """Traces without the issue-27 ordering (``after`` = identity in ``modules``)."""
    saved = nested_dense.after
    for module in modules:
        module.after = lambda value, tensor: value
    try:
        yield
    finally:
        for module in modules:
            module.after = saved


@contextlib.contextmanager
def erfc_gelu():
    """Traces with the MLP's GELU in ``jax.nn.gelu``'s erfc form after nested projections too."""
    saved = mlp_module.gelu
    mlp_module.gelu = lambda x, approximate=False, training=False, nested=False: saved(x, approximate, training)
    try:
        yield
    finally:
        mlp_module.gelu = saved


def build(cls, variant, depth, **kwargs):
    config = decode_variant(variant)
    if depth:
        config["depth"] = depth
    model = models.ImageClassifier(cls(**config, use_class_token=True, **kwargs), num_classes=1000, pooling="token")
    model.build()
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--depth", type=int, default=0, help="blocks (default: the variant's)")
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-train-memory", action="store_true", help="skip forward + backward memory (slow to compile)")
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        raise SystemExit("bench/mone_memory.py compares compiled XLA programs: run it with KERAS_BACKEND=jax")
    named = {
        "dense": build(models.ViTBackbone, args.variant, args.depth),
        f"MoNE e_c={args.capacity:g} ordered": build(models.MoNEViTBackbone, args.variant, args.depth, capacity=args.capacity),
        f"MoNE e_c={args.capacity:g} slices tied, groups concurrent": build(
            models.MoNEViTBackbone, args.variant, args.depth, capacity=args.capacity
        ),
        f"MoNE e_c={args.capacity:g} unordered": build(models.MoNEViTBackbone, args.variant, args.depth, capacity=args.capacity),
        f"MoNE e_c={args.capacity:g} ordered, erfc GELU": build(
            models.MoNEViTBackbone, args.variant, args.depth, capacity=args.capacity
        ),
    }
    contexts = {
        list(named)[2]: lambda: unordered((block_module,)),
        list(named)[3]: unordered,
        list(named)[4]: erfc_gelu,
    }
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch_size, 224, 224, 3)).astype("float32")
    y = rng.integers(0, 1000, (args.batch_size,)).astype("int32")
    memory = {}
    for name, model in named.items():
        with contexts.get(name, contextlib.nullcontext)():
            model.predict_on_batch(x)  # traces and compiles the timed function
            forward = peak_allocation_bytes(model, x, y, train=False) / 2**20
            train = None if args.no_train_memory else peak_allocation_bytes(model, x, y, train=True) / 2**20
        memory[name] = (forward, train)
        print(name, f"forward temporaries {forward:.1f} MiB", "" if train is None else f"forward+backward {train:.1f} MiB", flush=True)
    times = time_models(named, x, args.repeats)
    depth = named["dense"].backbone.depth
    lines = [
        f"`KERAS_BACKEND=jax python bench/mone_memory.py --variant {args.variant} --capacity {args.capacity:g} "
        f"--batch-size {args.batch_size} --repeats {args.repeats}" + (f" --depth {args.depth}" if args.depth else "")
        + ("" if not args.no_train_memory else " --no-train-memory") + f"` (depth {depth}, jax {jax.__version__})",
        "",
        "| model | forward temporaries MiB | forward + backward temporaries MiB |",
        "| --- | --- | --- |",
    ]
    for name, (forward, train) in memory.items():
        lines.append(f"| {name} | {forward:.1f} | {'-' if train is None else f'{train:.1f}'} |")
    lines += ["", *TABLE_HEADER, *speed_rows(named, times, "dense")]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
