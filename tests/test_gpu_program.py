"""Reading an optimised GPU program (``keras_mone.bench.gpu_program``): kernels, bytes and
FLOPs, on hand-written HLO in the form XLA's GPU compiler prints and on programs jax
compiles here. Compiling for an H100/H200 needs jax's CUDA plugin, which CI lacks; the
last test runs where it is installed."""

import importlib.util

import numpy as np
import pytest
from conftest import BACKEND, TINY

from keras_mone.bench import gpu_program, hlo_kernels, hlo_memory

# One block's worth of XLA GPU output, shortened: a Triton GEMM fusion, the q/k/v split
# (a fusion that only slices its parameter, through a bitcast), cuDNN attention, a
# command buffer holding a reduction, and instructions that launch nothing.
PROGRAM = """HloModule jit_forward, is_scheduled=true

%gemm_fusion_dot.1_computation (parameter_0: bf16[512,64], parameter_1: bf16[64,192]) -> bf16[512,192] {
  %parameter_0 = bf16[512,64]{1,0} parameter(0)
  %parameter_1 = bf16[64,192]{1,0} parameter(1)
  ROOT %dot.1 = bf16[512,192]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_slice (param_0: bf16[512,192]) -> bf16[512,64] {
  %param_0 = bf16[512,192]{1,0} parameter(0)
  %bitcast.1 = bf16[2,256,192]{2,1,0} bitcast(%param_0)
  %slice.1 = bf16[2,256,64]{2,1,0} slice(%bitcast.1), slice={[0:2], [0:256], [0:64]}
  ROOT %bitcast.2 = bf16[512,64]{1,0} bitcast(%slice.1)
}

%fused_reduce (param_0.1: bf16[512,64]) -> f32[512] {
  %param_0.1 = bf16[512,64]{1,0} parameter(0)
  %convert.1 = f32[512,64]{1,0} convert(%param_0.1)
  %constant.1 = f32[] constant(0)
  ROOT %reduce.1 = f32[512]{0} reduce(%convert.1, %constant.1), dimensions={1}, to_apply=%add
}

%command_buffer (p: bf16[512,64]) -> f32[512] {
  %p = bf16[512,64]{1,0} parameter(0)
  ROOT %input_reduce_fusion.3 = f32[512]{0} fusion(%p), kind=kInput, calls=%fused_reduce
}

ENTRY %main.9 (x: bf16[512,64], w: bf16[64,192]) -> f32[512] {
  %x = bf16[512,64]{1,0} parameter(0), sharding={replicated}
  %w = bf16[64,192]{1,0} parameter(1)
  %gemm_fusion_dot.1 = bf16[512,192]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %loop_slice_fusion.2 = bf16[512,64]{1,0} fusion(%gemm_fusion_dot.1), kind=kLoop, calls=%fused_slice
  %bitcast.3 = bf16[2,256,1,64]{3,2,1,0} bitcast(%loop_slice_fusion.2)
  %attention.4 = (bf16[2,256,1,64]{3,2,1,0}, u8[0]{0}) custom-call(%bitcast.3, %bitcast.3, %bitcast.3), """ \
    """custom_call_target="__cudnn$fmhaSoftmax"
  %get-tuple-element.5 = bf16[2,256,1,64]{3,2,1,0} get-tuple-element(%attention.4), index=0
  %bitcast.6 = bf16[512,64]{1,0} bitcast(%get-tuple-element.5)
  ROOT %call.7 = f32[512]{0} call(%bitcast.6), to_apply=%command_buffer
}
"""


def test_every_launch_of_a_gpu_program_is_read_with_its_bytes_and_flops():
    kernels = hlo_kernels.program_kernels(PROGRAM)
    assert [(k.name, k.kind) for k in kernels] == [
        ("gemm_fusion_dot", "gemm"), ("loop_slice_fusion", "copy"), ("__cudnn$fmhaSoftmax", "attention"),
        ("input_reduce_fusion", "reduce"),  # inside the command buffer
    ]
    gemm, split, attention, reduction = kernels
    assert gemm.flops == 2 * 512 * 192 * 64
    assert gemm.bytes == 2 * (512 * 64 + 64 * 192 + 512 * 192)
    # the split reads the third of the GEMM's output it keeps, not all of it
    assert split.bytes == 2 * (512 * 64 + 512 * 64)
    assert attention.flops == 4 * 2 * 1 * 256 * 256 * 64  # q k^T and weights @ v: 2 x 2 B H N N d
    assert attention.bytes == 2 * 4 * 512 * 64  # three operands and the output
    assert reduction.bytes == 2 * 512 * 64 + 4 * 512 and reduction.flops == 0


CONCATENATED = """HloModule jit_mlp, is_scheduled=true

%fused_slice (param_0: bf16[300,64], param_1: bf16[100,64], param_2: bf16[64]) -> bf16[100,64] {
  %param_0 = bf16[300,64]{1,0} parameter(0)
  %param_1 = bf16[100,64]{1,0} parameter(1)
  %param_2 = bf16[64]{0} parameter(2)
  %concatenate.1 = bf16[400,64]{1,0} concatenate(%param_0, %param_1), dimensions={0}
  %broadcast.1 = bf16[400,64]{1,0} broadcast(%param_2), dimensions={1}
  %add.1 = bf16[400,64]{1,0} add(%concatenate.1, %broadcast.1)
  %tanh.1 = bf16[400,64]{1,0} tanh(%add.1)
  ROOT %slice.1 = bf16[100,64]{1,0} slice(%tanh.1), slice={[300:400], [0:64]}
}

ENTRY %main (a: bf16[300,64], b: bf16[100,64], c: bf16[64]) -> bf16[100,64] {
  %a = bf16[300,64]{1,0} parameter(0)
  %b = bf16[100,64]{1,0} parameter(1)
  %c = bf16[64]{0} parameter(2)
  ROOT %loop_slice_fusion = bf16[100,64]{1,0} fusion(%a, %b, %c), kind=kLoop, calls=%fused_slice
}
"""


def test_a_fusion_reads_only_the_part_of_a_concatenation_its_output_needs():
    # The packed MLP's GELU: the groups' products joined, activated, cut again per group.
    # Each cut reads its own group's rows (and the bias), not the other groups'.
    (kernel,) = hlo_kernels.program_kernels(CONCATENATED)
    assert kernel.bytes == 2 * (100 * 64 + 64) + 2 * 100 * 64


CUBLAS_AND_CUTS = """HloModule jit_cuts, is_scheduled=true

%fused_cuts (param_0: f32[100,64], param_1: s32[]) -> (f32[10,64], f32[10,64], f32[5,64]) {
  %param_0 = f32[100,64]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %slice.1 = f32[10,64]{1,0} slice(%param_0), slice={[0:10], [0:64]}
  %slice.2 = f32[10,64]{1,0} slice(%param_0), slice={[90:100], [0:64]}
  %constant.1 = s32[] constant(0)
  %dynamic-slice.1 = f32[5,64]{1,0} dynamic-slice(%param_0, %param_1, %constant.1), dynamic_slice_sizes={5,64}
  ROOT %tuple.1 = (f32[10,64]{1,0}, f32[10,64]{1,0}, f32[5,64]{1,0}) tuple(%slice.1, %slice.2, %dynamic-slice.1)
}

ENTRY %main (a: f32[100,64], i: s32[], w: f32[64,32]) -> f32[100,32] {
  %a = f32[100,64]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %w = f32[64,32]{1,0} parameter(2)
  %input_slice_fusion = (f32[10,64]{1,0}, f32[10,64]{1,0}, f32[5,64]{1,0}) fusion(%a, %i), kind=kLoop, calls=%fused_cuts
  %dot.1 = f32[100,32]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %gemm.1 = (f32[100,32]{1,0}, s8[33554432]{0}) custom-call(%a, %w), custom_call_target="__cublas$gemm", """ \
    """backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}
  ROOT %get-tuple-element.1 = f32[100,32]{1,0} get-tuple-element(%gemm.1), index=0
}
"""


def test_cuts_unfused_dots_and_cublas_gemms_are_read_as_they_run():
    cuts, dot, gemm = hlo_kernels.program_kernels(CUBLAS_AND_CUTS)
    # two disjoint cuts of 10 rows and a dynamic one of 5 read 25 rows (and the index), not all 100
    assert cuts.bytes == 4 * (25 * 64) + 4 + 4 * (25 * 64)
    assert dot.flops == gemm.flops == 2 * 100 * 32 * 64  # an unfused dot and cuBLAS: 2 x output x K
    # cuBLAS's 32 MiB workspace (the tuple's second output) is scratch, not traffic
    assert gemm.bytes == 4 * (100 * 64 + 64 * 32 + 100 * 32) and gemm.kind == "gemm"


GATHERED = """HloModule jit_take, is_scheduled=true

%fused_take (param_0: bf16[100,64], param_1: s32[5,1]) -> bf16[5,64] {
  %param_0 = bf16[100,64]{1,0} parameter(0)
  %param_1 = s32[5,1]{1,0} parameter(1)
  %gather.1 = bf16[5,1,64]{2,1,0} gather(%param_0, %param_1), offset_dims={1,2}, collapsed_slice_dims={}, """ \
    """start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}
  ROOT %bitcast.1 = bf16[5,64]{1,0} bitcast(%gather.1)
}

ENTRY %main (a: bf16[100,64], i: s32[5,1]) -> bf16[5,64] {
  %a = bf16[100,64]{1,0} parameter(0)
  %i = s32[5,1]{1,0} parameter(1)
  ROOT %loop_gather_fusion = bf16[5,64]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused_take
}
"""


def test_a_gather_reads_the_rows_it_takes():
    # a router's take of 5 token rows out of 100: those rows, the indices and the output, not all 100 rows
    (take,) = hlo_kernels.program_kernels(GATHERED)
    assert take.bytes == 2 * (5 * 64) + 4 * 5 + 2 * (5 * 64)


PALLAS = """HloModule jit_mlp, is_scheduled=true

ENTRY %main (z: bf16[256,768], w1: bf16[768,3072], w2: bf16[3072,768]) -> bf16[256,768] {
  %z = bf16[256,768]{1,0} parameter(0)
  %w1 = bf16[768,3072]{1,0} parameter(1)
  %w2 = bf16[3072,768]{1,0} parameter(2)
  ROOT %pallas_call.1 = bf16[256,768]{1,0} custom-call(%z, %w1, %w2), """ \
    """custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{}: (0, {})}, """ \
    """backend_config={debug = false, grid_x = 2 : i32, ir = "ML\\EFR", name = "_residual_tile_d96_h3072", """ \
    """num_stages = 2 : i32, num_warps = 8 : i32}
}
"""


def test_a_pallas_mlp_kernel_is_read_with_its_products():
    # The kernels' FLOPs are opaque in the program; their names carry the nested and hidden
    # widths (``kernels.tiles.kernel_name``), so the roofline counts fc1 and fc2
    # (a bound that took the kernels at memory speed put MoNE at 2.46x dense, not 2.03x).
    (kernel,) = hlo_kernels.program_kernels(PALLAS)
    assert (kernel.name, kernel.kind) == ("_residual_tile_d96_h3072", "pallas")
    assert kernel.flops == 4 * 256 * 96 * 3072
    # z read whole (the LayerNorm's statistics) with the per-row scale, the weight slices
    # W1[:96] and W2[:, :96] (not the whole weights the call is handed) with fc1's bias and
    # fc2's first 96, and the 96 features of each row it writes in place
    assert kernel.bytes == 2 * (256 * 769 + 2 * 96 * 3072 + 3072 + 96 + 256 * 96)
    summary = gpu_program.program_summary([kernel])
    assert summary["roofline_ms"] == pytest.approx(kernel.bytes / gpu_program.CARDS["h200"]["bandwidth"] * 1e3)
    rows = 256 * 64  # enough rows to be compute-bound: 4 d H FLOPs per row against 2 (D + 1 + d) bytes
    (big,) = hlo_kernels.program_kernels(PALLAS.replace("bf16[256,768]", f"bf16[{rows},768]"))
    assert big.flops == 4 * rows * 96 * 3072
    big_summary = gpu_program.program_summary([big])
    assert big_summary["roofline_ms"] == pytest.approx(big.flops / gpu_program.PEAK_FLOPS["bfloat16"] * 1e3)


def test_a_kernel_name_gives_its_flops_and_only_its_own():
    from keras_mone.kernels.tiles import kernel_flops, kernel_name

    assert kernel_name("_mlp_tile", 192, 3072) == "_mlp_tile_d192_h3072"
    assert kernel_flops(kernel_name("_mlp_tile", 192, 3072), 128) == 4 * 128 * 192 * 3072
    assert kernel_flops("__gpu$xla.gpu.triton", 128) is None and kernel_flops("gemm_fusion_dot", 64) is None


def test_the_summary_is_a_roofline_over_the_kernels():
    kernels = hlo_kernels.program_kernels(PROGRAM)
    summary = gpu_program.program_summary(kernels, "h200", "bfloat16")
    assert summary["kernels"] == 4
    assert summary["by_kind"] == {"gemm": 1, "copy": 1, "attention": 1, "reduce": 1}
    assert summary["bytes"] == sum(k.bytes for k in kernels)
    expected = sum(max(k.flops / 989e12, k.bytes / 4.8e12) for k in kernels) * 1e3
    assert summary["roofline_ms"] == pytest.approx(expected, rel=1e-12)
    assert hlo_kernels.kernel_counts(kernels)[0][2] == 1
    # float32 matmuls at jax's "highest" precision run off the tensor cores (67 TFLOP/s, no TF32)
    full = gpu_program.program_summary(kernels, "h200", "float32", matmul_precision="highest")
    assert full["roofline_ms"] == pytest.approx(sum(max(k.flops / 67e12, k.bytes / 4.8e12) for k in kernels) * 1e3)
    tf32 = gpu_program.program_summary(kernels, "h200", "float32")
    assert tf32["roofline_ms"] == pytest.approx(sum(max(k.flops / 495e12, k.bytes / 4.8e12) for k in kernels) * 1e3)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="No ENTRY computation"):
        hlo_kernels.program_kernels("HloModule empty\n")
    with pytest.raises(ValueError, match=r"`card` must be one of \['h100', 'h200'\], got 'a100'"):
        gpu_program.target_config("a100")
    with pytest.raises(ValueError, match=r"`dtype` must be one of \['bfloat16', 'float16', 'float32'\], got 'int8'"):
        gpu_program.program_summary([], "h200", "int8")
    with pytest.raises(ValueError, match=r"`matmul_precision` must be one of \('default', 'highest'\), got 'tf32'"):
        gpu_program.program_summary([], "h200", "float32", "tf32")
    with pytest.raises(TypeError, match="Compiles keras_mone backbones and task models"):
        gpu_program.compiled_forward(object(), 1, None)
    assert "core_count: 132" in gpu_program.target_config("h100")


def test_xla_options_are_parsed_to_typed_values_and_bad_entries_are_named():
    parsed = gpu_program.parse_xla_options(
        ["xla_gpu_experimental_gemm_fusion_v2=true", "--xla_gpu_enable_triton_gemm=False",
         "xla_gpu_autotune_level=0", "xla_dump_to=/tmp/x"])
    assert parsed == {"xla_gpu_experimental_gemm_fusion_v2": True, "xla_gpu_enable_triton_gemm": False,
                      "xla_gpu_autotune_level": 0, "xla_dump_to": "/tmp/x"}
    assert gpu_program.parse_xla_options(None) == {}
    for bad in ("xla_gpu_enable_triton_gemm", "gpu_enable_triton_gemm=true", "xla_gpu_enable_triton_gemm="):
        with pytest.raises(ValueError, match=f"An XLA option is NAME=VALUE.*got '{bad}'"):
            gpu_program.parse_xla_options([bad])


@pytest.mark.skipif(BACKEND != "jax", reason="reads an XLA program jax compiles")
def test_the_flops_read_from_a_compiled_program_are_the_models_matmul_flops():
    # An independent check of the reader on a real optimised program (this CPU's): a
    # one-block dense ViT's dots, wherever XLA put them, add up to its MACs x 2.
    import jax

    from keras_mone import models
    from keras_mone.analysis import flops as count_macs

    model = models.ViTBackbone(**{**TINY, "depth": 1})
    model.build((None, 32, 32, 3))
    x = np.zeros((2, 32, 32, 3), "float32")

    def forward(weights, x):
        return model.stateless_call(weights, [], x, training=False)[0]

    text = jax.jit(forward).lower([v.value for v in model.trainable_variables], x).compile().as_text()
    read = sum(k.flops for k in hlo_kernels.program_kernels(text))
    macs = count_macs(model)  # per example; the patch embedding is a convolution on the CPU, not a dot
    assert read == 2 * 2 * (macs.total - macs.breakdown["patch_embedding"]), macs.breakdown


@pytest.mark.skipif(BACKEND != "jax", reason="reads an XLA program jax compiles")
def test_the_memory_peak_read_from_xlas_dump(tmp_path):
    # Two (256, 256) float32 products are both live at the third (256 KiB each);
    # XLA's heap holds at least what is live at once, and nothing is read from an empty folder.
    import jax
    import jax.numpy as jnp

    def two_products(x, w1, w2):
        return (x @ w1) @ (x @ w2).T

    arrays = [jnp.ones((256, 256), "float32")] * 3
    cached = jax.config.jax_enable_compilation_cache
    with hlo_memory.compiled_afresh():
        options = hlo_memory.dump_options(str(tmp_path), "jit_two_products")
        compiled = jax.jit(two_products).lower(*arrays).compile(compiler_options=options)
    assert jax.config.jax_enable_compilation_cache == cached
    memory = hlo_memory.program_memory(str(tmp_path))
    assert memory.live_peak_bytes >= 2 * 256 * 256 * 4
    assert memory.heap_bytes == compiled.memory_analysis().temp_size_in_bytes
    products = [b for b in memory.at_peak if b.shape.startswith("f32[256,256]")]
    assert len(products) >= 2 and any("dot_general" in b.op_name for b in products)
    with pytest.raises(ValueError, match="`folder` must hold XLA's dump of exactly one compiled program"):
        hlo_memory.program_memory(str(tmp_path / "empty"))


def test_temporaries_of_every_allocation_with_tuple_shapes():
    # XLA may make one preallocated-temp allocation per memory space: offsets restart in each
    assignment = (
        "allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:\n"
        " value: <1 p @0> (size=64,offset=0): f32[16]{0}\n"
        "allocation 1: size 96, preallocated-temp:\n"
        " value: <2 a @0> (size=64,offset=0): f32[16]{0}\n"
        " value: <3 t @0> (size=16,offset=64): (f32[2]{0}, f32[2]{0})\n"
        "allocation 2: size 32, color 2, preallocated-temp:\n"  # temporaries in their own memory space
        " value: <4 b @0> (size=32,offset=0): bf16[16]{0}\n"
    )
    heap, values = hlo_memory._temporaries(assignment)
    assert heap == 128 and sorted(values) == ["a", "b", "t"]
    assert values["t"][2] == "(f32[2]{0}, f32[2]{0})"
    memory = hlo_memory._peak(heap, values, (["a", "b"], {"a": (0, 1), "b": (1, 1), "t": (0, 1)}), {})
    assert memory.live_peak_bytes == 64 + 16 + 32  # a and b share offset 0, in different allocations
    with pytest.raises(ValueError, match="do not place the temporary 'b'"):
        hlo_memory._peak(heap, values, (["a"], {"a": (0, 1), "t": (0, 1)}), {})
    unknown = assignment.replace("size 32, color 2, preallocated-temp", "size 32, colour 2, preallocated-temp")
    with pytest.raises(ValueError, match="preallocated-temp allocation in a form this reader does not know"):
        hlo_memory._temporaries(unknown)


def test_a_buffer_reused_in_place_counts_once_at_the_peak():
    # XLA's live ranges include both ends: an elementwise result written into its operand's
    # buffer starts where the operand ends. The union of heap intervals counts it once.
    values = {"a": (0, 100, "f32[25]"), "b": (0, 100, "f32[25]"), "c": (100, 40, "f32[10]")}
    schedule = (["a", "b", "c"], {"a": (0, 1), "b": (1, 2), "c": (1, 2)})
    memory = hlo_memory._peak(140, values, schedule, {"b": "jit(f)/tanh"})
    assert memory.live_peak_bytes == 140 and memory.peak_instruction == "b"
    assert [(b.name, b.op_name) for b in memory.at_peak] == [("a", ""), ("b", "jit(f)/tanh"), ("c", "")]


def test_compiling_for_a_gpu_gives_the_gpus_forms_and_then_the_machines_again(monkeypatch):
    from keras_mone.layers import platform_forms

    for name in platform_forms.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    here = platform_forms.current_forms()
    with platform_forms.compiling_for("gpu"):
        assert platform_forms.accelerator() == "gpu"
        assert platform_forms.attention_form() == "fused"
        jax_gpu = BACKEND == "jax"
        assert platform_forms.gelu_form() == ("rational" if jax_gpu else "library")
        assert platform_forms.patches_form() == ("matmul" if jax_gpu else "conv")
    assert platform_forms.accelerator() == "cpu" and platform_forms.current_forms() == here
    with pytest.raises(ValueError, match=r"`platform` must be one of \['gpu', 'tpu', 'cpu'\], got 'cuda'"):
        with platform_forms.compiling_for("cuda"):
            pass


def _cuda_plugin_installed():
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


def _run_gpu_program_script(output, *arguments):
    """``bench/gpu_program.py ARGUMENTS --output OUTPUT`` in a fresh process (XLA reads XLA_FLAGS,
    which ``--cublas-gemms`` sets, once, when jax starts); returns its report."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(root / "bench" / "gpu_program.py"), *arguments, "--output", str(output)],
        env={**os.environ, "KERAS_BACKEND": "jax"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return (output / "gpu_program.md").read_text()


@pytest.mark.skipif(BACKEND != "jax" or not _cuda_plugin_installed(),
                    reason="needs jax's CUDA plugin (pip install 'jax[cuda12]'), which CI lacks")
def test_the_script_compiles_dense_and_mone_vit_for_an_h200(tmp_path):
    report = _run_gpu_program_script(tmp_path, "--batch-size", "8", "--forms", "present", "--cublas-gemms",
                                     "--top", "40", "--memory")
    assert "| present | dense |" in report and "| present | MoNE |" in report
    assert "__cudnn$fmhaSoftmax" in report  # bfloat16 attention goes to cuDNN, as on the card
    assert list(tmp_path.glob("hlo_MoNE_present.txt.gz"))
    assert "Live at the memory peak of MoNE present" in report


@pytest.mark.skipif(BACKEND != "jax" or not _cuda_plugin_installed(),
                    reason="needs jax's CUDA plugin (pip install 'jax[cuda12]'), which CI lacks")
def test_highest_matmul_precision_reaches_every_cublas_gemm_of_the_script(tmp_path):
    # float32 without TF32 (MoNE Table 1's V100 regime): every GEMM of both programs at HIGHEST
    import gzip
    import re

    report = _run_gpu_program_script(tmp_path, "--batch-size", "2", "--forms", "present", "--precision", "float32",
                                     "--cublas-gemms", "--matmul-precision", "highest")
    assert "matmuls at jax's \"highest\" precision" in report
    for model in ("dense", "MoNE"):
        program = gzip.open(tmp_path / f"hlo_{model}_present.txt.gz", "rt").read()
        gemms = [line for line in program.splitlines() if "custom_call_target=\"__cublas$gemm\"" in line
                 or "__cublas$lt$matmul" in line and "custom-call(" in line]
        assert gemms and all(re.search(r'"operand_precision":\["HIGHEST","HIGHEST"\]', g) for g in gemms), model


@pytest.mark.skipif(BACKEND != "jax" or not _cuda_plugin_installed(),
                    reason="needs jax's CUDA plugin (pip install 'jax[cuda12]'), which CI lacks")
def test_xla_options_reach_the_compile_of_each_program():
    # bench/xla_gemm_fusions.py's programs: XLA's experimental GEMM fusion takes the GELU
    # into the GEMMs (2 kernels, not 4) only when the option reaches the compile
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import xla_gemm_fusions

    device = gpu_program.compile_only_device("h200")
    function, shapes = xla_gemm_fusions.programs(96, 1024)["MLP, product GELU"]
    plain = xla_gemm_fusions.compiled_kernels(function, shapes, device, {})
    fused = xla_gemm_fusions.compiled_kernels(function, shapes, device,
                                              {"xla_gpu_experimental_gemm_fusion_v2": True})

    def passes_over_the_hidden_activations(kernels):
        return [k.kind for k in kernels if k.shape.endswith("[1024,3072]")]

    assert passes_over_the_hidden_activations(plain) == ["gemm", "fusion"]  # fc1, then the GELU
    assert passes_over_the_hidden_activations(fused) == ["gemm"]  # fc1 with the GELU
    hidden_bytes = 1024 * 3072 * 2  # bf16
    assert sum(k.bytes for k in plain) - sum(k.bytes for k in fused) == 2 * hidden_bytes  # the GELU's read and write


@pytest.mark.skipif(BACKEND != "jax" or not _cuda_plugin_installed(),
                    reason="needs jax's CUDA plugin (pip install 'jax[cuda12]'), which CI lacks")
def test_cublaslt_takes_the_tanh_gelu_into_fc1():
    # the AugReg presets' GELU (gelu_approximate): with every GEMM cuBLAS's and cuBLASLt on,
    # fc1 writes the activated hidden units and no pass of its own reads them (BENCHMARKS.md,
    # "The tanh GELU in cuBLASLt's epilogue"); the exact GELU keeps its pass
    import jax
    import jax.numpy as jnp

    device = gpu_program.compile_only_device("h200")
    placed = jax.sharding.SingleDeviceSharding(device)
    shapes = [((1024, 96), jnp.bfloat16), ((96, 3072), jnp.bfloat16), ((3072,), jnp.bfloat16)]
    arguments = [jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for shape, dtype in shapes]
    options = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": True}

    def hidden_passes(approximate):
        def fc1(x, w, b):
            return jax.nn.gelu(jnp.dot(x, w) + b, approximate=approximate)

        compiled = jax.jit(fc1).lower(*arguments).compile(compiler_options=options)
        return [k.kind for k in hlo_kernels.program_kernels(compiled.as_text()) if "[1024,3072]" in k.shape]

    assert hidden_passes(approximate=True) == ["gemm"]
    assert hidden_passes(approximate=False) == ["gemm", "fusion"]


def test_the_scripts_tanh_gelu_reaches_both_models(monkeypatch):
    """``bench/gpu_program.py --gelu-approximate`` builds the dense and the MoNE model with
    ``gelu_approximate=True`` (no CUDA plugin needed: stopped once the models are named)."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import gpu_program as script

    seen = []

    class Named(Exception):
        pass

    def model_specs(variant, capacities, image_size, overrides, family):
        seen.append(dict(overrides))
        raise Named

    monkeypatch.setattr(script.gpu_program, "compile_only_device", lambda card: None)
    monkeypatch.setattr(script, "_model_specs", model_specs)
    for flags, expected in ((["--gelu-approximate"], {"gelu_approximate": True}), ([], {})):
        with pytest.raises(Named):
            script.run(script.parse(["--forms", "present"] + flags))
        assert seen.pop() == expected
