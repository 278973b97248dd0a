"""MoNE-ViT memory and speed against the dense ViT, with each issue-27 change undone in turn (jax).

Issue 27 changes, each of which a variant undoes while the model is traced:

* ``layers.nested_dense.after`` ties each nested weight slice to its block's
  input and ``ViTBlock`` runs its MLP groups one after the other (XLA's CPU
  scheduler used to cut every block's slices at the start of the program and
  hold them all): variants ``unordered`` (``after`` = identity everywhere)
  and ``groups concurrent`` (slices tied, MLP groups free to overlap);
* ``layers.activations.gelu`` uses the erf form after nested in-projections
  (XLA split ``jax.nn.gelu``'s erfc form into four fusions per token group):
  variant ``erfc GELU``;
* ``layers.nested_dense.sliced_matmul`` has a hand-written backward pass
  that cuts the slice again from the kernel (autodiff kept every block's
  slices between the passes): variant ``autodiff slices``;
* ``NestedMLP`` cuts fc2's weight slice after the pre-activation, not after
  the GELU (the slice's tie was a second reader of the GELU output, and XLA
  then computed the GELU in two passes over the hidden activations): variant
  ``fc2 slice after GELU``;
* ``layers.attention.multi_head_attention`` puts each token group's q, k, v
  heads first and concatenates them in that layout (one copy; concatenating
  the groups first, then transposing, made two): variant ``qkv concatenated
  first``.

For dense, MoNE as it runs now and each variant, reports the compiled
temporaries (XLA ``memory_analysis()``) of the forward pass and of the
gradient step (forward + backward of the cross-entropy loss with respect to
every trainable weight; the optimizer update, the same for all, left out),
and the wall clock of both (compiled functions, interleaved round-robin,
median; ratios against dense of the same run)::

    KERAS_BACKEND=jax python bench/mone_memory.py --capacity 0.3 --batch-size 8 --repeats 5
"""

import argparse
import contextlib

import jax
import keras
import numpy as np

from block_profile import interleaved_medians, replaced
from mlp_forms import qkv_concatenated_first
from keras_mone import flops, models
from keras_mone.bench.memory import compiled_jax_step
from keras_mone.layers import activations
from keras_mone.layers import attention as attention_module
from keras_mone.layers import block as block_module
from keras_mone.layers import mlp as mlp_module
from keras_mone.layers import nested_dense
from keras_mone.models import decode_variant


def _identity(value, tensor):
    return value


def _autodiff_sliced_matmul(inputs, kernel, in_width, out_width, dtype, slice_after=None, rows=None):
    inputs = inputs if rows is None else inputs[:, rows[0] : rows[1]]  # autodiff keeps this cut too
    sliced = nested_dense.after(kernel[:in_width, :out_width], inputs)
    return keras.ops.matmul(inputs, keras.ops.cast(sliced, dtype))


_sliced_matmul = nested_dense.sliced_matmul


def _slice_after_inputs(inputs, kernel, in_width, out_width, dtype, slice_after=None, rows=None):
    return _sliced_matmul(inputs, kernel, in_width, out_width, dtype, rows=rows)


def _erfc_gelu(x, approximate=False, training=False, nested=False):
    return activations.gelu(x, approximate, training)


@contextlib.contextmanager
def _stack(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


#: variant -> function returning the context in which it is traced
VARIANTS = {
    "unordered": lambda: _stack(replaced(nested_dense, "after", _identity), replaced(block_module, "after", _identity)),
    "groups concurrent": lambda: replaced(block_module, "after", _identity),
    "erfc GELU": lambda: replaced(mlp_module, "gelu", _erfc_gelu),
    "autodiff slices": lambda: replaced(nested_dense, "sliced_matmul", _autodiff_sliced_matmul),
    "fc2 slice after GELU": lambda: replaced(nested_dense, "sliced_matmul", _slice_after_inputs),
    "qkv concatenated first": lambda: replaced(attention_module, "multi_head_attention", qkv_concatenated_first),
}


def build(cls, variant, depth, **kwargs):
    config = decode_variant(variant)
    if depth:
        config["depth"] = depth
    model = models.ImageClassifier(cls(**config, use_class_token=True, **kwargs), num_classes=1000, pooling="token")
    model.build()
    return model


def compiled_steps(model, images, labels, context):
    """``{"forward": (run, MiB), "gradient step": (run, MiB)}``: compiled in ``context``."""
    steps = {}
    with context():
        for kind, train in (("forward", False), ("gradient step", True)):
            executable, arguments = compiled_jax_step(model, images, labels, train)
            megabytes = executable.memory_analysis().temp_size_in_bytes / 2**20
            steps[kind] = (lambda e=executable, a=arguments: e(*a), megabytes)
    return steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--depth", type=int, default=0, help="blocks (default: the variant's)")
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--undo", default=",".join(VARIANTS), help=f"variants, comma-separated, of {list(VARIANTS)}")
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        raise SystemExit("bench/mone_memory.py compares compiled XLA programs: run it with KERAS_BACKEND=jax")
    undo = [name for name in args.undo.split(",") if name]
    unknown = sorted(set(undo) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--undo: unknown variants {unknown}; choose from {list(VARIANTS)}")
    rng = np.random.default_rng(0)
    images = rng.normal(size=(args.batch_size, 224, 224, 3)).astype("float32")
    labels = rng.integers(0, 1000, (args.batch_size,)).astype("int32")
    mone = f"MoNE e_c={args.capacity:g}"
    plan = {"dense": (models.ViTBackbone, contextlib.nullcontext), mone: (models.MoNEViTBackbone, contextlib.nullcontext)}
    for name in undo:
        plan[f"{mone}, {name}"] = (models.MoNEViTBackbone, VARIANTS[name])
    steps, macs = {}, {}
    for name, (cls, context) in plan.items():
        kwargs = {} if cls is models.ViTBackbone else {"capacity": args.capacity}
        model = build(cls, args.variant, args.depth, **kwargs)
        macs[name] = flops(model).total
        steps[name] = compiled_steps(model, images, labels, context)
        print(name, {k: round(v[1], 1) for k, v in steps[name].items()}, flush=True)
    medians = {kind: interleaved_medians({name: steps[name][kind][0] for name in plan}, args.repeats)
               for kind in ("forward", "gradient step")}  # milliseconds
    depth = args.depth or decode_variant(args.variant)["depth"]
    lines = [
        f"`KERAS_BACKEND=jax python bench/mone_memory.py --variant {args.variant} --capacity {args.capacity:g} "
        f"--batch-size {args.batch_size} --repeats {args.repeats}" + (f" --depth {args.depth}" if args.depth else "")
        + f"` (depth {depth}, jax {jax.__version__}); \"MoNE, <change>\" = MoNE with that issue-27 change undone.",
        "",
        "| model | FLOP ratio | forward temporaries MiB | forward s | forward speed-up (efficiency) "
        "| gradient-step temporaries MiB | gradient step s | gradient-step speed-up (efficiency) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in plan:
        ratio = macs["dense"] / macs[name]
        cells = []
        for kind in ("forward", "gradient step"):
            milliseconds = medians[kind][name]
            speedup = medians[kind]["dense"] / milliseconds
            cells += [f"{steps[name][kind][1]:.1f}", f"{milliseconds / 1e3:.3f}", f"{speedup:.2f}x ({speedup / ratio:.2f})"]
        lines.append(f"| {name} | {ratio:.2f}x | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
