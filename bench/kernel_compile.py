"""What an H100/H200's compiler makes of the fused nested MLP kernel, without a GPU (issue 40).

Lowers ``kernels.fused_nested_mlp`` for CUDA with Pallas' Triton lowering (its ``debug``
dump of the Triton IR), compiles that IR with the ``triton`` package for sm_90 and runs
``ptxas -v`` on the PTX: registers per thread, spilled bytes and shared memory per program,
for each group width and launch setting. Spills or shared memory past the card's 227 KB
show a tiling that would run slowly or not at all, before any GPU time is spent on it.
XLA compiles the kernel with its own (pinned) Triton, so figures may differ slightly.

    pip install --target /tmp/tritonpkg triton --no-deps   # the compiler (no GPU needed)
    PYTHONPATH=/tmp/tritonpkg KERAS_BACKEND=jax python bench/kernel_compile.py
"""

import argparse
import contextlib
import functools
import io
import math
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp

from keras_mone.kernels import fused_nested_mlp as kernel
from keras_mone.kernels import fused_residual_mlp as residual_kernel
from keras_mone.kernels import tiles
from keras_mone.kernels.cuda_lowering import lower_for_cuda
from keras_mone.layers.mlp import _kernel_gelu


def triton_ir(width, hidden, dim, dtype, block_rows=None, block_hidden=None, which="mlp"):
    """The Triton IR of one group's kernel (``which``: "mlp", ``fused_nested_mlp``, or
    "residual", ``fused_residual_mlp``), as Pallas lowers it for CUDA, locations removed.
    (It does not depend on num_warps / num_stages: those are compile options.)"""
    shapes = ((4096, dim), (dim, hidden), (hidden,), (hidden, dim), (dim,))
    if which == "residual":
        shapes = ((4096, dim), (dim,), (dim,)) + shapes[1:] + ((4096,),)
    function = residual_kernel.fused_residual_mlp if which == "residual" else kernel.fused_nested_mlp

    def mlp(*arguments):
        return function(*arguments, width, _kernel_gelu(False), block_rows=block_rows, block_hidden=block_hidden)

    return pallas_triton_ir(mlp, *[jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape in shapes])


def pallas_triton_ir(function, *spec):
    """The Triton IR of the (first) Pallas kernel ``function`` launches on ``spec``'s shapes, as
    Pallas lowers it for CUDA (its ``debug`` dump), locations removed."""
    from jax.experimental import pallas as pl

    original = pl.pallas_call
    pl.pallas_call = functools.partial(original, debug=True)  # prints the jaxpr, then the Triton module
    try:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            lower_for_cuda(function, *spec)
    finally:
        pl.pallas_call = original
    module = printed.getvalue().split("The Triton module for pallas_call", 1)[1].split("\n", 1)[1]
    module = module[module.index("module @"): module.index("\n}") + 2]
    module = re.sub(r' "[^"\n]*"\(#loc\d*\)| loc\([^\n]*\)$| \[unknown\]', "", module, flags=re.M)
    return re.sub(r"^#loc\d*\s*=.*$", "", module, flags=re.M)


def inner_loop(ptx):
    """The opcodes of the PTX's innermost loop (the hidden-block loop: from the header LLVM
    marks "Inner Loop Header" to the branch back to it), predicates dropped; ``[]`` if none."""
    lines = ptx.splitlines()
    header = next((i for i, line in enumerate(lines) if "Inner Loop Header" in line), None)
    if header is None:
        return []
    label = lines[header].split(":")[0].strip()
    branch = re.compile(rf"\bbra(\.uni)?\s+{re.escape(label)};")
    back = next((i for i in range(header + 1, len(lines)) if branch.search(lines[i])), None)
    opcodes = []
    for line in lines[header + 1:(back or header) + 1]:
        text = re.sub(r"^@!?%p\d+\s+", "", line.strip())
        if text and not text.startswith(("//", ".loc", "$", "{", "}")):
            opcodes.append(text.split()[0].rstrip(";"))
    return opcodes


_FLOAT_OP = re.compile(r"^((fma|mul|add|sub|max|min|neg|abs)(\.\w+)*\.f32|cvt\.[\w.]*(f32|bf16|f16)[\w.]*)$")
"""float32 arithmetic, rounding modes and flush-to-zero included, and conversions to or from
floating point (not integer or address conversions)."""


def loop_work(opcodes, width, block_rows, block_hidden, num_warps):
    """What one pass of the hidden-block loop issues against what it needs, per program:
    ``tensor_issued_over_needed``: the MMA FLOPs its threads issue over a hidden block's
    ``4 d rows block_hidden`` (fc1 and fc2); ``divisions_per_element``: ``div`` instructions
    over the block's ``rows x block_hidden`` hidden elements (the rational GELU divides once
    per element, so 2 means every element's GELU is computed twice); ``float_per_element``:
    float32 arithmetic and floating-point conversions per hidden element (all NaN where no
    loop was found). A pass is one hidden block: Triton
    pipelines the loop without unrolling it. Replicated work appears where a tile holds fewer
    rows than its warps' MMAs cover (64 per warpgroup of 4 warps for wgmma, 16 per warp for
    mma.sync): Triton then gives the extra warps copies of the same product."""
    threads, elements = 32 * num_warps, block_rows * block_hidden
    issued = 0
    for opcode in opcodes:
        shape = re.search(r"\.m(\d+)n(\d+)k(\d+)\.", opcode)
        if shape and "mma" in opcode:
            flops = 2 * int(shape.group(1)) * int(shape.group(2)) * int(shape.group(3))
            issued += flops * (num_warps // 4 if opcode.startswith("wgmma") else num_warps)
    if not opcodes:  # no loop found in the PTX: nothing to count
        return dict.fromkeys(("tensor_issued_over_needed", "divisions_per_element", "float_per_element"), math.nan)
    floats = sum(bool(_FLOAT_OP.match(o)) for o in opcodes)
    return {"tensor_issued_over_needed": issued / (4 * width * elements),
            "divisions_per_element": sum(o.startswith("div.") for o in opcodes) * threads / elements,
            "float_per_element": floats * threads / elements}


def loop_spills(sass):
    """How many spill instructions (``STL``, ``LDL``: local memory) of ``nvdisasm``'s SASS lie
    inside a loop (between a label and a branch back to it): those run every iteration, where
    spills before or after the main loop run once per program."""
    lines = sass.splitlines()
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if re.match(r"\s*\.L_x_\d+:", line)}
    inside = set()
    for i, line in enumerate(lines):
        target = re.search(r"\bBRA\b.*?\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i:
            inside.update(k for k in range(labels[target.group(1)], i + 1) if re.search(r"\b(STL|LDL)\b", lines[k]))
    return len(inside)


def compile_stats(ir_text, num_warps, num_stages, capability=90, tile=None):
    """``{registers, spill_bytes, shared_bytes, mma, loop_spills}`` of the IR compiled for
    ``sm_<capability>``; ``mma``: the tensor-core instructions its dots became, ``"wgmma"``
    (Hopper's warpgroup MMA, which Triton takes for tiles of at least 64 rows) or ``"mma.sync"``
    (the older per-warp form), or ``"none"``; ``loop_spills``: spill instructions inside loops
    (``loop_spills``). With ``tile`` = ``(width, block_rows, block_hidden)``, also ``loop_work``
    of the hidden-block loop."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ir_text)
        compiled = triton.compile(path, target=GPUTarget("cuda", capability, 128),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        with open(os.path.join(folder, "kernel.ptx"), "w") as f:
            f.write(compiled.asm["ptx"])
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        command = [ptxas, f"-arch=sm_{capability}a", "-v", os.path.join(folder, "kernel.ptx"),
                   "-o", os.path.join(folder, "kernel.cubin")]
        report = subprocess.run(command, capture_output=True, text=True, check=True)
        nvdisasm = os.path.join(os.path.dirname(ptxas), "nvdisasm")
        sass = subprocess.run([nvdisasm, "-c", os.path.join(folder, "kernel.cubin")], capture_output=True, text=True,
                              check=True).stdout
    text = report.stdout + report.stderr
    spills = re.search(r"(\d+) bytes spill stores", text)
    ptx = compiled.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    stats = {"registers": int(re.search(r"Used (\d+) registers", text).group(1)),
             "spill_bytes": int(spills.group(1)) if spills else 0, "shared_bytes": compiled.metadata.shared,
             "mma": mma, "loop_spills": loop_spills(sass)}
    if tile is not None:
        stats.update(loop_work(inner_loop(ptx), *tile, num_warps))
    return stats


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=("mlp", "residual"), default="mlp",
                        help="fused_nested_mlp, or fused_residual_mlp (LayerNorm, MLP, gate and residual)")
    parser.add_argument("--widths", default="96,192,384", help="group widths d (ViT-B/16: D/8, D/4, D/2)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--block-hidden", default="", help="block_hidden values to try (default: default_blocks)")
    parser.add_argument("--block-rows", default="", help="block_rows values to try (default: default_blocks)")
    args = parser.parse_args()
    itemsize = jnp.dtype(args.dtype).itemsize
    print(f"{args.kernel} kernel compiled for sm_90 (D={args.dim}, H={args.hidden}, {args.dtype}; "
          f"python bench/kernel_compile.py --kernel {args.kernel} --dtype {args.dtype})\n")
    print("| d | block_rows x block_hidden | warps | stages | registers | spilled bytes | shared KB | MMA "
          "| MMA FLOPs issued / needed | divisions (GELUs) per hidden element | float ops per hidden element "
          f"| weight bytes loaded per hidden element (XLA's path: {4 * itemsize} from memory) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for width in (int(w) for w in args.widths.split(",")):
        default_rows, default_hidden = tiles.default_blocks(width, args.hidden, itemsize)
        for rows in [int(r) for r in args.block_rows.split(",") if r] or [default_rows]:
            for block_hidden in [int(b) for b in args.block_hidden.split(",") if b] or [default_hidden]:
                ir_text = triton_ir(width, args.hidden, args.dim, args.dtype, block_rows=rows,
                                    block_hidden=block_hidden, which=args.kernel)
                for warps in (int(w) for w in args.warps.split(",")):
                    for stages in (int(s) for s in args.stages.split(",")):
                        s = compile_stats(ir_text, warps, stages, tile=(width, rows, block_hidden))
                        print(f"| {width} | {rows} x {block_hidden} | {warps} | {stages} | {s['registers']} | "
                              f"{s['spill_bytes']} | {s['shared_bytes'] / 1024:.0f} | {s['mma']} | "
                              f"{s['tensor_issued_over_needed']:.2f} | {s['divisions_per_element']:.2f} | "
                              f"{s['float_per_element']:.1f} | "
                              f"{tiles.weight_bytes_per_hidden_element(width, rows, itemsize):g} |", flush=True)


if __name__ == "__main__":
    main()
