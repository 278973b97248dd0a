"""Where a compiled jax program's device time goes: a ``jax.profiler`` trace summed by kernel.

``trace_calls(step, calls)`` traces ``calls`` runs of a ``_Step`` (``bench.device``);
``kernel_table(trace_dir)`` reads the trace's XSpace (``jax.profiler.ProfileData``)
and sums the device time of every kernel by name and by kind. On a GPU the
events are the kernels on the device's streams (``/device:GPU:N``); on a CPU,
where there is no device plane, the host's XLA op events (those carrying an
``hlo_op``) stand in, so the table has the same form everywhere.

Kinds, from the kernel's name and its HLO op (first match wins): ``pallas``
(kernels of ``keras_mone.kernels``), ``convolution`` (cuDNN's convolutions and
their layout kernels), ``attention`` (flash / SDPA kernels), ``gemm`` (cuBLAS,
CUTLASS, nvjet, XLA's Triton GEMMs, dots), ``copy`` (copies, slices, pads,
concatenations, transposes, memsets), ``reduce`` (reductions, norms, XLA's
Triton "softmax" fusions, which may hold any row reduction) and ``fusion``
(XLA's other fused elementwise kernels), else ``other``.
"""

import collections
import glob
import re
import tempfile

KINDS = (
    ("pallas", r"_mlp_tile|_residual_tile|grouped_(in|out)_(projection|weight_gradient)|row_statistics|pallas"),
    ("convolution", r"cudnn-conv|convolution|fprop_implicit|nhwcaddpadding|nchwtonhwc"),
    ("attention", r"flash|fmha|sdpa|attention"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|matmul|\bdot|dot[._]|sm\d\d_"),
    ("copy", r"copy|slice|pad|concatenat|transpose|memset|memcpy|bitcast|dynamic"),
    ("reduce", r"reduce|norm|softmax"),
    ("fusion", r"fusion|loop|input|elementwise|triton"),
)


def kind_of(name, hlo_op=""):
    """The kind (``KINDS``) of a kernel called ``name`` that runs ``hlo_op``."""
    text = f"{name} {hlo_op}".lower()
    for kind, pattern in KINDS:
        if re.search(pattern, text):
            return kind
    return "other"


def trace_calls(step, calls=3):
    """Traces ``calls`` runs of ``step`` (after one untraced run); returns the trace folder."""
    import jax

    step()
    folder = tempfile.mkdtemp(prefix="keras_mone_trace_")
    with jax.profiler.trace(folder):
        for _ in range(calls):
            step()
    return folder


def _device_events(space):
    """``[(name, hlo_op, nanoseconds)]``: the GPU planes' stream kernels, else the host's XLA ops."""

    def stat(event, key):
        for name, value in event.stats:
            if name == key:
                return str(value)
        return ""

    gpu = [plane for plane in space.planes if plane.name.startswith("/device:GPU")]
    if gpu:
        lines = [line for plane in gpu for line in plane.lines]
        # the kernels are on the stream lines; "XLA Ops" / "XLA Modules" lines repeat them by HLO op
        streams = [line for line in lines if line.name.startswith("Stream")]
        streams = streams or [line for line in lines if not line.name.startswith(("XLA", "Steps", "Launch"))]
        return [(e.name, stat(e, "hlo_op"), e.duration_ns) for line in streams for e in line.events]
    host = [line for plane in space.planes if plane.name.startswith("/host") for line in plane.lines]
    return [(e.name, op, e.duration_ns) for line in host for e in line.events if (op := stat(e, "hlo_op"))]


def kernel_table(trace_dir, calls=1):
    """``{"per_call_ms", "kernels_per_call", "by_kind": {kind: ms}, "top": [(name, kind, ms, count)]}``,
    per call of the ``calls`` traced, from the trace in ``trace_dir``."""
    import jax

    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        raise FileNotFoundError(f"No *.xplane.pb under {trace_dir!r}: was it written by jax.profiler.trace?")
    space = jax.profiler.ProfileData.from_file(sorted(paths)[-1])
    by_name, counts, kinds, by_op = collections.Counter(), collections.Counter(), {}, collections.Counter()
    for name, op, nanoseconds in _device_events(space):
        key = re.sub(r"[._]\d+$", "", name)
        by_name[key] += nanoseconds
        counts[key] += 1
        kinds.setdefault(key, kind_of(name, op))
        by_op[(op, key)] += nanoseconds
    by_kind = collections.Counter()
    for key, nanoseconds in by_name.items():
        by_kind[kinds[key]] += nanoseconds
    scale = 1e-6 / calls
    return {
        "per_call_ms": sum(by_name.values()) * scale,
        "kernels_per_call": sum(counts.values()) / calls,
        "by_kind": {kind: ns * scale for kind, ns in by_kind.most_common()},
        "top": [(key, kinds[key], ns * scale, counts[key] / calls) for key, ns in by_name.most_common(12)],
        # HLO instruction (name in the optimised HLO), kernel, ms per call: the costliest 40
        "top_ops": [(op, key, ns * scale) for (op, key), ns in by_op.most_common(40)],
    }


def format_kernel_tables(tables):
    """Markdown: device ms per call by kind, one column per profiled program, then each
    program's top kernels. ``tables``: ``{label: kernel_table(...)}``."""
    labels = list(tables)
    kinds = sorted({kind for t in tables.values() for kind in t["by_kind"]},
                   key=lambda k: -max(t["by_kind"].get(k, 0.0) for t in tables.values()))
    lines = ["| device ms per call | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(f"{tables[l]['by_kind'].get(kind, 0.0):.2f}" for l in labels) + " |")
    lines.append("| **total** | " + " | ".join(f"**{tables[l]['per_call_ms']:.2f}**" for l in labels) + " |")
    lines.append("| kernels per call | " + " | ".join(f"{tables[l]['kernels_per_call']:.0f}" for l in labels) + " |")
    for label in labels:
        lines += ["", f"Top kernels of {label} (ms per call, launches per call):", "",
                  "| kernel | kind | ms | launches |", "|---|---|---|---|"]
        lines += [f"| `{name[:90]}` | {kind} | {ms:.3f} | {count:.0f} |"
                  for name, kind, ms, count in tables[label]["top"]]
    return "\n".join(lines)
