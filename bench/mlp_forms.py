"""Old and new forms of a block's parts: ViT-B/16 forward, dense and MoNE, one process (issue 27).

``--change mlp`` (default): two changes of ``NestedMLP`` / ``NestedDense``,
undone together while the ``old`` models are traced:

* the MLP runs on token rows ``(tokens, D)`` and ``NestedDense`` adds its
  bias with ``tf.nn.bias_add`` on tensorflow (``layers.nested_dense.add_bias``):
  TensorFlow's oneDNN rewrite fuses MatMul + BiasAdd + GELU into one kernel,
  which it does not for the ``(batch, tokens, D)`` matmul and an ``AddV2``;
* on jax, fc2's nested weight slice is cut after the pre-activation, not
  after the GELU (``slice_after``): a second reader of the GELU output made
  XLA compute the GELU in two passes over every group's hidden activations.

``old`` is the MLP as it was (3-D matmul, ``+ bias``, fc2's slice tied to its
input); ``new`` the current one.

``--change attention``: ``layers.attention.multi_head_attention`` takes MoNE's
token groups as parts, puts each heads first and concatenates them in that
layout; ``old`` concatenates the groups' q, k, v first and then transposes
(two copies instead of one; torch's path concatenates first either way).

Each model is compiled as the backend runs models (jax ``jit``,
``tf.function``, torch eager under ``no_grad``) and timed round-robin with
the others, median of ``--repeats``::

    KERAS_BACKEND=tensorflow python bench/mlp_forms.py --capacity 0.3 --repeats 8 [--change attention] [--output FILE]

(one table per backend; BENCHMARKS.md's sections "MLP on token rows, bias
fused" and "Attention over token groups" hold them).
"""

import argparse
import contextlib
import os

import keras
import numpy as np

from block_profile import interleaved_medians, replaced
from keras_mone import flops, models
from keras_mone.layers import attention as attention_module
from keras_mone.layers import mlp as mlp_module
from keras_mone.layers import nested_dense
from keras_mone.layers.activations import gelu


def _old_mlp_call(self, inputs, width=None, pad_output=True, training=None):
    nested = width is not None and width < self.hidden_dim
    hidden = gelu(self.fc1(inputs, in_width=width), approximate=self.gelu_approximate, training=bool(training),
                  nested=nested)
    hidden = self.dropout(hidden, training=training)
    return self.dropout(self.fc2(hidden, out_width=width, pad_output=pad_output), training=training)


@contextlib.contextmanager
def old_mlp():
    """The MLP before the change, while models are traced."""
    saved = mlp_module.NestedMLP.call, nested_dense.add_bias
    mlp_module.NestedMLP.call, nested_dense.add_bias = _old_mlp_call, lambda outputs, bias: outputs + bias
    try:
        yield
    finally:
        mlp_module.NestedMLP.call, nested_dense.add_bias = saved


_multi_head_attention = attention_module.multi_head_attention


def qkv_concatenated_first(qkv, return_received_attention=False):
    """``multi_head_attention`` as it was: token groups concatenated before the heads-first transposes."""
    if isinstance(qkv, (list, tuple)):
        qkv = keras.ops.concatenate(qkv, axis=1)
    return _multi_head_attention(qkv, return_received_attention)


OLD_FORMS = {
    "mlp": old_mlp,
    "attention": lambda: replaced(attention_module, "multi_head_attention", qkv_concatenated_first),
}


def compiled_forward(model, images, context):
    """A callable running ``model`` on ``images`` as the backend runs models, traced in ``context``."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        weights = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])
        with context():
            compiled = jax.jit(lambda t, n, x: model.stateless_call(t, n, x)[0]).lower(*weights, images).compile()
        return lambda: compiled(*weights, images)
    if backend == "tensorflow":
        import tensorflow as tf

        tensor = tf.constant(images)
        with context():
            concrete = tf.function(lambda x: model(x, training=False)).get_concrete_function(
                tf.TensorSpec(images.shape, tf.float32))
        return lambda: concrete(tensor)
    import torch

    def run():  # eager: the form is the one in place when called
        with context(), torch.no_grad():
            return model(images)
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--change", choices=sorted(OLD_FORMS), default="mlp", help="which change the old form undoes")
    parser.add_argument("--output", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    images = np.random.default_rng(0).normal(size=(args.batch_size, 224, 224, 3)).astype("float32")
    config = models.decode_variant(args.variant)
    runs, macs = {}, {}
    for name, cls, extra in (("dense", models.ViTBackbone, {}),
                             (f"MoNE e_c {args.capacity:g}", models.MoNEViTBackbone, {"capacity": args.capacity})):
        model = models.ImageClassifier(cls(**config, **extra), num_classes=1000)
        model.build()
        macs[name] = flops(model).total
        for form, context in (("old", OLD_FORMS[args.change]), ("new", contextlib.nullcontext)):
            runs[(name, form)] = compiled_forward(model, images, context)
    medians = interleaved_medians(runs, args.repeats)
    backend = keras.backend.backend()
    lines = [
        f"`KERAS_BACKEND={backend} python bench/mlp_forms.py --variant {args.variant} --capacity {args.capacity:g} "
        f"--batch-size {args.batch_size} --repeats {args.repeats} --change {args.change}` (224x224; milliseconds, "
        "medians of interleaved calls):",
        "",
        "| backend | model | old ms | new ms | new speed-up | speed-up over dense old / new (FLOP ratio) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in macs:
        old, new = medians[(name, "old")], medians[(name, "new")]
        against = [medians[("dense", form)] / medians[(name, form)] for form in ("old", "new")]
        lines.append(f"| {backend} | {name} | {old:.1f} | {new:.1f} | {old / new:.3f}x | "
                     f"{against[0]:.2f}x / {against[1]:.2f}x ({macs['dense'] / macs[name]:.2f}x) |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
