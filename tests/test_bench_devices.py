"""The benchmark harness across precisions and devices: mixed_bfloat16, the timm peer, the
forward and training steps on device input, torch.compile's modes, and the GPU branches
(device names, peak device memory), which run here against fakes."""

import shlex
import sys
import types

import keras
import numpy as np
import pytest

from bench_cases import STAT_KEYS, TINY_RUN
from conftest import BACKEND, TINY
from keras_mone.bench import benchmark
from keras_mone.bench import device as bench_device
from keras_mone.bench import models as bench_models
from keras_mone.bench.tables import combined_table, device_memory
from keras_mone.cli.main import build_parser


# ---------------------------------------------------------------------------
# precisions, the timm peer, device names and device memory
# ---------------------------------------------------------------------------
def _fake_timm():
    """A stand-in ``timm`` module whose ``create_model`` builds a small torch model of the asked geometry."""
    torch = pytest.importorskip("torch")

    class Tiny(torch.nn.Module):
        def __init__(self, img_size, patch_size, embed_dim, num_classes, **kwargs):
            super().__init__()
            self.embed = torch.nn.Conv2d(3, embed_dim, patch_size, stride=patch_size)
            self.head = torch.nn.Linear(embed_dim, num_classes)

        def forward(self, x):
            return self.head(self.embed(x).flatten(2).mean(-1))

    module = types.ModuleType("timm")
    module.__version__ = "0.0-fake"
    module.calls = []

    def create_model(name, pretrained=False, **kwargs):
        module.calls.append((name, pretrained, kwargs))
        return Tiny(**kwargs)

    module.create_model = create_model
    return module


@pytest.fixture(scope="module")
def precision_run():
    """float32 and mixed_bfloat16, device input only, with a fake timm installed."""
    fake = _fake_timm()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "timm", fake)
        result = benchmark.run_benchmark(
            **TINY_RUN, precisions=("float32", "mixed_bfloat16"), host_input=False, routing_probes=False,
            peer=False, verbose=False,
        )
    return result, fake


def test_precisions(precision_run):
    result, _ = precision_run
    assert keras.mixed_precision.global_policy().name == "float32"  # restored
    assert result["settings"]["precisions"] == ["float32", "mixed_bfloat16"]
    rows = [(r["precision"], r["label"], r["dtype_policy"]) for r in result["models"]]
    assert rows == [
        ("float32", "dense", "float32"), ("float32", "mone e_c=0.5", "float32"),
        ("mixed_bfloat16", "dense", "mixed_bfloat16"), ("mixed_bfloat16", "mone e_c=0.5", "mixed_bfloat16"),
    ]
    for row in result["models"]:
        assert row["forward"] is None and row["train"] is None  # no host input
        assert row["routing"] is None
        for mode in ("device_forward", "device_train"):
            assert STAT_KEYS <= set(row[mode]) and len(row[mode]["times_s"]) == 2
            assert row[mode]["speedup"] == 1.0 or row["kind"] == "mone"
    assert result["routing_probe"] == {}
    markdown = benchmark.format_markdown(result)
    assert "precision float32, mixed_bfloat16" in markdown
    assert "| mone e_c=0.5 | forward, device input | mixed_bfloat16 | 2 |" in markdown
    assert "| dense | mixed_bfloat16 |" in markdown  # the timing tables gain a precision column
    assert "**Forward pass**, host input" not in markdown
    words = shlex.split(result["command"])
    args = build_parser().parse_args(words[words.index("keras-mone") + 1:])
    assert (args.precision, args.host_input, args.routing_probes, args.peer) == (
        "float32,mixed_bfloat16", False, False, False
    )


def test_timm_peer_present(precision_run):
    result, fake = precision_run
    timm = result["timm"]
    assert timm["available"] and timm["version"] == "0.0-fake" and timm["model"] == "vit_base_patch16_224"
    name, pretrained, kwargs = fake.calls[0]
    assert len(fake.calls) == 1  # built once, timed in every precision
    assert (name, pretrained) == ("vit_base_patch16_224", False)
    assert kwargs["embed_dim"] == TINY["hidden_dim"] and kwargs["depth"] == TINY["depth"]
    assert kwargs["patch_size"] == TINY["patch_size"] and kwargs["num_classes"] == 10
    assert set(timm["runs"]) == {"float32", "mixed_bfloat16"}
    for run in timm["runs"].values():
        assert run["compared_with"] == "device_forward" and run["dense_over_timm_time"] > 0
        assert STAT_KEYS - {"speedup", "flop_ratio", "efficiency"} <= set(run["forward"])
        assert run["memory"]["device"] is None  # CPU
    markdown = benchmark.format_markdown(result)
    assert "**timm peer**: timm 0.0-fake `vit_base_patch16_224`" in markdown
    assert "| mixed_bfloat16 |" in markdown.split("**timm peer**")[1]
    table = combined_table([result])
    assert "timm vit_base_patch16_224" in table and "| ViT-Ti/16 32x32, e_c=0.5 | " + BACKEND + ", float32 |" in table
    assert "fused MLP" not in table and "explicit attention" not in table
    fused = {**result, "environment": {**result["environment"], "mlp_form": "fused"}}
    assert "| forward, device input, fused MLP |" in combined_table([fused])  # a non-default form is named


def test_timm_peer_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` raises ImportError
    backbone = bench_models._build("vit_ti16", {**TINY, "num_classes": 10}).backbone
    model, info = bench_device.build_timm_peer(backbone, 10)
    assert model is None and not info["available"] and info["reason"].startswith("timm not installed")


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_device_steps_match_the_model(precision):
    kwargs = {**TINY, "num_classes": 10, "capacity": 0.5}
    with bench_device.precision_policy(precision):
        model = bench_models._compile(bench_models._build("mone_vit_ti16", kwargs), True)
    assert keras.mixed_precision.global_policy().name == "float32"
    images, labels = bench_models._batch(model.backbone, 10, 2, 0)
    expected = model.predict_on_batch(images)
    x, y = bench_device.device_batch(images, labels)
    step = bench_device.Measured(bench_device.forward_step(model, x))
    logits = keras.ops.convert_to_numpy(keras.ops.cast(step(), "float32"))
    tolerance = 1e-5 if precision == "float32" else 5e-2
    np.testing.assert_allclose(logits, np.asarray(expected, "float32"), rtol=tolerance, atol=tolerance)
    assert step.memory["device"] is None  # no device memory statistics on the CPU
    train = bench_device.train_step(model, x, y)
    losses = [float(keras.ops.convert_to_numpy(keras.ops.cast(train(), "float32"))) for _ in range(3)]
    assert all(np.isfinite(losses))
    if BACKEND == "jax":  # the jax step trains copies: the model's own weights stay as they were
        np.testing.assert_array_equal(model.predict_on_batch(images), expected)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile is the torch backend's")
def test_torch_compile_wraps_the_forward(monkeypatch):
    import torch

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda function, **options: compiled.append(options) or function)
    model = bench_models._build("vit_ti16", {**TINY, "num_classes": 10})
    images, labels = bench_models._batch(model.backbone, 10, 2, 0)
    x, _ = bench_device.device_batch(images, labels)
    for mode in (True, "default", "reduce-overhead"):
        output = bench_device.forward_step(model, x, compiled=mode)()
        assert tuple(output.shape) == (2, 10)
    assert compiled == [{}, {}, {"mode": "reduce-overhead"}]


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile is the torch backend's")
def test_each_torch_compile_mode_is_a_timed_path_of_the_report(monkeypatch):
    import torch

    from torch._dynamo.utils import counters

    modes = []

    def fake_compile(function, **options):  # what inductor does on a CPU: no CUDA graphs, counted
        modes.append(options.get("mode"))
        if options.get("mode") == "reduce-overhead":
            counters["inductor"]["cudagraph_skips"] += 1
        return function

    monkeypatch.setattr(torch, "compile", fake_compile)
    result = benchmark.run_benchmark(
        **TINY_RUN, host_input=False, routing_probes=False, peer=False, timm_peer=False, train_step=False,
        torch_compile="default,reduce-overhead", verbose=False,
    )
    assert sorted(modes, key=str) == sorted([None, None, "reduce-overhead", "reduce-overhead"], key=str)  # 2 models
    mone = next(r for r in result["models"] if r["kind"] != "dense")
    for mode in ("device_forward", "compiled_forward", "cudagraph_forward"):
        assert mone[mode]["median_s"] > 0 and mone[mode]["speedup"] > 0
    report = benchmark.format_markdown(result)
    assert "torch.compile + CUDA graphs" in report and '`torch.compile(mode="reduce-overhead")`' in report
    assert "--torch-compile default,reduce-overhead" in result["command"]
    assert any("ran without CUDA graphs" in warning for warning in result["warnings"])  # none on a CPU


class _FakeJaxDevice:
    platform, device_kind = "gpu", "NVIDIA H200"

    def __init__(self, stats):
        self.stats = list(stats)

    def memory_stats(self):
        return self.stats.pop(0)


def test_jax_gpu_name_and_peak_memory(monkeypatch):
    jax = pytest.importorskip("jax")
    mib = 2**20
    stats = [
        {"bytes_in_use": 100 * mib, "peak_bytes_in_use": 150 * mib}, {"peak_bytes_in_use": 400 * mib},  # rose
        {"bytes_in_use": 100 * mib, "peak_bytes_in_use": 400 * mib}, {"peak_bytes_in_use": 400 * mib},  # did not
    ]
    device = _FakeJaxDevice(stats)
    monkeypatch.setattr(jax, "devices", lambda *args: [device])
    assert bench_device.device_info("jax") == {"name": "NVIDIA H200", "platform": "gpu", "count": 1}
    rose = bench_device.memory_peak("jax", bench_device.memory_mark("jax"))
    assert rose == {"peak_mib": 300.0, "exact": True}
    bound = bench_device.memory_peak("jax", bench_device.memory_mark("jax"))
    assert bound == {"peak_mib": 300.0, "exact": False}
    assert device_memory({"device_memory": {"forward": {"device": bound}}}, "forward") == "<= 300"
    assert device_memory({"device_memory": {"forward": {"device": rose}}}, "forward") == "300"
    assert device_memory({"device_memory": None}, "forward") == "n/a"


def test_torch_cuda_name_and_peak_memory(monkeypatch):
    torch = pytest.importorskip("torch")
    mib = 2**20
    for name, value in dict(
        is_available=lambda: True, get_device_name=lambda *a: "NVIDIA H100 80GB HBM3", device_count=lambda: 1,
        synchronize=lambda *a: None, reset_peak_memory_stats=lambda *a: None,
        memory_allocated=lambda *a: 10 * mib, max_memory_allocated=lambda *a: 74 * mib,
    ).items():
        monkeypatch.setattr(torch.cuda, name, value)
    assert bench_device.device_info("torch") == {"name": "NVIDIA H100 80GB HBM3", "platform": "gpu", "count": 1}
    peak = bench_device.memory_peak("torch", bench_device.memory_mark("torch"))
    assert peak == {"peak_mib": 64.0, "exact": True}


def test_cli_device_options_round_trip():
    settings = dict(
        variant="B/16", family="vit", capacities=[0.3, 0.5], batch_size=64, image_size=224, repeats=10, warmup=2,
        seed=0, train_step=False, memory=False, peer=False, model_overrides={}, output_dir=None,
        precisions=["float32", "mixed_bfloat16"], device_input=True, host_input=False, routing_probes=False,
        timm_peer=False, torch_compile=True,
    )
    words = shlex.split(benchmark.reproduce_command(settings, "torch"))
    args = build_parser().parse_args(words[words.index("keras-mone") + 1:])
    assert args.precision == "float32,mixed_bfloat16" and not args.host_input and not args.routing_probes
    assert not args.timm and args.torch_compile == ["default"] and args.device_input and not args.peer
    for setting in (["default", "reduce-overhead"], "default,reduce-overhead"):
        settings["torch_compile"] = setting
        words = shlex.split(benchmark.reproduce_command(settings, "torch"))
        args = build_parser().parse_args(words[words.index("keras-mone") + 1:])
        assert args.torch_compile == ["default", "reduce-overhead"]
    settings["torch_compile"] = "default"  # a hand-written setting: the default mode, as --torch-compile
    assert benchmark.reproduce_command(settings, "torch").endswith("--torch-compile --no-peer")


def test_torch_compile_modes_are_checked_and_named(capsys):
    from keras_mone.bench.torch_compile import compile_modes

    assert compile_modes(False) == compile_modes("") == compile_modes(None) == compile_modes([]) == []
    assert compile_modes(True) == compile_modes("default") == ["default"]
    assert compile_modes(" reduce-overhead,default,reduce-overhead") == ["reduce-overhead", "default"]
    assert compile_modes(("default", "reduce-overhead")) == ["default", "reduce-overhead"]
    allowed = r"`torch_compile` must be True, False or modes of \['default', 'reduce-overhead'\]"
    for bad in ("max-autotune", "default,cuda", ",", 1, {"default": 1}):
        with pytest.raises(ValueError, match=allowed):
            compile_modes(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--torch-compile", "max-autotune"])
    assert "--torch-compile: takes comma-separated modes of ['default', 'reduce-overhead'], got 'max-autotune'" in (
        capsys.readouterr().err)
