"""What an H100 or H200 would run, compiled on a machine without a GPU (issue 40).

XLA compiles for a CUDA device it is only described (its SM count, memory bandwidth,
compute capability: ``CARDS``), through jax's compile-only devices. The optimised
program is the one the card would run, up to autotuning: its kernels, what each reads
and writes, the GEMMs' FLOPs. So forms can be compared kernel by kernel without device
time, and checked against a profile taken on the card (BENCHMARKS.md: an H200 trace of
MoNE-ViT-B/16 counted the same LayerNorm reductions, cuts and residual fusions).

Needs jax's CUDA plugin (``pip install "jax[cuda12]"``, no GPU needed), loaded with
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` where no GPU is visible (its version check would
call ``cuInit``); ``bench/gpu_program.py`` sets it.

* ``compile_only_device(card)``: a jax device of that card, for ``jax.jit(...).lower``.
* ``compiled_forward(model, batch_size, device)``: the model's forward, compiled for it;
  ``compiled_train_step``: its training step (AdamW).
* ``program_kernels(hlo_text)``: the kernels of an optimised GPU program.
* ``program_summary(kernels, card, dtype)``: counts, bytes, FLOPs and a roofline time.
"""

import collections
import contextlib
import re

from keras_mone.bench.kernel_profile import kind_of

CARDS = {
    # Data-sheet figures of the SXM cards; both are sm_90 with 132 SMs.
    "h100": {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30, "bandwidth": 3.35e12},
    "h200": {"name": "NVIDIA H200", "memory_bytes": 141 * 10**9, "bandwidth": 4.8e12},
}
PEAK_FLOPS = {"bfloat16": 989e12, "float16": 989e12, "float32": 495e12}
"""Dense tensor-core peaks of both cards (float32 matmuls run as TF32, jax's GPU default)."""

_SPEC = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth:.0f}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory_bytes}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability {{ major: 9 minor: 0 }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{name}"
"""


def target_config(card):
    """XLA's ``GpuTargetConfig`` (text proto) of ``card`` (a key of ``CARDS``)."""
    if card not in CARDS:
        raise ValueError(f"`card` must be one of {sorted(CARDS)}, got {card!r}.")
    return _SPEC.format(**CARDS[card])


def compile_only_device(card="h200"):
    """A jax device of ``card`` that programs compile for but nothing runs on."""
    from jax.experimental import topologies

    config = target_config(card)  # validates the name first
    try:
        topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=config)
    except Exception as error:
        raise RuntimeError(
            "Compiling for a GPU without one needs jax's CUDA plugin, loaded: `pip install \"jax[cuda12]\"` "
            "(same version as jax) and start Python with JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 "
            f"(bench/gpu_program.py does). The plugin said: {type(error).__name__}: {error}"
        ) from error
    return topology.devices[0]


@contextlib.contextmanager
def cuda_forms():
    """Traces inside take jax's GPU forms (``layers.platform_forms``), and Keras' fused
    attention takes cuDNN's flash kernel where the card would: Keras asks the attached
    device, which a compile-only one is not, so the answer is the cuDNN rule itself
    (float16 / bfloat16, head size a multiple of 8 up to 128; on the H200 bf16 ViTs ran
    cuDNN's kernel and float32 ones XLA's softmax, as here)."""
    from keras.src.backend.jax import nn as keras_jax_nn

    from keras_mone.layers import platform_forms

    def flash_applies(query, key, value, bias, raise_error=False):
        head = query.shape[-1]
        applies = str(query.dtype) in ("bfloat16", "float16") and head % 8 == 0 and head <= 128 and bias is None
        if raise_error and not applies:
            raise ValueError(f"cuDNN flash attention needs float16/bfloat16 and a head size of 8k <= 128; "
                             f"got {query.dtype}, {head}.")
        return applies

    saved = keras_jax_nn._can_use_flash_attention
    keras_jax_nn._can_use_flash_attention = flash_applies
    try:
        with platform_forms.compiling_for("gpu"):
            yield
    finally:
        keras_jax_nn._can_use_flash_attention = saved


def compiled_forward(model, batch_size, device):
    """``model``'s inference forward on a ``batch_size`` batch (float32 inputs), lowered and
    compiled for ``device`` under the GPU's forms; weights are abstract (no values needed)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    placed = SingleDeviceSharding(device)

    def abstract(values):
        return [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=placed) for v in values]

    def forward(trainable, non_trainable, x):
        output = model.stateless_call(trainable, non_trainable, x, training=False)[0]
        return output["logits"] if isinstance(output, dict) else output

    x = jax.ShapeDtypeStruct((batch_size, *model.backbone.input_shape_per_example), jnp.float32, sharding=placed)
    with cuda_forms():
        lowered = jax.jit(forward).lower(
            abstract(v.value for v in model.trainable_variables),
            abstract(v.value for v in model.non_trainable_variables), x)
    return lowered.compile()


def compiled_train_step(model, batch_size, device):
    """``model``'s training step (``bench.device.jax_train_function``: forward, loss,
    backward, AdamW) on a ``batch_size`` batch, compiled for ``device`` under the GPU's
    forms, its weights and optimizer state donated as in ``keras-mone bench``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from keras_mone.bench.device import jax_train_function

    placed = SingleDeviceSharding(device)
    step, optimizer = jax_train_function(model)

    def abstract(variables):
        return [jax.ShapeDtypeStruct(v.value.shape, v.value.dtype, sharding=placed) for v in variables]

    x = jax.ShapeDtypeStruct((batch_size, *model.backbone.input_shape_per_example), jnp.float32, sharding=placed)
    y = jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=placed)
    with cuda_forms():
        lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(
            abstract(model.trainable_variables), abstract(model.non_trainable_variables),
            abstract(optimizer.variables), x, y)
    return lowered.compile()


# ---------------------------------------------------------------------------
# reading the optimised program
# ---------------------------------------------------------------------------
_FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "opt-barrier", "after-all",
         "partition-id", "replica-id", "copy-done", "add-dependency"}
"""Ops that launch no kernel (layout-only views, tuple plumbing)."""
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")

Kernel = collections.namedtuple("Kernel", "name op kind bytes flops shape")
"""One launch: its name without the numeric suffix (as a profile names it), HLO op, kind
(``kernel_profile.KINDS``), bytes it reads and writes (each operand once, whole except
what only slices take or, in an elementwise loop fusion, past one element per output),
FLOPs of its matmuls (GEMMs and cuDNN attention; elementwise work not counted) and
output shape text."""


def _shape_bytes(shape_text):
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        elements = 1
        for d in filter(None, dims.split(",")):
            elements *= int(d)
        total += elements * _BYTES.get(dtype, 4)
    return total


def _element_bytes(shape_text):
    match = _ARRAY.search(shape_text)
    return _BYTES.get(match.group(1), 4) if match else 4


def _dims(shape_text):
    match = _ARRAY.search(shape_text)
    return [int(d) for d in filter(None, match.group(2).split(","))] if match else []


def _computations(hlo_text):
    """``{name: [instruction lines]}`` and the entry computation's name."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            computations[current].append(line)
    if entry is None:
        raise ValueError("No ENTRY computation in the HLO text: pass an optimised module's `as_text()`.")
    return computations, entry


def _parsed(lines):
    """``[(name, shape, op, operands, line)]`` of a computation's instructions."""
    parsed = []
    for line in lines:
        match = _INSTRUCTION.match(line)
        if match:
            name, shape, op, rest = match.groups()
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            parsed.append((name, shape, op, operands, line))
    return parsed


def _dot_flops(lines):
    """FLOPs of the dots in a fused computation: 2 x output elements x contracted size."""
    shapes, flops = {}, 0
    for name, shape, op, operands, line in _parsed(lines):
        shapes[name] = shape
        if op == "dot" and operands:
            lhs = _dims(shapes.get(operands[0], ""))
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
            k = 1
            for d in filter(None, (contracting.group(1) if contracting else "").split(",")):
                k *= lhs[int(d)] if int(d) < len(lhs) else 1
            out = 1
            for d in _dims(shape):
                out *= d
            flops += 2 * out * k
    return flops


_ELEMENTWISE = {
    "abs", "add", "and", "ceil", "clamp", "compare", "convert", "copy", "cosine", "divide", "erf", "exponential",
    "exponential-minus-one", "floor", "log", "log-plus-one", "logistic", "maximum", "minimum", "multiply", "negate",
    "not", "or", "power", "round-nearest-even", "rsqrt", "select", "sign", "sine", "sqrt", "subtract", "tanh", "xor",
}
_REARRANGING = {"bitcast", "reshape", "transpose", "copy"}


def _bytes_read(lines, operand_bytes):
    """Bytes a fusion reads of each operand: what its output needs, traced back from the
    root through slices (a token group's rows, a weight's columns), concatenations (each
    operand's own part) and elementwise ops as index boxes, through bitcasts, reshapes
    and transposes as element counts; any other use reads its operand whole."""
    parsed = _parsed(lines)
    dims = {name: _dims(shape) for name, shape, *_ in parsed}
    need = {}  # name -> ("box", [(lo, hi), ...]) or ("count", elements)

    def volume(region, name):
        if region[0] == "count":
            return region[1]
        total = 1
        for lo, hi in region[1]:
            total *= max(hi - lo, 0)
        return total

    def mark(name, region):
        if name not in dims:
            return
        old = need.get(name)
        if old is not None and old[0] == region[0] == "box":
            region = ("box", [(min(a, c), max(b, d)) for (a, b), (c, d) in zip(old[1], region[1])])
        elif old is not None:
            full = 1
            for d in dims[name]:
                full *= d
            region = ("count", min(full, volume(old, name) + volume(region, name)))
        need[name] = region

    def whole(name):
        return ("box", [(0, d) for d in dims.get(name, [])])

    for name, shape, op, operands, line in reversed(parsed):
        if line.lstrip().startswith("ROOT"):
            if op == "tuple":
                for operand in operands:
                    mark(operand, whole(operand))
                continue
            mark(name, whole(name))
        region = need.get(name)
        if region is None or op == "parameter":
            continue
        if op == "slice" and region[0] == "box" and operands:
            spans = re.findall(r"\[(\d+):(\d+)(?::(\d+))?\]", line.split("slice={", 1)[-1].split("}", 1)[0])
            if len(spans) == len(region[1]) and all(step in ("", "1") for _, _, step in spans):
                box = [(int(start) + lo, int(start) + hi) for (start, _, _), (lo, hi) in zip(spans, region[1])]
                mark(operands[0], ("box", box))
                continue
        if op in ("slice", "dynamic-slice") and operands:  # reads no more elements than it writes
            mark(operands[0], ("count", volume(region, name)))
            continue
        if op == "concatenate" and region[0] == "box":
            axis = int(re.search(r"dimensions=\{(\d+)\}", line).group(1))
            offset = 0
            for operand in operands:
                size = dims[operand][axis]
                lo, hi = max(region[1][axis][0] - offset, 0), min(region[1][axis][1] - offset, size)
                if lo < hi:
                    box = list(region[1])
                    box[axis] = (lo, hi)
                    mark(operand, ("box", box))
                offset += size
            continue
        if op in _ELEMENTWISE:
            for operand in operands:
                mark(operand, region if dims.get(operand) == dims[name] else whole(operand))
            continue
        if op in _REARRANGING and operands:
            mark(operands[0], ("count", volume(region, name)))
            continue
        for operand in operands:
            mark(operand, whole(operand))

    read = list(operand_bytes)
    for name, shape, op, _, line in parsed:
        number = re.search(r"parameter\((\d+)\)", line) if op == "parameter" else None
        if number and int(number.group(1)) < len(read):
            index = int(number.group(1))
            region = need.get(name)
            read[index] = 0 if region is None else min(read[index], volume(region, name) * _element_bytes(shape))
    return read


def _cublas_flops(line, shape, operand_shapes):
    """A cuBLAS GEMM (its first output; the second is a workspace): 2 x output x contracted size."""
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', line)
    if not contracting or not operand_shapes:
        return 0
    lhs, k = _dims(operand_shapes[0]), 1
    for d in re.findall(r"\d+", contracting.group(1)):
        k *= lhs[int(d)] if int(d) < len(lhs) else 1
    out = 1
    for d in _dims(shape):
        out *= d
    return 2 * out * k


def _attention_flops(operand_shapes):
    """cuDNN fused attention: q k^T and the weighted sum of v, 2 x 2 x B H Nq Nk d."""
    if len(operand_shapes) < 3:
        return 0
    q, k = _dims(operand_shapes[0]), _dims(operand_shapes[1])
    if len(q) != 4 or len(k) != 4:
        return 0
    batch, queries, heads, head_dim = q  # (B, N, H, d), the layout jax passes
    return 4 * batch * heads * queries * k[1] * head_dim


def program_kernels(hlo_text):
    """``[Kernel]`` of an optimised GPU program (``compiled.as_text()``), in launch order:
    every instruction of the entry computation that runs on the device (fusions, custom
    calls such as cuBLAS and cuDNN, copies); ``call``s (command buffers) are opened."""
    computations, entry = _computations(hlo_text)
    kernels = []

    def visit(computation):
        shapes = {}
        for name, shape, op, operands, line in _parsed(computations[computation]):
            shapes[name] = shape
            if op in _FREE:
                continue
            called = re.search(r"(?:calls|to_apply)=%([\w.\-]+)", line)
            if op == "call" and called and called.group(1) in computations:
                visit(called.group(1))
                continue
            label = re.sub(r"\.\d+$", "", name)
            target = re.search(r'custom_call_target="([^"]+)"', line)
            if op == "custom-call" and target:
                label = target.group(1)
            operand_shapes = [shapes.get(o, "") for o in operands]
            read = [_shape_bytes(s) for s in operand_shapes]
            flops = 0
            if op == "fusion" and called and called.group(1) in computations:
                read = _bytes_read(computations[called.group(1)], read)
                flops = _dot_flops(computations[called.group(1)])
            elif op == "custom-call" and "fmha" in label.lower():
                # the backward kernel recomputes q k^T and makes dQ, dK, dV, dP: 5 products, not 2
                flops = _attention_flops(operand_shapes) * (2.5 if "backward" in label.lower() else 1)
            elif op == "custom-call" and "cublas" in label.lower():
                flops = _cublas_flops(line, shape, operand_shapes)
            elif op == "dot":
                flops = _dot_flops([line])
            moved = _shape_bytes(shape) + sum(read)
            kernels.append(Kernel(label, op, _kind(label, op), moved, flops, shape.split("{")[0]))

    visit(entry)
    return kernels


def _kind(label, op):
    if "fmha" in label.lower() or "cudnn" in label.lower():
        return "attention"
    return kind_of(label, op)


def program_summary(kernels, card="h200", dtype="bfloat16"):
    """``{"kernels", "by_kind": {kind: count}, "bytes", "flops", "roofline_ms",
    "roofline_by_kind": {kind: ms}}``: each kernel at ``max(FLOPs / peak, bytes /
    bandwidth)`` on ``card``. A bound, not a forecast: it leaves out launch gaps and
    narrow GEMMs' lower efficiency and counts each operand whole."""
    peak, bandwidth = PEAK_FLOPS[dtype], CARDS[card]["bandwidth"]
    by_kind, time_by_kind = collections.Counter(), collections.Counter()
    for kernel in kernels:
        by_kind[kernel.kind] += 1
        time_by_kind[kernel.kind] += max(kernel.flops / peak, kernel.bytes / bandwidth) * 1e3
    return {
        "kernels": len(kernels),
        "by_kind": dict(by_kind.most_common()),
        "bytes": sum(k.bytes for k in kernels),
        "flops": sum(k.flops for k in kernels),
        "roofline_ms": sum(time_by_kind.values()),
        "roofline_by_kind": dict(time_by_kind.most_common()),
    }


def kernel_counts(kernels, top=None):
    """``[(name, kind, launches, bytes)]`` by kernel name, most launched first."""
    launches, moved, kinds = collections.Counter(), collections.Counter(), {}
    for kernel in kernels:
        launches[kernel.name] += 1
        moved[kernel.name] += kernel.bytes
        kinds[kernel.name] = kernel.kind
    return [(name, kinds[name], count, moved[name]) for name, count in launches.most_common(top)]
