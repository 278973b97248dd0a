"""Which of a MoNE token group's passes XLA fuses into its GEMMs, compiled for an H200 without one (issue 40).

A nested group's MLP is fc1, the GELU and fc2 (MoNE App. A.1 Eq. 6); its attention half starts
with the LayerNorm applied to the full width and cut to the group's ``d`` features. XLA's
Triton GEMMs fuse a bias into the GEMM, but the GELU is a pass of its own that reads and
writes the ``(rows, 4D)`` hidden activations, and the LayerNorm is applied in a pass before
the GEMM (BENCHMARKS.md, "MoNE's GPU programs"). This compiles each of these small programs
for the card under XLA's default options and under ``--xla-option`` settings (for example
``xla_gpu_experimental_gemm_fusion_v2=true``), and prints the kernels and the bytes each
moves (``keras_mone.bench.hlo_kernels``). No device time is spent; nothing is timed.

    KERAS_BACKEND=jax python bench/xla_gemm_fusions.py --xla-option xla_gpu_experimental_gemm_fusion_v2=true
    KERAS_BACKEND=jax python bench/gpu_program.py --batch-size 8 --forms present \\
        --xla-option xla_gpu_experimental_gemm_fusion_v2=true      # does the whole model compile?

Needs jax's CUDA plugin, as ``bench/gpu_program.py`` (no GPU).
"""

import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the plugin's check calls cuInit

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from keras_mone.bench import gpu_program, hlo_kernels  # noqa: E402
from keras_mone.layers.activations import gelu, rational_erf  # noqa: E402

GROUP_ROWS = {96: 256 * 84, 192: 256 * 61, 384: 256 * 37, 768: 256 * 14}
"""Rows of each token group of MoNE-ViT-B/16 at e_c 0.3, batch 256 (as ``bench/kernel_tiles.py``)."""


def product_gelu(h):
    """``h Phi(h)`` with ``Phi`` in float32 and the product in ``h``'s dtype: one rounding
    more than the zoo's form (0.0098 against 0.0078 off the exact GELU on bf16 inputs in
    [-8, 8]), but ``h`` enters the float32 arithmetic once."""
    phi = 0.5 + 0.5 * rational_erf(h.astype(jnp.float32) * 0.7071067811865476)
    return h * phi.astype(h.dtype)


GELUS = {"zoo": lambda h: gelu(h, nested=True), "product": product_gelu}
"""The zoo's GELU of a nested group (``layers.activations.gelu``: float32 arithmetic, cast
back) and ``product_gelu``."""


def programs(width, rows, dim=768, hidden=3072):
    """``{name: (function, argument shapes and dtypes)}`` of one token group of ``width``."""
    bf16, f32 = jnp.bfloat16, jnp.float32

    def mlp(activation):
        def nested_mlp(x, w1, b1, w2, b2):
            return jnp.dot(activation(jnp.dot(x[:, :width], w1[:width]) + b1), w2[:, :width]) + b2[:width]

        return nested_mlp, [((rows, dim), bf16), ((dim, hidden), bf16), ((hidden,), bf16), ((hidden, dim), bf16),
                            ((dim,), bf16)]

    def norm_qkv(z, gamma, beta, w, b):
        mean = z.mean(-1, keepdims=True)
        normed = (z - mean) * jax.lax.rsqrt(jnp.square(z - mean).mean(-1, keepdims=True) + 1e-6) * gamma + beta
        return jnp.dot(normed.astype(bf16)[:, :width], w[:width]) + b

    result = {f"MLP, {name} GELU": mlp(activation) for name, activation in GELUS.items()}
    result["LayerNorm + qkv"] = (norm_qkv, [((rows, dim), f32), ((dim,), f32), ((dim,), f32),
                                             ((dim, 3 * dim), bf16), ((3 * dim,), bf16)])
    return result


def compiled_kernels(function, shapes, device, options):
    """The kernels of ``function`` compiled for ``device`` with XLA ``options``, or the error's first line."""
    placed = jax.sharding.SingleDeviceSharding(device)
    arguments = [jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for shape, dtype in shapes]
    try:
        compiled = jax.jit(function).lower(*arguments).compile(compiler_options=options or None)
    except jax.errors.JaxRuntimeError as error:
        return (str(error).splitlines() or [""])[0][:160]
    return hlo_kernels.program_kernels(compiled.as_text())


def run(args):
    device = gpu_program.compile_only_device(args.card)
    settings = {"default": {}, **({", ".join(args.xla_option): args.xla_options} if args.xla_option else {})}
    lines = [f"Compiled for {gpu_program.CARDS[args.card]['name']} without one; jax {jax.__version__}.", "",
             "| program | d | rows | XLA options | kernels | GB moved | kernels (kind, output) |", "|---" * 7 + "|"]
    for width in args.widths:
        for name, (function, shapes) in programs(width, GROUP_ROWS[width]).items():
            for label, options in settings.items():
                kernels = compiled_kernels(function, shapes, device, options)
                if isinstance(kernels, str):
                    lines.append(f"| {name} | {width} | {GROUP_ROWS[width]} | {label} | failed | | `{kernels}` |")
                    continue
                listed = ", ".join(f"{k.kind} `{k.shape}`" for k in kernels if k.bytes > 1e6)
                lines.append(f"| {name} | {width} | {GROUP_ROWS[width]} | {label} | {len(kernels)} | "
                             f"{sum(k.bytes for k in kernels) / 1e9:.3f} | {listed} |")
    return "\n".join(lines)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--card", default="h200", choices=sorted(gpu_program.CARDS))
    parser.add_argument("--widths", default="96,192,384,768",
                        type=lambda text: [int(w) for w in text.split(",") if w.strip()])
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="compile each program once more with these XLA options (repeatable)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.widths) - set(GROUP_ROWS))
    if unknown:
        parser.error(f"--widths must be among {sorted(GROUP_ROWS)}; got {unknown}.")
    try:
        args.xla_options = gpu_program.parse_xla_options(args.xla_option)
    except ValueError as error:
        parser.error(f"--xla-option: {error}")
    return args


if __name__ == "__main__":
    print(run(parse()))
