"""MoNE-ViT on tensorflow: nested weight slices tied early with their own backward pass, or not (issue 27).

TensorFlow copies a column slice ``W[:, :d]`` of a kernel (the attention
out-projection's and fc2's, one per nested width and block); a slice of
leading rows is a view. ``layers.nested_dense`` now cuts those copies once
the block's sub-layer input exists (``slice_point``) and cuts them again in
the backward pass (``_tf_sliced_matmul``) instead of keeping them for it.
Variant ``untied autodiff`` undoes both while the model is traced (the
plain ``inputs @ W[:a, :b]``, which TensorFlow's executor slices at the
start of the call for every block and autodiff keeps until the backward
pass).

For dense, MoNE and the variant: the wall clock of the forward pass and of
the gradient step (forward + backward of the cross-entropy loss with respect
to every trainable weight, ``tf.function``, interleaved round-robin, median),
and the peak RSS of each above the RSS after tracing, one fresh subprocess per
model, variant and pass (the kernel's ``VmHWM``, reset after tracing), with
the RSS that building the model and tracing both passes add (the graphs stay
resident with the compiled functions)::

    KERAS_BACKEND=tensorflow python bench/tf_slices.py --capacity 0.3 --batch-size 8 --repeats 5
"""

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys

import keras
import numpy as np

from block_profile import interleaved_medians, replaced
from keras_mone import flops, models
from keras_mone.bench.measure import _current_rss_bytes, _reset_peak_rss, _vm_hwm_bytes
from keras_mone.layers import nested_dense


def _untied_autodiff(inputs, kernel, in_width, out_width, dtype, slice_after=None, rows=None):
    inputs = inputs if rows is None else inputs[:, rows[0] : rows[1]]  # (tensorflow cuts rows before the call)
    return keras.ops.matmul(inputs, keras.ops.cast(kernel[:in_width, :out_width], dtype))


def untied_autodiff():
    return replaced(nested_dense, "sliced_matmul", _untied_autodiff)


PLAN = {  # name -> (backbone, routed (takes --capacity), tracing context)
    "dense": ("ViTBackbone", None, contextlib.nullcontext),
    "MoNE": ("MoNEViTBackbone", True, contextlib.nullcontext),
    "MoNE, untied autodiff": ("MoNEViTBackbone", True, untied_autodiff),
}


def traced_steps(name, args):
    """``(model, {"forward": fn, "gradient step": fn})``, both ``tf.function``s traced in the plan's context."""
    import tensorflow as tf

    backbone, routed, context = PLAN[name]
    extra = {"capacity": args.capacity} if routed else {}
    model = models.ImageClassifier(getattr(models, backbone)(**models.decode_variant(args.variant), **extra),
                                   num_classes=1000)
    model.build()
    rng = np.random.default_rng(0)
    images = tf.constant(rng.normal(size=(args.batch_size, 224, 224, 3)).astype("float32"))
    labels = tf.constant(rng.integers(0, 1000, (args.batch_size,)).astype("int32"))
    weights = model.trainable_variables

    def forward(x):
        return model(x, training=False)

    def gradient_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=True), from_logits=True))
        return tape.gradient(loss, weights)

    with context():
        forward = tf.function(forward).get_concrete_function(tf.TensorSpec(images.shape, tf.float32))
        step = tf.function(gradient_step).get_concrete_function(
            tf.TensorSpec(images.shape, tf.float32), tf.TensorSpec(labels.shape, tf.int32))
    return model, {"forward": lambda: forward(images), "gradient step": lambda: step(images, labels)}


def measure_peak(name, kind, args):
    """``[build + trace MB, peak MB]`` (child process): the RSS that building the model and
    tracing both passes add, and the peak RSS of two calls of one pass above the RSS after tracing."""
    before = _current_rss_bytes()
    _, steps = traced_steps(name, args)
    gc.collect()
    baseline = _current_rss_bytes()
    if not _reset_peak_rss():
        return [(baseline - before) / 1e6, None]
    steps[kind]()
    steps[kind]()
    return [(baseline - before) / 1e6, (_vm_hwm_bytes() - baseline) / 1e6]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--measure", nargs=2, metavar=("MODEL", "PASS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if keras.backend.backend() != "tensorflow":
        raise SystemExit("bench/tf_slices.py compares tensorflow graphs: run it with KERAS_BACKEND=tensorflow")
    if args.measure:
        print(json.dumps(measure_peak(*args.measure, args)))
        return 0
    runs, macs = {}, {}
    for name in PLAN:
        model, steps = traced_steps(name, args)
        macs[name] = flops(model).total
        for kind, run in steps.items():
            runs[(name, kind)] = run
    medians = interleaved_medians(runs, args.repeats)
    peaks = {}
    for key in runs:
        command = [sys.executable, os.path.abspath(__file__), "--variant", args.variant, "--capacity", str(args.capacity),
                   "--batch-size", str(args.batch_size), "--measure", *key]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        peaks[key] = json.loads(output.strip().splitlines()[-1])
    lines = [
        f"`KERAS_BACKEND=tensorflow python bench/tf_slices.py --variant {args.variant} --capacity {args.capacity:g} "
        f"--batch-size {args.batch_size} --repeats {args.repeats}` (224x224; ms: medians of interleaved calls; "
        "peak RSS: MB above the RSS after tracing, fresh process per row and pass; build + trace: the RSS "
        "that building the model and tracing both passes add):",
        "",
        "| model | FLOP ratio | build + trace MB | forward ms | forward speed-up (efficiency) | forward peak MB "
        "| gradient step ms | gradient-step speed-up (efficiency) | gradient-step peak MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in PLAN:
        ratio = macs["dense"] / macs[name]
        cells = [f"{peaks[(name, 'forward')][0]:.0f}"]  # each child traces both passes
        for kind in ("forward", "gradient step"):
            speedup = medians[("dense", kind)] / medians[(name, kind)]
            peak = peaks[(name, kind)][1]
            cells += [f"{medians[(name, kind)]:.0f}", f"{speedup:.2f}x ({speedup / ratio:.2f})",
                      "-" if peak is None else f"{peak:+.0f}"]
        lines.append(f"| {name} | {ratio:.2f}x | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
