"""The nested projections in two shapes: per expert group (today's) or as row blocks shared by all wider tokens (issue 27 item 2).

A nested in-projection of a token of width ``d`` is ``x[:d] @ W[:d]``. With the
kernel cut at the nesting boundaries ``0 < w_1 < ... < w_E = D`` into row
blocks ``W[w_(b-1):w_b]``, it is the sum of the blocks ``b`` with
``w_b <= d``:

* **grouped** (today's ``NestedDense`` per group): one matmul per expert group,
  ``x_e[:, :w_e] @ W[:w_e]`` (``n_e`` rows, contraction ``w_e``);
* **row blocks**: one matmul per block over every token of at least that
  width, ``x_(>=b)[:, w_(b-1):w_b] @ W[w_(b-1):w_b]`` (``n_(>=b)`` rows, taller,
  but a thinner contraction), the partial results added into place.

Out-projections (attention's ``out``, the MLP's ``fc2``) are the transpose:
column blocks ``W[:, w_(b-1):w_b]`` over every token of at least that width.
Both forms do the same MACs. The script times, on the backend of
``KERAS_BACKEND`` (jax ``jax.jit``, tensorflow ``tf.function``, torch eager),
the projections of one ViT-B/16 block (batch 8, 197 tokens, tokens grouped by
expert at ``--capacity``, Eq. 3 distribution) in both forms and the dense block's
projections in the same interleaved run, forward (and, on jax, forward +
backward), checks the two forms agree, and writes a BENCHMARKS.md section::

    KERAS_BACKEND=jax python bench/nested_projection_forms.py --capacity 0.3
"""

import argparse
import os

import keras
import numpy as np
from keras import ops

from block_profile import interleaved_medians
from keras_mone.routing import capacity_distribution, expert_token_counts

SECTION = "## Nested projections: per-group matmuls or row blocks (issue 27 item 2)"


def grouped_in(groups, widths, kernel):
    """``concat_e(x_e[:, :, :w_e] @ W[:w_e])`` over the token axis: today's qkv / fc1."""
    return ops.concatenate([ops.matmul(g[..., :w], kernel[:w]) for g, w in zip(groups, widths)], axis=1)


def row_block_in(groups, widths, kernel):
    """The same product as ``grouped_in``, one matmul per row block of the kernel over every token
    of at least that width (the groups sorted by ascending width), added into place."""
    result, low, skipped = None, 0, 0
    for b, width in enumerate(widths):
        wider = ops.concatenate([g[..., low:width] for g in groups[b:]], axis=1) if b < len(groups) - 1 \
            else groups[b][..., low:width]
        part = ops.matmul(wider, kernel[low:width])
        part = ops.pad(part, [[0, 0], [skipped, 0], [0, 0]]) if skipped else part
        result = part if result is None else result + part
        skipped += groups[b].shape[1]
        low = width
    return result


def grouped_out(hidden, sizes, widths, kernel):
    """Per group ``h_e @ W[:, :w_e]`` zero-padded to ``D``: today's attention out / fc2 (``hidden``: all tokens)."""
    full, outputs, start = kernel.shape[1], [], 0
    for size, width in zip(sizes, widths):
        part = ops.matmul(hidden[:, start:start + size], kernel[:, :width])
        outputs.append(ops.pad(part, [[0, 0], [0, 0], [0, full - width]]))
        start += size
    return outputs


def column_block_out(hidden, sizes, widths, kernel):
    """``grouped_out`` with one matmul per column block over every token of at least that width."""
    full, blocks, low, skipped = kernel.shape[1], [], 0, 0
    for b, width in enumerate(widths):
        part = ops.matmul(hidden[:, skipped:], kernel[:, low:width])
        blocks.append(ops.pad(part, [[0, 0], [skipped, 0], [0, 0]]) if skipped else part)
        skipped += sizes[b]
        low = width
    assembled = ops.concatenate(blocks, axis=-1)
    assembled = ops.pad(assembled, [[0, 0], [0, 0], [0, full - low]]) if low < full else assembled
    outputs, start = [], 0
    for size in sizes:
        outputs.append(assembled[:, start:start + size])
        start += size
    return outputs


def pad_then_add(residuals, updates):
    """Today's residual: each group's thin update zero-padded to ``D``, then added."""
    full = residuals[0].shape[-1]
    return [z + ops.pad(u, [[0, 0], [0, 0], [0, full - u.shape[-1]]]) for z, u in zip(residuals, updates)]


def add_into_slice(residuals, updates):
    """The update added to the residual's first ``w`` features only, the rest copied: no padded tensor."""
    full = residuals[0].shape[-1]
    return [z + u if u.shape[-1] == full else ops.concatenate([z[..., :u.shape[-1]] + u, z[..., u.shape[-1]:]], -1)
            for z, u in zip(residuals, updates)]


FORMS = {"grouped": (grouped_in, grouped_out), "row blocks": (row_block_in, column_block_out)}


def projections(form, groups, widths, kernels):
    """qkv, attention out, fc1 and fc2 of one block in ``form`` (GELU between fc1 and fc2)."""
    project_in, project_out = FORMS[form]
    sizes = [g.shape[1] for g in groups]
    qkv = project_in(groups, widths, kernels["qkv"])
    attended = qkv[..., : kernels["out"].shape[0]]  # stands in for attention's output (same shape)
    attention_out = project_out(attended, sizes, widths, kernels["out"])
    hidden = keras.activations.gelu(project_in(attention_out, widths, kernels["fc1"]), approximate=False)
    return project_out(hidden, sizes, widths, kernels["fc2"])


def dense_projections(x, kernels):
    qkv = ops.matmul(x, kernels["qkv"])
    attention_out = ops.matmul(qkv[..., : kernels["out"].shape[0]], kernels["out"])
    return ops.matmul(keras.activations.gelu(ops.matmul(attention_out, kernels["fc1"]), approximate=False),
                      kernels["fc2"])


def setup(args):
    hidden, tokens = args.hidden_dim, args.tokens
    rng = np.random.default_rng(0)
    kernels = {name: ops.convert_to_tensor(rng.normal(0, shape[0] ** -0.5, shape).astype("float32"))
               for name, shape in (("qkv", (hidden, 3 * hidden)), ("out", (hidden, hidden)),
                                   ("fc1", (hidden, 4 * hidden)), ("fc2", (4 * hidden, hidden)))}
    counts = [int(c) for c in expert_token_counts(capacity_distribution(args.capacity), tokens)[0]]
    widths = [hidden // 2 ** (len(counts) - 1 - e) for e in range(len(counts))]
    x = rng.normal(size=(args.batch_size, tokens, hidden)).astype("float32")
    groups, start = [], 0
    for count in counts:
        groups.append(ops.convert_to_tensor(x[:, start:start + count]))
        start += count
    kept = [(g, w) for g, w in zip(groups, widths) if g.shape[1]]
    return kernels, [g for g, _ in kept], [w for _, w in kept], ops.convert_to_tensor(x)


def compiled(fn, *inputs, grad=False):
    """``fn(*inputs)`` as the backend runs models (see ``block_profile.prepared``); with ``grad``
    (jax), the forward and backward pass of ``sum(fn(...) ** 2)`` with respect to every input."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        if grad:
            def loss(*args):
                return sum(ops.sum(o ** 2) for o in keras.tree.flatten(fn(*args)))
            step = jax.jit(jax.grad(loss, argnums=tuple(range(len(inputs)))))
            return lambda: step(*inputs)
        step = jax.jit(fn)
        return lambda: step(*inputs)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(lambda: fn(*inputs))
    import torch

    def run():
        with torch.no_grad():
            return fn(*inputs)
    return run


def measure(args):
    kernels, groups, widths, x = setup(args)
    reference = keras.tree.flatten(projections("grouped", groups, widths, kernels))
    candidate = keras.tree.flatten(projections("row blocks", groups, widths, kernels))
    error = max(float(np.max(np.abs(ops.convert_to_numpy(a) - ops.convert_to_numpy(b))))
                for a, b in zip(reference, candidate))
    scale = max(float(np.max(np.abs(ops.convert_to_numpy(a)))) for a in reference)
    passes = {"forward": False} | ({"forward + backward": True} if keras.backend.backend() == "jax" else {})
    results = {}
    for label, grad in passes.items():
        runs = {"dense": compiled(lambda x, k: dense_projections(x, k), x, kernels, grad=grad)}
        for form in FORMS:
            runs[form] = compiled(lambda g, k, form=form: projections(form, g, widths, k), groups, kernels, grad=grad)
        results[label] = interleaved_medians(runs, args.repeats)
    updates = [g[..., :w] * 0.5 for g, w in zip(groups, widths)]
    residual = {name: compiled(fn, groups, updates) for name, fn in
                (("pad then add", pad_then_add), ("add into slice", add_into_slice))}
    results["residual"] = interleaved_medians(residual, args.repeats)
    return dict(sizes=[g.shape[1] for g in groups], widths=widths, error=error, scale=scale, results=results)


def markdown(measured, args):
    backend = keras.backend.backend()
    sizes, widths = measured["sizes"], measured["widths"]
    tokens = sum(sizes)
    macs_ratio = tokens * args.hidden_dim / sum(n * w for n, w in zip(sizes, widths))
    lines = [
        f"`KERAS_BACKEND={backend} python bench/nested_projection_forms.py --capacity {args.capacity} "
        f"--repeats {args.repeats}`: the four projections of one ViT-B/16 block (qkv, attention out, fc1, "
        f"GELU, fc2; batch {args.batch_size}, {tokens} tokens in groups {sizes} of widths {widths}; "
        f"MAC ratio dense / nested {macs_ratio:.2f}x), medians of interleaved calls. The two nested forms "
        f"agree to {measured['error']:.1e} (outputs up to {measured['scale']:.0f}: float32 summation order).", "",
        "| backend | pass | dense ms | grouped ms | row blocks ms | grouped speed-up | row blocks speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, times in measured["results"].items():
        if label == "residual":
            continue
        dense = times["dense"]
        lines.append(f"| {backend} | {label} | {dense:.1f} | {times['grouped']:.1f} | {times['row blocks']:.1f} | "
                     f"{dense / times['grouped']:.2f}x | {dense / times['row blocks']:.2f}x |")
    residual = measured["results"]["residual"]
    lines += ["", f"Residual add of the four groups' thin updates ({backend}): zero-padded to D then added "
              f"{residual['pad then add']:.2f} ms, added into the first w features and concatenated with the "
              f"rest {residual['add into slice']:.2f} ms."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=197)
    parser.add_argument("--hidden-dim", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=None, help="also write the table to this file (one per backend)")
    args = parser.parse_args(argv)
    text = markdown(measure(args), args)
    print(text)
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
