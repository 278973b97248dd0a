"""Tile settings of torch's grouped nested projections against torch's per-group ops, timed on this device.

``kernels.triton_grouped_projection`` runs each nested projection of a packed MoNE block as one
Triton launch over all token groups (``$KERAS_MONE_PROJECTIONS=grouped_kernel`` on torch,
``layers.packed_kernels``). Its default tiles were chosen from code compiled for sm_90 without a
card (``bench/triton_grouped_compile.py``). This times each of a ViT-B/16 block's four projections (q/k/v,
the attention's out-projection with the residual, in float32 reading the attention's output as
CUDA's memory-efficient SDPA writes it (batch-major, a ``(tokens, batch, D)`` view; 16-bit rows
come token-major from flash attention), fc1 with the GELU, fc2 with the gate and the
residual; the in-projections with their LayerNorm, as the prologue after a statistics pass) at
MoNE-ViT-B/16's token groups at ``--capacity`` and ``--batch-size``, rows in
``--dtype`` and weights too (Keras' autocast casts them so in a model's call under mixed
precision; the LayerNorm's stay float32), for the default tiles and a list
of others, against torch's ops as the packed block runs them without the kernel (the weights
cast, Keras' LayerNorm in float32, one ``addmm`` per group into one buffer, the GELU once over
all rows, zero padding, the gate and the residual as passes of their own). Each setting's output is checked against
torch's first (within ``BOUND`` of the largest value); a setting off by more is listed as
wrong and never chosen, one Triton rejects as failed. Medians of interleaved calls, each
synchronised. It prints the fastest tiles of each shape as a ``$KERAS_MONE_PROJECTION_TILES``
value for the model runs (``bench/gpu.sh``'s ``vit_b16_b256_torch_grouped``).

    KERAS_BACKEND=torch python bench/triton_grouped_tiles.py                     # a CUDA card
    KERAS_BACKEND=torch python bench/triton_grouped_tiles.py --batch-size 1 --dim 64 --hidden 128 \\
        --tokens 20 --repeats 1 --tiles 16,16,16,4,2      # anywhere: interpreted (a smoke test, not a timing)
"""

import argparse
import math
import time

from triton_mlp import _Lines, timed_pair

CANDIDATES = [(64, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3),
              (64, 64, 32, 4, 3), (128, 128, 32, 8, 4), (128, 256, 32, 8, 3), (64, 128, 64, 4, 3)]
"""Timed after each shape's default (128 x 128 x 32 on 8 warps, 3 stages) where ``--tiles`` is not
given: one or two warpgroups, 64-256 columns, 32-64 contraction steps, 3-4 stages (compiled for
sm_90 without a card, BENCHMARKS.md: some spill a few hundred bytes; the card decides)."""
EPSILON = 1e-6
"""The blocks' LayerNorm epsilon."""
BOUND = 2**-6
"""Largest error a setting may show against torch's ops, relative to the largest value: two bf16
roundings (the kernel rounds once in float32, torch's path after each op)."""


def group_shapes(capacity, tokens, dim, experts=4):
    """``[(tokens_j, width_j)]`` of all MoNE's groups at ``capacity`` (MoNE Eq. 4's token counts,
    widths ``D / 2^(E-1-j)``), the full-width group included."""
    from keras_mone.routing.capacity import capacity_distribution
    from keras_mone.routing.epr import expert_token_counts

    counts, _ = expert_token_counts(capacity_distribution(capacity, experts), tokens)
    return [(n, dim // 2 ** (experts - 1 - j)) for j, n in enumerate(counts) if n]


def projections(dim, hidden):
    """``[(label, side, K, N, epilogue)]`` of a ViT block's four nested projections."""
    return [("LN + q/k/v", "in", dim, 3 * dim, {"norm": True}),
            ("attention out", "out", dim, dim, {"residual": True, "batch_major": True}),
            ("LN + fc1 + GELU", "in", dim, hidden, {"activation": "gelu", "norm": True}),
            ("fc2", "out", hidden, dim, {"residual": True, "scale": True})]


def torch_path(x, w, b, spans, widths, side, activation=None, residual=None, scale=None, gamma=None, beta=None,
               alpha=None):
    """The projection as the packed block runs it through torch's ops (``layers.packed_block``;
    the LayerNorm as Keras' runs it on torch: in float32, cast back; MoNE's gate factor
    ``alpha * scale + 1`` where ``alpha`` is given)."""
    import torch

    x = x.reshape(-1, x.shape[-1])  # (SDPA's batch-major output: the copy the packed block's reshape makes)
    if gamma is not None:
        x = torch.nn.functional.layer_norm(x.float(), x.shape[-1:], gamma, beta, EPSILON).to(x.dtype)
    w, b = w.to(x.dtype), b.to(x.dtype)
    if side == "in":
        out = x.new_empty((x.shape[0], w.shape[1]))
        for (start, stop), width in zip(spans, widths):
            torch.addmm(b, x[start:stop, :width], w[:width], out=out[start:stop])
        return out if activation is None else torch.nn.functional.gelu(out)
    out = x.new_zeros((x.shape[0], w.shape[1]))
    for (start, stop), width in zip(spans, widths):
        torch.addmm(b[:width], x[start:stop], w[:, :width], out=out[start:stop, :width])
    if scale is not None:
        out = out * (scale if alpha is None else (alpha * scale + 1).to(out.dtype))[:, None]
    return out if residual is None else residual + out


def inputs(rows, contraction, columns, epilogue, dtype, device, seed=0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors = {"x": torch.randn(rows, contraction, generator=generator).to(dtype),
               "w": (torch.randn(contraction, columns, generator=generator) / math.sqrt(contraction)).to(dtype),
               "b": (0.1 * torch.randn(columns, generator=generator)).to(dtype)}
    if epilogue.get("residual"):
        tensors["residual"] = torch.randn(rows, columns, generator=generator).to(dtype)
    if epilogue.get("scale"):  # MoNE's gate per row and alpha, as the model passes them
        tensors["scale"] = torch.rand(rows, generator=generator).to(dtype)
        tensors["alpha"] = torch.tensor(0.5)
    if epilogue.get("norm"):
        tensors["gamma"] = 1 + 0.1 * torch.randn(contraction, generator=generator)
        tensors["beta"] = 0.1 * torch.randn(contraction, generator=generator)
    return {k: v.to(device) for k, v in tensors.items()}


def screen(projection, groups, batch, candidates, dtype, repeats, deadline, lines):
    """Rows of one projection's table; returns ``(best tiles or None, K, N)``."""
    import torch

    from keras_mone.kernels.triton_grouped_projection import check_tiles, default_tiles, grouped_projection
    from keras_mone.kernels.triton_row_statistics import row_statistics

    label, side, contraction, columns, epilogue = projection
    limit = contraction if side == "in" else columns
    spans, widths, start = [], [], 0
    for tokens, width in groups:
        spans.append((start, start + batch * tokens))
        widths.append(min(width, limit))
        start += batch * tokens
    cuda = torch.cuda.is_available()
    tensors = inputs(start, contraction, columns, epilogue, dtype, "cuda" if cuda else "cpu")
    if epilogue.get("batch_major") and dtype == torch.float32:  # float32's SDPA (memory-efficient) output:
        # batch-major, read as (tokens, batch, D); flash attention (16-bit) writes token-major rows
        tensors["x"] = tensors["x"].reshape(-1, batch, contraction).transpose(0, 1).contiguous().transpose(0, 1)
    options = {k: v for k, v in tensors.items() if k in ("residual", "scale", "alpha")}
    layer_norm = {k: v for k, v in tensors.items() if k in ("gamma", "beta")}
    gated = {k: v for k, v in options.items() if k != "alpha"}  # the kernel takes the gate and alpha as a pair
    if "alpha" in options:
        gated["scale"] = (options["scale"], options["alpha"])
    activation = epilogue.get("activation")

    def plain():
        return torch_path(tensors["x"], tensors["w"], tensors["b"], spans, widths, side, activation, **options,
                          **layer_norm)

    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        expected = plain().float()
        largest = float(expected.abs().max())
        best, best_ms = None, math.inf
        for tiles in dict.fromkeys([default_tiles(contraction, columns), *candidates]):
            tiles = tuple(tiles)
            name = f"| {label} | {contraction}x{columns} | {tiles} "
            if time.monotonic() > deadline:
                lines.append(name + "| - | - | - | not timed: --budget spent |")
                continue

            def kernel(tiles=tiles):  # the statistics pass included: the model runs it per LayerNorm
                norm = None if not layer_norm else (*row_statistics(tensors["x"], EPSILON), layer_norm["gamma"],
                                                    layer_norm["beta"])
                return grouped_projection(tensors["x"], tensors["w"], tensors["b"], spans, widths, side, activation,
                                          norm=norm, tiles=tiles, interpret=not cuda, **gated)

            try:
                check_tiles(tiles, contraction, columns)
                error = float((kernel().float() - expected).abs().max()) / max(largest, 1e-30)
            except Exception as failure:  # noqa: BLE001 - a setting Triton rejects is reported, not fatal
                lines.append(name + f"| - | - | - | failed: {type(failure).__name__}: {str(failure)[:80]} |")
                continue
            if not error <= BOUND:
                lines.append(name + f"| - | - | {error:.1e} | wrong: off by more than {BOUND:.1e} |")
                continue
            plain_s, kernel_s = timed_pair(plain, kernel, repeats, synchronize)
            lines.append(name + f"| {1e3 * plain_s:.3f} | {1e3 * kernel_s:.3f} | {error:.1e} | "
                         f"{plain_s / kernel_s:.2f}x torch's ops |")
            if kernel_s < best_ms:
                best, best_ms = tiles, kernel_s
    return best, contraction, columns


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--tokens", type=int, default=196)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tiles", default=None,
                        help="';'-separated tile settings to time after the default (default: the built-in list)")
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds after which no new setting starts")
    args = parser.parse_args(argv)
    if not args.budget >= 0:
        parser.error(f"--budget must be a non-negative number of seconds, got {args.budget}")
    import torch

    candidates = CANDIDATES if args.tiles is None else [
        tuple(int(v) for v in entry.split(",")) for entry in args.tiles.split(";") if entry.strip()]
    groups = group_shapes(args.capacity, args.tokens, args.dim)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Triton's interpreter: no timing)"
    lines = _Lines()
    lines.append(f"Grouped nested projections (Triton) against torch's per-group ops: {device}, torch "
                 f"{torch.__version__}, {args.dtype} rows and weights, batch {args.batch_size}, groups "
                 f"{groups} (tokens, width) at e_c {args.capacity:g}; medians of {args.repeats} interleaved calls\n")
    lines.append("| projection | K x N | tiles | torch's ops ms | kernel ms | error | note |")
    lines.append("|---|---|---|---|---|---|---|")
    deadline, best = time.monotonic() + args.budget, []
    for projection in projections(args.dim, args.hidden):
        best.append(screen(projection, groups, args.batch_size, candidates, getattr(torch, args.dtype),
                           args.repeats, deadline, lines))
    lines.append("")
    for tiles, contraction, columns in best:
        lines.append(f"- {contraction}x{columns}: best {tiles}" if tiles else
                     f"- {contraction}x{columns}: no tile setting ran and matched torch's ops")
    chosen = ";".join(f"{k}x{n}={','.join(map(str, t))}" for t, k, n in best if t)
    if chosen:
        lines.append(f'\nKERAS_MONE_PROJECTION_TILES="{chosen}"')
    return "\n".join(lines)


if __name__ == "__main__":
    main()
