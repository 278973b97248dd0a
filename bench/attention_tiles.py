"""Tile settings of the flash-attention kernel against XLA's attention, timed on this device (jax).

``kernels.flash_attention`` (``$KERAS_MONE_ATTENTION=flash``) is softmax attention as one
Pallas kernel that never writes the scores, for float32, where cuDNN's fused attention does not
run. Its default tiles (64 queries x 64 keys, 4 warps, 2 stages) were chosen from the code
compiled for sm_90 without a card. This times the attention of the float32 sweeps of
``bench/gpu.sh``, per ``--shapes`` entry ``batch x tokens`` at 12 heads of 64 (ViT-B/16 and
ViViT-FE-B/16): ViViT's spatial encoder at batch 1 (16 frames of 257 tokens), its temporal
encoder (17), ViT-B/16 at batch 64 (197). Each setting's output is checked against
``plain_attention`` compiled by XLA first (``bench/kernel_check.py``'s bounds); a setting off by
more is listed as wrong and never chosen, one the compiler rejects as failed. The fastest
setting of each sequence length prints as a ``$KERAS_MONE_ATTENTION_TILES`` value
(``QxK=tiles``), which ``bench/gpu_forms.py --forms ...flash_attention`` then runs in the whole
model (two ``--shapes`` entries of one length keep the first's winner). ``--budget`` stops the
sweep after that many seconds and names what it left.

    KERAS_BACKEND=jax python bench/attention_tiles.py                                   # a GPU
    KERAS_BACKEND=jax python bench/attention_tiles.py --shapes 2x37 --heads 2 --head-dim 16 \\
        --repeats 1 --tiles "16,16,4,2;32,16,4,2"                                       # a CPU smoke test
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
from grouped_tiles import add_screen_options, report, screen, screen_setup
from kernel_check import BOUNDS, GPU_BOUNDS

from keras_mone.kernels.flash_attention import (
    TILES_ENV, check_inputs, check_tiles, default_tiles, flash_attention, plain_attention,
)

SHAPES = "16x257,1x17,64x197"
"""``batch x tokens`` of the float32 sweeps' attention: ViViT-FE-B/16 on 32x256x256 clips at batch 1
(the spatial encoder: 16 frames of 256 patches and a class token; the temporal one: 16 frame tokens
and a class token) and ViT-B/16 at batch 64 (196 patches and a class token)."""
CANDIDATES = [(128, 64, 8, 2), (64, 32, 4, 3), (64, 32, 4, 2), (128, 32, 8, 2), (128, 32, 8, 3),
              (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 2), (16, 16, 1, 2)]
"""Timed after the default (``default_tiles``: 64 x 64 on 4 warps, 2 stages) where ``--tiles`` is not
given: 64 or 128 query rows on one or two warpgroups, 32-64 keys per step, 2-3 stages. Compiled for
sm_90 here at ViViT's ``(16, 257, 12, 64)`` in float32 (``bench/kernel_compile.py``'s
``compile_stats``; BENCHMARKS.md) all take wgmma without spills, except two settings kept for
comparison with the older per-warp MMA: 32 x 64, and 16 x 16 on one warp, for short sequences
(ViViT's temporal encoder has 17 tokens: a 64-row tile is three quarters padding). 128 x 64 on
4 warps and 128-key steps spilled and are left out."""


def inputs(batch, tokens, heads, head_dim, dtype, seed=0):
    """Random ``(q, k, v)``, each ``(batch, tokens, heads, head_dim)`` in ``dtype``."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return [jax.random.normal(key, (batch, tokens, heads, head_dim), dtype) for key in keys]


def sweep(batch, tokens, heads, head_dim, candidates, dtype, repeats, interpret, deadline, log):
    """``[(tiles, ms or None, error or None, note)]`` for one shape, XLA's attention first."""
    arguments = inputs(batch, tokens, heads, head_dim, dtype)
    check_inputs(*arguments)

    def kernel(tiles):
        check_tiles(tiles)
        return jax.jit(lambda q, k, v: flash_attention(q, k, v, tiles=tiles, interpret=interpret))

    bound = (BOUNDS if interpret else GPU_BOUNDS)[jnp.dtype(dtype).name]
    return screen(f"{batch}x{tokens}", jax.jit(plain_attention), kernel, arguments, bound,
                  default_tiles(head_dim, dtype), candidates, repeats, deadline, log)


def parse_shapes(text):
    """``[(batch, tokens)]`` of ``--shapes`` (``BxN,BxN``); ``ValueError`` naming the option."""
    try:
        shapes = [tuple(int(v) for v in entry.split("x")) for entry in text.split(",") if entry]
    except ValueError:
        shapes = None
    if not shapes or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        raise ValueError(f"--shapes must read batch x tokens entries separated by commas (e.g. {SHAPES}), "
                         f"got {text!r}")
    return shapes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=SHAPES, help="batch x tokens per attention call, comma-separated")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--matmul-precision", default="default", choices=["default", "highest"],
                        help="jax's default_matmul_precision: 'default' is TF32 on an H100 / H200, 'highest' "
                        "IEEE float32 (MoNE Table 1's V100)")
    add_screen_options(parser, "block_q,block_k,warps,stages")
    args = parser.parse_args(argv)
    candidates, interpret, device, log = screen_setup(parser, args, CANDIDATES, "attention_tiles")
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as error:
        parser.error(str(error))
    dtype = jnp.dtype(args.dtype)
    deadline = time.monotonic() + args.budget
    print(f"Flash-attention tiles on {device}, jax {jax.__version__}, {args.dtype}, matmul precision "
          f"{args.matmul_precision}, {args.heads} heads of {args.head_dim}, medians of {args.repeats}; "
          f"`KERAS_BACKEND=jax python bench/attention_tiles.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("| batch x tokens | queries x keys | tiles (block_q, block_k, warps, stages) | ms | XLA / kernel "
          "| error / max value | note |\n|---|---|---|---|---|---|---|")
    best = {}
    with jax.default_matmul_precision(args.matmul_precision):
        for batch, tokens in shapes:
            results = sweep(batch, tokens, args.heads, args.head_dim, candidates, dtype, args.repeats, interpret,
                            deadline, log)
            entry = report(f"{batch}x{tokens}", f"{tokens}x{tokens}", results)
            if entry:
                best.setdefault(f"{tokens}x{tokens}", entry)
    print(f"\n{TILES_ENV}=\"{';'.join(best.values())}\"")


if __name__ == "__main__":
    main()
