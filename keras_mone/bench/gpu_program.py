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
  ``compiled_train_step``: its training step (AdamW). Both take XLA's options for the one
  compile (``xla_options``: ``{"xla_gpu_...": value}``, read by ``parse_xla_options``).
* ``program_summary(kernels, card, dtype)``: counts, bytes, FLOPs and a roofline time of
  the kernels ``bench.hlo_kernels.program_kernels`` reads from a compiled program's text.

Traces take the GPU's forms (``platform_forms.compiling_for("gpu")``), cuDNN's flash
attention in half precision included, as Keras picks it on the card.
"""

import collections

from keras_mone.bench import hlo_memory
from keras_mone.layers import platform_forms

CARDS = {
    # Data-sheet figures of the SXM cards; both are sm_90 with 132 SMs.
    "h100": {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30, "bandwidth": 3.35e12},
    "h200": {"name": "NVIDIA H200", "memory_bytes": 141 * 10**9, "bandwidth": 4.8e12},
}
PEAK_FLOPS = {"bfloat16": 989e12, "float16": 989e12, "float32": 495e12}
"""Dense tensor-core peaks of both cards (float32 matmuls run as TF32, jax's GPU default)."""
FLOAT32_CORE_PEAK = 67e12
"""Both cards' float32 rate off the tensor cores: float32 matmuls at jax's ``"highest"``
precision (``jax.default_matmul_precision``), as on a V100, which has no TF32 (MoNE Table 1
timed there)."""
MATMUL_PRECISIONS = ("default", "highest")


def matmul_precision_note(matmul_precision):
    """The words a report adds for ``matmul_precision`` (none for jax's default)."""
    return ", matmuls at jax's \"highest\" precision (float32 without TF32)" if matmul_precision == "highest" else ""

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


def compiled_forward(model, batch_size, device, dump_to=None, xla_options=None):
    """``model``'s inference forward (``bench.device.jax_forward_function``) on a
    ``batch_size`` batch (float32 inputs), compiled for ``device`` under the GPU's forms;
    weights are abstract (no values needed). ``dump_to``: a folder XLA dumps the compile
    into (``bench.hlo_memory.program_memory`` reads it); ``xla_options``: XLA's debug
    options for this compile only (``parse_xla_options``)."""
    from keras_mone.bench.device import jax_forward_function

    example = _example_shape(model)  # fails early, naming what it takes
    variables = (model.trainable_variables, model.non_trainable_variables)
    return _compiled(jax_forward_function(model), device, variables, [((batch_size, *example), "float32")],
                     dump_to=dump_to, xla_options=xla_options)


def compiled_train_step(model, batch_size, device, dump_to=None, xla_options=None):
    """``model``'s training step (``bench.device.jax_train_function``: forward, loss,
    backward, AdamW) on a ``batch_size`` batch, compiled for ``device`` under the GPU's
    forms, its weights and optimizer state donated as in ``keras-mone bench``;
    ``dump_to`` and ``xla_options`` as in ``compiled_forward``."""
    from keras_mone.bench.device import jax_train_function

    example = _example_shape(model)  # fails early, naming what it takes
    step, optimizer = jax_train_function(model)
    variables = (model.trainable_variables, model.non_trainable_variables, optimizer.variables)
    inputs = [((batch_size, *example), "float32"), ((batch_size,), "int32")]
    return _compiled(step, device, variables, inputs, donate=(0, 1, 2), dump_to=dump_to, xla_options=xla_options)


def parse_xla_options(entries):
    """``{"xla_...": value}`` from ``"NAME=VALUE"`` strings (``true``/``false`` as booleans,
    integers as ints), for ``jax``'s ``Lowered.compile(compiler_options=...)``: XLA's debug
    options for one compile, where ``$XLA_FLAGS`` would set them for the whole process."""
    options = {}
    for entry in entries or ():
        name, separator, value = entry.partition("=")
        name = name.strip().lstrip("-")
        if not separator or not name.startswith("xla_") or not value.strip():
            raise ValueError(f"An XLA option is NAME=VALUE with a name starting 'xla_', e.g. "
                             f"'xla_gpu_experimental_gemm_fusion_v2=true'; got {entry!r}.")
        value = value.strip()
        if value.lower() in ("true", "false"):
            options[name] = value.lower() == "true"
        else:
            options[name] = int(value) if value.lstrip("-").isdigit() else value
    return options


def _compiled(function, device, variable_lists, inputs, donate=(), dump_to=None, xla_options=None):
    """``jax.jit(function)`` traced under the GPU's forms on abstract arrays placed on
    ``device`` (each variable list's values, then ``inputs``: ``(shape, dtype)`` pairs),
    and compiled with ``xla_options`` (dumped into ``dump_to`` if given)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    placed = SingleDeviceSharding(device)

    def abstract(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    arguments = [[abstract(v.value.shape, v.value.dtype) for v in variables] for variables in variable_lists]
    arguments += [abstract(shape, dtype) for shape, dtype in inputs]
    with platform_forms.compiling_for("gpu"):
        lowered = jax.jit(function, donate_argnums=donate).lower(*arguments)
    options = dict(xla_options or {})
    if dump_to is None:
        return lowered.compile(compiler_options=options or None)
    options.update(hlo_memory.dump_options(dump_to, f"jit_{function.__name__}"))
    with hlo_memory.compiled_afresh():
        return lowered.compile(compiler_options=options)


def program_summary(kernels, card="h200", dtype="bfloat16", matmul_precision="default"):
    """``{"kernels", "by_kind": {kind: count}, "bytes", "flops", "roofline_ms",
    "roofline_by_kind": {kind: ms}}``: each kernel at ``max(FLOPs / peak, bytes /
    bandwidth)`` on ``card`` for matmuls in ``dtype`` (float32 at ``matmul_precision``
    ``"highest"``: ``FLOAT32_CORE_PEAK``). An estimate meant as a lower bound,
    not a forecast: it leaves out launch gaps, narrow GEMMs' lower efficiency and
    elementwise arithmetic; it is as good as the byte counts (``hlo_kernels``), which
    count no L2 hits and read some ops' operands whole."""
    target_config(card)  # validates the card
    if dtype not in PEAK_FLOPS:
        raise ValueError(f"`dtype` must be one of {sorted(PEAK_FLOPS)}, got {dtype!r}.")
    if matmul_precision not in MATMUL_PRECISIONS:
        raise ValueError(f"`matmul_precision` must be one of {MATMUL_PRECISIONS}, got {matmul_precision!r}.")
    full_float32 = dtype == "float32" and matmul_precision == "highest"
    peak, bandwidth = FLOAT32_CORE_PEAK if full_float32 else PEAK_FLOPS[dtype], CARDS[card]["bandwidth"]
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


def _example_shape(model):
    """One example's input shape: the backbone's (``input_shape_per_example``) of a
    keras_mone backbone or task model."""
    backbone = getattr(model, "backbone", model)
    if not hasattr(backbone, "input_shape_per_example"):
        raise TypeError(f"Compiles keras_mone backbones and task models (an `input_shape_per_example`); "
                        f"got a {type(model).__name__}.")
    return backbone.input_shape_per_example
