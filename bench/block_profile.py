"""Where one transformer block's time goes: dense ViT vs MoNE at a capacity.

Times each part of one ViT-B/16 block (batch 8, 197 tokens) the way the
models run on the backend of ``KERAS_BACKEND`` (jax: ``jax.jit``; tensorflow:
``tf.function``, no XLA, as Keras' ``jit_compile="auto"`` on a CPU; torch:
eager under ``no_grad``), for the dense block and for a MoNE block whose tokens are already grouped by
expert at ``--capacity`` (Eq. 3 distribution, Algorithm 1 counts):

* ``layer_norms``: LN1 + LN2 at full width D over every token;
* ``qkv``, ``attention_out``, ``fc1``, ``fc2``: the projections, one nested
  matmul per expert group (the only parts whose MACs shrink with e_c);
* ``attention_core``: ``softmax(q k^T) v`` over every token at full width;
* ``gelu``: the exact GELU over the full 4D hidden width of every token;
* ``block``: the whole ``ViTBlock`` call, for comparison with the sum.

On jax it also reports the temporary memory of the compiled forward pass
(XLA's ``memory_analysis``) of one block and of the whole dense and MoNE
backbones (``--depth`` blocks, 224x224 images, patch 16).

Each part reports milliseconds (median of ``--repeats``, the dense and the
MoNE version timed alternately, call by call), its MACs and its
achieved GMAC/s; the last column is its share of the MoNE block. The parts
whose time does not shrink with e_c (LayerNorm, attention core, GELU) are what
keeps the measured speed-up below the FLOP ratio.

    KERAS_BACKEND=jax python bench/block_profile.py [--capacity 0.3] [--write]
    KERAS_BACKEND=torch python bench/block_profile.py    # or tensorflow
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

import keras

from keras_mone.layers.attention import multi_head_attention
from keras_mone.layers.block import ViTBlock
from keras_mone.routing import capacity_distribution, expert_token_counts

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "BENCHMARKS.md")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=197)
    parser.add_argument("--hidden-dim", type=int, default=768)
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--depth", type=int, default=12, help="blocks of the backbones whose memory is reported")
    parser.add_argument("--write", action="store_true", help="append the report to BENCHMARKS.md")
    return parser.parse_args(argv)


RUNNERS = {"jax": "jit", "tensorflow": "tf.function", "torch": "eager"}


def prepared(block, fn, inputs):
    """``(run, temp)``: a no-argument callable running ``fn(*inputs)`` as the
    backend runs models, and the MiB of temporaries of the compiled function
    (jax only, else ``None``)."""
    backend = keras.backend.backend()
    if backend == "jax":
        return _compiled_jax(block, fn, inputs)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(lambda: fn(*inputs)), None
    import torch

    def run():
        with torch.no_grad():
            return fn(*inputs)

    return run, None


@contextlib.contextmanager
def replaced(module, name, value):
    """``module.name`` set to ``value`` inside the context (an old form undone while a model is traced)."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def interleaved_medians(runs, repeats):
    """Median milliseconds of each callable of ``runs`` (label -> callable),
    timed round-robin (one call of each per round), so that a change of the
    machine's load during the measurement hits all of them alike."""
    for run in runs.values():
        _wait(run())  # compile / warm up
    samples = {label: [] for label in runs}
    for _ in range(repeats):
        for label, run in runs.items():
            start = time.perf_counter()
            _wait(run())
            samples[label].append(time.perf_counter() - start)
    return {label: 1e3 * statistics.median(times) for label, times in samples.items()}


def _wait(outputs):
    """Blocks until ``outputs`` exist (jax dispatches asynchronously)."""
    if keras.backend.backend() == "jax":
        import jax

        jax.block_until_ready(outputs)


def _compiled_jax(block, fn, inputs):
    """``jax.jit(fn)`` with the block's weights as arguments of the compiled
    function (as in a Keras model), not constants; and its temporary MiB."""
    import jax

    variables = block.weights

    def stateless(values, *args):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            return fn(*args)

    values = [v.value for v in variables]
    compiled = jax.jit(stateless).lower(values, *inputs).compile()
    memory = compiled.memory_analysis()
    temp = None if memory is None else memory.temp_size_in_bytes / 2**20
    return (lambda: compiled(values, *inputs)), temp


def block_parts(block, groups, widths, gates, seed=0):
    """``name -> (function, its inputs, MACs)`` for one block on ``groups``."""
    attention, mlp, hidden = block.attention, block.mlp, block.hidden_dim
    batch, tokens = groups[0].shape[0], sum(g.shape[1] for g in groups)
    rng = keras.random.SeedGenerator(seed)
    qkv_full = keras.random.normal((batch, tokens, 3, block.num_heads, hidden // block.num_heads), seed=rng)
    hidden_groups = [keras.random.normal(g.shape[:2] + (block.mlp_dim,), seed=rng) for g in groups]

    def per_group(macs_per_token):
        return batch * sum(g.shape[1] * macs_per_token(w) for g, w in zip(groups, widths))

    return {
        "layer_norms": (lambda *gs: [block.norm2(block.norm1(g)) for g in gs], groups, 0),
        "qkv": (
            lambda *gs: [attention.qkv(g, in_width=w) for g, w in zip(gs, widths)],
            groups, per_group(lambda w: w * 3 * hidden),
        ),
        "attention_core": (multi_head_attention, [qkv_full], 2 * batch * tokens * tokens * hidden),
        "attention_out": (
            lambda *gs: [attention.out(g, out_width=w) for g, w in zip(gs, widths)],
            groups, per_group(lambda w: hidden * w),
        ),
        "fc1": (
            lambda *gs: [mlp.fc1(g, in_width=w) for g, w in zip(gs, widths)],
            groups, per_group(lambda w: w * block.mlp_dim),
        ),
        "gelu": (lambda *hs: [keras.ops.gelu(h, approximate=False) for h in hs], hidden_groups, 0),
        "fc2": (
            lambda *hs: [mlp.fc2(h, out_width=w) for h, w in zip(hs, widths)],
            hidden_groups, per_group(lambda w: block.mlp_dim * w),
        ),
        # The nested slices of the four kernels (W[:d] of qkv and fc1, W[:, :d] of
        # the out-projections): XLA copies them out of the weights on every call
        # (torch and tensorflow slice lazily or pass strides to the matmul).
        "weight_slices": (
            lambda *gs: [
                layer.kernel[:w] if nested_in else layer.kernel[:, :w]
                for w in widths if w < hidden
                for layer, nested_in in ((attention.qkv, True), (attention.out, False), (mlp.fc1, True), (mlp.fc2, False))
            ],
            groups, 0,
        ),
        "block": (lambda gs, gt: block(gs, widths=widths, gates=gt), [groups, gates], None),
    }


def profile(args):
    hidden, tokens = args.hidden_dim, args.tokens
    block = ViTBlock(hidden, args.num_heads, 4 * hidden, routed=True)
    block.build((None, None, hidden))
    num_experts = 4
    widths_all = [hidden // 2 ** (num_experts - 1 - j) for j in range(num_experts)]
    counts, _ = expert_token_counts(capacity_distribution(args.capacity, num_experts), tokens)
    layouts = {
        "dense": ([tokens], [hidden]),
        f"MoNE e_c {args.capacity:g}": (
            [c for c in counts if c], [w for c, w in zip(counts, widths_all) if c]
        ),
    }
    parts = {}
    for name, (sizes, widths) in layouts.items():
        rng = keras.random.SeedGenerator(0)
        groups = [keras.random.normal((args.batch_size, k, hidden), seed=rng) for k in sizes]
        gates = [keras.ops.full((args.batch_size, k), 0.5) for k in sizes]
        parts[name] = block_parts(block, groups, widths, gates)
        print(f"{name}: tokens per expert {sizes} at widths {widths}")
    rows = {}
    for part in parts[next(iter(layouts))]:
        runs, macs = {}, {}
        for name in layouts:
            fn, inputs, macs[name] = parts[name][part]
            runs[name], temp = prepared(block, fn, inputs)
            if part == "block":
                rows.setdefault("_temp_mib", {})[name] = temp
        for name, ms in interleaved_medians(runs, args.repeats).items():
            rows.setdefault(part, {})[name] = (ms, macs[name])
    return rows, list(layouts)


def backbone_memory(args):
    """MiB of temporaries of the compiled forward pass of the dense and the MoNE
    backbone (jax; ``None`` on the other backends)."""
    if keras.backend.backend() != "jax":
        return {"dense": None, "MoNE": None}
    import jax

    from keras_mone.models import MoNEViTBackbone, ViTBackbone

    config = dict(
        image_size=224, patch_size=16, hidden_dim=args.hidden_dim, depth=args.depth,
        num_heads=args.num_heads, mlp_dim=4 * args.hidden_dim,
    )
    images = keras.ops.zeros((args.batch_size, 224, 224, 3))
    memory = {}
    for name, model in (("dense", ViTBackbone(**config)), ("MoNE", MoNEViTBackbone(**config, capacity=args.capacity))):
        model.build()
        state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])
        forward = jax.jit(lambda trainable, other, x, model=model: model.stateless_call(trainable, other, x)[0])
        analysis = forward.lower(*state, images).compile().memory_analysis()
        memory[name] = None if analysis is None else analysis.temp_size_in_bytes / 2**20
    return memory


def markdown(rows, names, args, memory):
    dense, mone = names
    mone_block = rows["block"][mone][0]
    backend = keras.backend.backend()
    lines = [
        f"One ViT-B/16 block, batch {args.batch_size}, {args.tokens} tokens, backend "
        f"{backend} ({RUNNERS[backend]}); median of {args.repeats}, dense and MoNE timed "
        "alternately. Command: "
        f"`KERAS_BACKEND={backend} python bench/block_profile.py --capacity {args.capacity:g} --depth {args.depth}`",
        "",
        f"| part | dense ms | {mone} ms | dense / MoNE time | dense / MoNE MACs | MoNE GMAC/s | share of MoNE block |",
        "|---|---|---|---|---|---|---|",
    ]
    temp = rows.pop("_temp_mib")
    for part, values in rows.items():
        (d_ms, d_macs), (m_ms, m_macs) = values[dense], values[mone]
        mac_ratio = f"{d_macs / m_macs:.2f}x" if m_macs else "-"
        rate = f"{m_macs / m_ms / 1e6:.0f}" if m_macs else "-"
        share = "100%" if part == "block" else f"{100 * m_ms / mone_block:.0f}%"
        speed = f"{d_ms / m_ms:.2f}x" if m_ms >= 0.01 and d_ms >= 0.01 else "-"
        lines.append(f"| {part} | {d_ms:.2f} | {m_ms:.2f} | {speed} | {mac_ratio} | {rate} | {share} |")
    if None not in temp.values():
        lines += ["", f"Compiled temporary memory of one block: dense {temp[dense]:.1f} MiB, {mone} {temp[mone]:.1f} MiB."]
    if None not in memory.values():
        lines.append(
            f"Compiled temporary memory of the whole forward pass ({args.depth} blocks, 224x224, batch "
            f"{args.batch_size}): dense {memory['dense']:.0f} MiB, {mone} {memory['MoNE']:.0f} MiB."
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rows, names = profile(args)
    report = markdown(rows, names, args, backbone_memory(args))
    print(report)
    if args.write:
        with open(BENCHMARKS, "a") as handle:
            handle.write(f"\n### Block profile (issue 3, {keras.backend.backend()})\n\n" + report)


if __name__ == "__main__":
    main()
