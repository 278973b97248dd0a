"""The GPU form sweep (``bench/gpu_forms.py``) and its device-time profile
(``keras_mone.bench.kernel_profile``), run tiny on the CPU."""

import pathlib

import pytest
from conftest import BACKEND

from keras_mone.bench import kernel_profile

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="jax programs and jax.profiler traces")


@pytest.mark.parametrize("name, op, kind", [
    ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", "", "gemm"),
    ("gemm_fusion_dot_general", "", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "", "attention"),
    ("loop_slice_fusion", "", "copy"),
    ("input_reduce_fusion", "", "reduce"),
    ("loop_multiply_fusion", "", "fusion"),
    ("_residual_tile_", "", "pallas"),
    ("grouped_out_projection_residual_k768_n768_b256_g84x96_61x192", "", "pallas"),
    ("Memset 0", "", "copy"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "", "convolution"),
    ("sm90_xmma_gemm_bf16", "cudnn-conv-bias-activation.3", "convolution"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<float>", "", "convolution"),
    ("triton_softmax", "", "reduce"),
    ("loop_convert_fusion", "", "fusion"),
    ("something_else", "", "other"),
])
def test_kernels_are_sorted_into_kinds(name, op, kind):
    assert kernel_profile.kind_of(name, op) == kind


def test_a_profile_without_a_trace_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No \\*.xplane.pb under"):
        kernel_profile.kernel_table(str(tmp_path))


def test_the_sweep_times_and_profiles_every_form(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import gpu_forms

    args = gpu_forms.parse(["--tiny", "--batch-sizes", "2", "--forms", "present,free+rational_gelu+patch_matmul",
                            "--repeats", "2", "--profile", "--profile-calls", "1", "--output", str(tmp_path)])
    text = gpu_forms.run(args)
    assert "| forward | 2 | present |" in text and "| forward | 2 | free+rational_gelu+patch_matmul |" in text
    # one dense program per setting of the switches a dense model reads
    assert "dense gelu=rational+patches=matmul" in text and "MoNE present" in text
    assert "kernels per call" in text
    # every form computes the same function: the second form's logits are checked against the first's
    error = float(text.split("free+rational_gelu+patch_matmul: MoNE's logits within ")[1].split(" ")[0])
    assert error < 1e-2
    assert (tmp_path / "gpu_forms.json").exists() and list(tmp_path.glob("hlo_MoNE_present.txt.gz"))
    with pytest.raises(ValueError, match="Unknown form part 'fast'"):
        gpu_forms.form_settings("present+fast")


def test_highest_matmul_precision_reaches_every_dot_of_both_programs(monkeypatch, tmp_path):
    # MoNE Table 1 timed float32 on a V100, which has no TF32: `--matmul-precision highest`
    # traces every matmul at jax's "highest" precision (the output folder does not exist yet:
    # the first profile's HLO creates it)
    import gzip
    import re

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import gpu_forms

    output = tmp_path / "sweep"
    args = gpu_forms.parse(["--tiny", "--batch-sizes", "2", "--forms", "present", "--precision", "float32",
                            "--matmul-precision", "highest", "--repeats", "1", "--profile", "--profile-calls", "1",
                            "--output", str(output)])
    text = gpu_forms.run(args)
    assert "matmuls at jax's \"highest\" precision" in text and "- profile of" not in text
    for model in ("dense_default", "MoNE_present"):
        program = gzip.open(output / f"hlo_{model}.txt.gz", "rt").read()
        dots = [line for line in program.splitlines() if re.search(r"= \S+ dot\(", line)]
        assert dots and all("operand_precision={highest,highest}" in line for line in dots), model
    with pytest.raises(SystemExit):
        gpu_forms.parse(["--matmul-precision", "tf32"])


def test_every_form_the_gpu_script_sweeps_by_default_exists(monkeypatch):
    """``bench/gpu.sh``'s default sweeps (``${FORMS...:-a,b}``) name forms of ``gpu_forms``: a
    misspelt one would cost a card's run."""
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "bench"))
    import gpu_forms

    defaults = re.findall(r"\$\{FORMS[A-Z0-9_]*:-([^}]*)\}", (root / "bench" / "gpu.sh").read_text())
    forms = {form for listed in defaults for form in listed.split(",") if form}  # (FORMS_EXTRA: none)
    assert {"present", "keras_statistics", "fused_statistics"} <= forms
    for form in forms:
        gpu_forms.form_settings(form)  # raises on an unknown name


def test_the_tanh_gelu_reaches_both_programs(monkeypatch, tmp_path):
    """``--gelu-approximate`` builds the dense and the MoNE model with the AugReg presets' tanh
    GELU (the form cuBLASLt takes into fc1's epilogue); without it both keep the exact one."""
    import gzip

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import gpu_forms

    for approximate in (True, False):
        output = tmp_path / str(approximate)
        args = gpu_forms.parse(["--tiny", "--batch-sizes", "2", "--forms", "present", "--repeats", "1",
                                "--profile", "--profile-calls", "1", "--output", str(output)]
                               + (["--gelu-approximate"] if approximate else []))
        text = gpu_forms.run(args)
        assert ("tanh GELU" in text) == approximate
        for model in ("dense_default", "MoNE_present"):
            program = gzip.open(output / f"hlo_{model}.txt.gz", "rt").read()
            assert (" tanh(" in program) == approximate, (model, approximate)
