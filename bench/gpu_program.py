"""The GPU program of each form, compiled for an H100/H200 on a machine without a GPU (issue 40).

For each form (``bench/gpu_forms.py``'s names: ``present``, ``joint_norms``, ``free``, ...)
the dense and the MoNE classifier's forwards are compiled by XLA for the card
(``keras_mone.bench.gpu_program``) and their optimised programs read: kernels by kind,
bytes read and written, GEMM and attention FLOPs, and the roofline bound
``sum(max(FLOPs / peak, bytes / bandwidth))``. No device time is spent; nothing is
timed: the figures say what the card is given, and where a form's kernels and bytes go.

    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"  # no GPU needed
    KERAS_BACKEND=jax python bench/gpu_program.py --batch-size 256 --forms present,joint_norms
    KERAS_BACKEND=jax python bench/gpu_program.py --train --batch-size 128 --forms present --memory
    KERAS_BACKEND=jax python bench/gpu_program.py --family vivit --capacity 0.4 --batch-size 1 \
        --precision float32 --cublas-gemms [--matmul-precision highest]

``--gelu-approximate`` builds both models with the tanh GELU, the function of the AugReg
presets (big_vision's flax code); under ``--cublas-gemms --xla-option xla_gpu_enable_cublaslt=true``
XLA gives it to cuBLASLt as fc1's epilogue (BENCHMARKS.md, "The tanh GELU in cuBLASLt's epilogue").
``--memory`` adds what each program holds at its memory peak (``keras_mone.bench.hlo_memory``:
read from XLA's dump of the compile). ``--xla-option NAME=VALUE`` (repeatable) compiles every
program with that XLA option (``gpu_program.parse_xla_options``); a program XLA fails to
compile (a ``JaxRuntimeError``) is reported with its error and the others go on; an error
while tracing still stops the run. ``--cublas-gemms`` gives every GEMM to cuBLAS: without
a device XLA cannot autotune its Triton GEMMs, and for some float32 shapes (ViViT's) its
untuned choice fails to compile.
"""

import os
import sys

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the plugin's check calls cuInit
if "--cublas-gemms" in sys.argv:  # read when jax creates its backends, so before any compile
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()

import argparse  # noqa: E402
import gzip  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402

from gpu_forms import TANH_GELU_NOTE, form_environment, form_settings  # noqa: E402
from keras_mone.analysis import flop_ratio  # noqa: E402
from keras_mone.bench import gpu_program, hlo_kernels, hlo_memory  # noqa: E402
from keras_mone.bench.device import precision_policy  # noqa: E402
from keras_mone.bench.models import _build, _model_specs  # noqa: E402

KINDS = ("gemm", "attention", "pallas", "fusion", "reduce", "copy", "other")


def run(args):
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    for form in forms:
        form_settings(form)  # fails early on a bad name
    device = gpu_program.compile_only_device(args.card)
    overrides = {"gelu_approximate": True} if args.gelu_approximate else {}
    specs = _model_specs(args.variant, [args.capacity], args.image_size, overrides, args.family)
    (_, dense_preset, dense_kwargs), (_, mone_preset, mone_kwargs) = specs
    with precision_policy(args.precision):
        dense, mone = _build(dense_preset, dense_kwargs), _build(mone_preset, mone_kwargs)
    dtype = next((d for d in ("bfloat16", "float16") if d in args.precision), "float32")  # the matmuls' dtype
    rows, tops, peaks, failures = [], {}, {}, []
    for form in forms:
        for label, model in (("dense", dense), ("MoNE", mone)):
            with precision_policy(args.precision), form_environment(form), \
                    jax.default_matmul_precision(args.matmul_precision):
                started = time.perf_counter()
                compile_step = gpu_program.compiled_train_step if args.train else gpu_program.compiled_forward
                try:
                    with tempfile.TemporaryDirectory() as folder:
                        compiled = compile_step(model, args.batch_size, device, xla_options=args.xla_options,
                                                dump_to=folder if args.memory else None)
                        memory = hlo_memory.program_memory(folder) if args.memory else None
                except jax.errors.JaxRuntimeError as error:  # XLA's experimental options fail on some programs
                    first_line = (str(error).splitlines() or [""])[0]
                    failures.append((form, label, f"{type(error).__name__}: {first_line[:300]}"))
                    print(f"[gpu_program] {label} {form}: compile failed: {failures[-1][2]}", file=sys.stderr,
                          flush=True)
                    continue
                seconds = time.perf_counter() - started
            text = compiled.as_text()
            kernels = hlo_kernels.program_kernels(text)
            summary = gpu_program.program_summary(kernels, args.card, dtype, args.matmul_precision)
            summary["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
            if memory is not None:
                summary["live_peak_bytes"] = memory.live_peak_bytes
                peaks[f"{label} {form}"] = memory
            rows.append((form, label, summary, seconds))
            tops[f"{label} {form}"] = hlo_kernels.kernel_counts(kernels, args.top)
            if args.output:
                os.makedirs(args.output, exist_ok=True)
                name = f"{label}_{form}".replace("+", "_")
                with gzip.open(os.path.join(args.output, f"hlo_{name}.txt.gz"), "wt") as f:
                    f.write(text)
            print(f"[gpu_program] {label} {form}: {len(kernels)} kernels, compiled in {seconds:.0f} s",
                  file=sys.stderr, flush=True)
    return report(args, rows, tops, peaks, flop_ratio(dense.backbone, mone.backbone), failures)


def report(args, rows, tops, peaks, ratio, failures=()):
    card = gpu_program.CARDS[args.card]
    lines = [
        f"`{' '.join(['KERAS_BACKEND=jax python bench/gpu_program.py'] + sys.argv[1:])}`",
        "",
        f"Compiled for {card['name']} ({card['bandwidth'] / 1e12:.2f} TB/s) without one; jax {jax.__version__}, "
        f"keras {keras.__version__}; {args.family} {args.variant} {args.image_size}px, "
        f"{'training step (AdamW)' if args.train else 'forward'}, batch {args.batch_size}, "
        f"MoNE e_c {args.capacity:g} (FLOP ratio {ratio:.2f}), {args.precision}"
        + (TANH_GELU_NOTE if args.gelu_approximate else "")
        + gpu_program.matmul_precision_note(args.matmul_precision)
        + f"; {time.strftime('%Y-%m-%d')}. "
        "Roofline: each kernel at max(FLOPs / peak, bytes / bandwidth), a lower bound (no launch gaps, "
        "narrow GEMMs at full rate); autotuning is off without a device, so "
        + ("every GEMM is cuBLAS's (`--cublas-gemms`)." if args.cublas_gemms
           else "GEMMs are XLA's Triton fusions where the card may pick cuBLAS.")
        + (f" XLA options: {', '.join(args.xla_option)}." if args.xla_option else ""),
        "",
        "| form | model | kernels | " + " | ".join(KINDS) + " | GB moved | matmul TFLOP | roofline ms "
        "| temporaries MiB |" + (" live peak MiB |" if peaks else ""),
        "|---" * (7 + len(KINDS) + bool(peaks)) + "|",
    ]
    by_form = {}
    for form, label, summary, _ in rows:
        by_form.setdefault(form, {})[label] = summary
        kinds = " | ".join(str(summary["by_kind"].get(kind, 0)) for kind in KINDS)
        lines.append(f"| {form} | {label} | {summary['kernels']} | {kinds} | {summary['bytes'] / 1e9:.2f} | "
                     f"{summary['flops'] / 1e12:.3f} | {summary['roofline_ms']:.2f} | "
                     f"{summary['temp_bytes'] / 2**20:.1f} |"
                     + (f" {summary['live_peak_bytes'] / 2**20:.1f} |" if peaks else ""))
    lines += ["", "| form | dense / MoNE: kernels | bytes | roofline | temporaries |", "|---|---|---|---|---|"]
    for form, pair in by_form.items():
        if len(pair) == 2:
            dense, mone = pair["dense"], pair["MoNE"]
            lines.append(f"| {form} | {dense['kernels'] / mone['kernels']:.2f}x | "
                         f"{dense['bytes'] / mone['bytes']:.2f}x | "
                         f"**{dense['roofline_ms'] / mone['roofline_ms']:.2f}x** | "
                         f"{dense['temp_bytes'] / mone['temp_bytes']:.2f}x |")
    if failures:
        lines += ["", "Not compiled:", ""] + [f"- {form}, {label}: `{error}`" for form, label, error in failures]
    for label, top in tops.items():
        lines += ["", f"Kernels of {label} (launches, GB read and written):", "",
                  "| kernel | kind | launches | GB |", "|---|---|---|---|"]
        lines += [f"| `{name[:80]}` | {kind} | {count} | {moved / 1e9:.2f} |" for name, kind, count, moved in top]
    for label, memory in peaks.items():
        lines += ["", f"Live at the memory peak of {label} (at `{memory.peak_instruction}`; "
                  f"{memory.live_peak_bytes / 2**20:.1f} MiB live, heap {memory.heap_bytes / 2**20:.1f} MiB):", "",
                  "| MiB | shape | from |", "|---|---|---|"]
        lines += [f"| {b.bytes / 2**20:.1f} | `{b.shape}` | `{b.op_name[-90:]}` |" for b in memory.at_peak[:args.top]]
    text = "\n".join(lines) + "\n"
    if args.output:
        with open(os.path.join(args.output, "gpu_program.md"), "w") as f:
            f.write(text)
    return text


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--card", default="h200", choices=sorted(gpu_program.CARDS))
    parser.add_argument("--family", default="vit", choices=("vit", "vivit"))
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--image-size", type=int, default=None, help="default 224 (vit), 256 (vivit)")
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--precision", default="mixed_bfloat16")
    parser.add_argument("--matmul-precision", default="default", choices=gpu_program.MATMUL_PRECISIONS,
                        help="jax's matmul precision while tracing: 'highest' runs float32 matmuls without TF32 "
                        "(as a V100 does), and the roofline takes the cards' float32 rate")
    parser.add_argument("--forms", default="present,joint_norms")
    parser.add_argument("--train", action="store_true", help="the training step (AdamW), not the forward")
    parser.add_argument("--gelu-approximate", action="store_true",
                        help="both models with the tanh GELU, as the AugReg presets (zoo/vit.toml) compute it")
    parser.add_argument("--cublas-gemms", action="store_true",
                        help="XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (float32 ViViT needs it here)")
    parser.add_argument("--memory", action="store_true",
                        help="also what is live at each program's memory peak (bench.hlo_memory, from XLA's dump)")
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA option for every compile, e.g. xla_gpu_experimental_gemm_fusion_v2=true")
    parser.add_argument("--top", type=int, default=8, help="kernel names (and peak buffers) listed per program")
    parser.add_argument("--output", default=None, help="folder for the report and each program's HLO")
    args = parser.parse_args(argv)
    try:
        args.xla_options = gpu_program.parse_xla_options(args.xla_option)
    except ValueError as error:
        parser.error(f"--xla-option: {error}")
    if args.image_size is None:
        args.image_size = 256 if args.family == "vivit" else 224
    return args


if __name__ == "__main__":
    if keras.backend.backend() != "jax":
        sys.exit("bench/gpu_program.py compiles jax programs: run it with KERAS_BACKEND=jax.")
    print(run(parse()))
