"""A roofline model of one ViT-B/16 block, dense and MoNE, on a GPU (issue 40): why MoNE's
FLOP savings did not reach the H200, and what the fused kernels change.

Every op is timed at its bound, ``max(FLOPs / peak, bytes / bandwidth)``, each op reading
its inputs from and writing its outputs to device memory (what XLA's separate GEMMs and
fusions do); attention is one fused kernel. A model, not a measurement: it ignores launch
gaps and GEMM efficiency at narrow widths, so it bounds the speed-up from above. The
measured H200 figures of issue 40 (1.33x at batch 256, bf16) sit under its "plain" column.

    python bench/roofline.py                       # H200, bf16, batch 256, e_c 0.3 and 0.5
    python bench/roofline.py --card h100 --batch-size 64
"""

import argparse

from keras_mone.routing.capacity import capacity_distribution
from keras_mone.routing.epr import expert_token_counts

#: dense bf16 tensor-core peak (no sparsity) and HBM bandwidth, from the vendors' data sheets
CARDS = {"h200": (989e12, 4.8e12), "h100": (989e12, 3.35e12)}
D, HIDDEN, TOKENS, BYTES = 768, 3072, 197, 2  # ViT-B/16 at 224, bfloat16 activations and weights


def op_time(flops, elements, card):
    """Seconds of one op at its roofline bound; ``elements`` read plus written."""
    peak, bandwidth = CARDS[card]
    return max(flops / peak, elements * BYTES / bandwidth)


def block_time(groups, batch, card, form="plain"):
    """One block's ops for token ``groups`` (``(tokens, width)`` pairs), summed; returns
    ``{part: seconds}``. A dense block is one group at width D. ``form``: "plain" (XLA's
    ops), "fused MLP" (``kernels.fused_nested_mlp`` for nested groups) or "fused half"
    (``kernels.fused_residual_mlp``: LayerNorm 2, MLP, gate and residual in one kernel)."""
    n_all = batch * TOKENS
    norms = 2 * op_time(0, 3 * n_all * D, card)  # each: read the stream (and a branch), write it
    parts = {"attention (fused)": op_time(4 * batch * TOKENS ** 2 * D, 4 * n_all * D, card)}
    qkv = out = mlp = 0.0
    for tokens, width in groups:
        n = batch * tokens
        qkv += op_time(2 * n * width * 3 * D, n * width + width * 3 * D + 3 * n * D, card)
        out += op_time(2 * n * D * width, n * D + D * width + n * D, card)  # written padded to D
        flops, weights = 4 * n * width * HIDDEN, 2 * width * HIDDEN
        if form == "fused half" and width < D:  # reads z, writes its first `width` features in place
            norms -= op_time(0, 3 * n * D, card)
            mlp += op_time(flops, n * D + weights + n * width, card)
        elif form != "plain" and width < D:  # x, weights and the (n, width) output only
            mlp += op_time(flops, n * width + weights + n * D, card)
        else:
            mlp += op_time(flops / 2, n * width + weights / 2 + n * HIDDEN, card)  # fc1 (+ bias)
            if width < D:  # nested: GELU a fusion of its own (dense: in fc1's epilogue)
                mlp += op_time(0, 2 * n * HIDDEN, card)
            mlp += op_time(flops / 2, n * HIDDEN + weights / 2 + n * D, card)  # fc2, padded
    parts.update({"layer norms, residuals": norms, "qkv projection": qkv, "out projection": out, "MLP": mlp})
    return parts


FORMS = ("plain", "fused MLP", "fused half")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--card", choices=sorted(CARDS), default="h200")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--capacities", default="0.3,0.5")
    args = parser.parse_args()
    dense = block_time([(TOKENS, D)], args.batch_size, args.card)
    print(f"Roofline model of one ViT-B/16 block, {args.card.upper()} bf16, batch {args.batch_size} "
          f"(microseconds; python bench/roofline.py --card {args.card} --batch-size {args.batch_size})\n")
    capacities = args.capacities.split(",")
    print("| part | dense | " + " | ".join(f"e_c {c}: {form}" for c in capacities for form in FORMS) + " |")
    print("|---|---|" + "---|" * len(FORMS) * len(capacities))
    columns = []
    for capacity in (float(c) for c in capacities):
        counts, _ = expert_token_counts(capacity_distribution(capacity, 4), TOKENS)
        groups = [(n, D // 2 ** (3 - j)) for j, n in enumerate(counts) if n]
        columns += [block_time(groups, args.batch_size, args.card, form) for form in FORMS]
    for part in dense:
        print(f"| {part} | {1e6 * dense[part]:.0f} | " + " | ".join(f"{1e6 * c[part]:.0f}" for c in columns) + " |")
    total = sum(dense.values())
    print(f"| **block** | **{1e6 * total:.0f}** | "
          + " | ".join(f"**{1e6 * sum(c.values()):.0f}** ({total / sum(c.values()):.2f}x)" for c in columns) + " |")


if __name__ == "__main__":
    main()
