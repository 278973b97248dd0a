"""The benchmark harness (keras_mone.bench.benchmark, `keras-mone bench`) end to end.

A tiny configuration, 2 repeats: this checks the structure of the result, the
files and the command line, never the timings (the machine is shared). The
device-input path runs on the CPU here; ``test_bench_devices.py`` has the precisions,
the timm peer and the GPU branches.
"""

import json
import os
import shlex

import keras
import pytest

from bench_cases import HAS_KERAS_HUB, HAS_TIMM, HAS_TORCH, OVERRIDES, STAT_KEYS, TINY_RUN
from conftest import BACKEND, TINY
from keras_mone.bench import benchmark
from keras_mone.bench import device as bench_device
from keras_mone.cli.main import build_parser, main

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    output = tmp_path_factory.mktemp("bench")
    keras.utils.set_random_seed(0)
    result = benchmark.run_benchmark(**TINY_RUN, train_step=True, peer=True, output_dir=str(output))
    return result, output


def test_result_structure(run):
    result, _ = run
    assert json.loads(json.dumps(result, allow_nan=False)) == result  # JSON-serialisable
    assert result["environment"]["backend"] == BACKEND
    assert result["environment"]["versions"]["keras"] == keras.__version__
    settings = result["settings"]
    assert settings["capacities"] == [0.5] and settings["repeats"] == 2 and settings["warmup"] == 1
    config = result["model_config"]
    assert config["hidden_dim"] == TINY["hidden_dim"] and config["depth"] == TINY["depth"]
    assert config["image_size"] == [TINY["image_size"]] * 2 and config["num_classes"] == 10
    assert config["presets"] == ["vit_ti16", "mone_vit_ti16"]

    rows = {row["label"]: row for row in result["models"]}
    assert list(rows) == ["dense", "mone e_c=0.5"]
    dense, half = rows.values()
    assert dense["flop_ratio"] == 1.0 and dense["forward"]["speedup"] == 1.0
    assert dense["device_forward"]["speedup"] == 1.0 and dense["device_train"]["speedup"] == 1.0
    assert half["flop_ratio"] > 1.0 and half["capacity"] == 0.5
    assert sum(half["tokens_per_expert"]) + half["dropped_tokens"] == config["num_tokens"]
    for row in rows.values():
        assert row["parameters"] > 0 and row["gmacs"] > 0
        assert row["precision"] == "float32" and row["dtype_policy"] == "float32"
        assert row["compiled_forward"] is None  # torch.compile only on request
        for mode in ("forward", "train", "device_forward", "device_train"):
            stats = row[mode]
            assert STAT_KEYS <= set(stats), mode
            assert len(stats["times_s"]) == 2
            assert stats["min_s"] <= stats["median_s"] <= stats["max_s"]
            assert stats["efficiency"] == pytest.approx(stats["speedup"] / stats["flop_ratio"])
            assert stats["images_per_s"] == pytest.approx(2 / stats["median_s"])
        assert row["memory"] is None
    assert dense["routing"] is None
    routing = half["routing"]
    assert routing["router_epr_s"] == pytest.approx(routing["routing_probe_s"] - routing["embedding_probe_s"])
    assert routing["share_of_forward"] == pytest.approx(routing["router_epr_s"] / half["forward"]["median_s"])
    assert routing["routers_in_model"] == 1
    assert set(result["routing_probe"]) == {"embedding", "route 0.5", "route+restore 0.5"}
    assert isinstance(result["warnings"], list)


def test_report_names_the_device(run):
    result, _ = run
    device = result["environment"]["device"]
    title = benchmark.format_markdown(result).splitlines()[0]
    assert title.endswith(f"backend {BACKEND} on {device['name']}")
    if device["platform"] == "cpu":  # CI: the processor's model, from /proc/cpuinfo or platform
        assert device["name"] == f"CPU: {bench_device.cpu_model()}" and bench_device.cpu_model()


def test_device_input_path(run):
    # CPU: the batch is "on the device" in host memory; device memory statistics are absent ("n/a")
    result, _ = run
    markdown = benchmark.format_markdown(result)
    for row in result["models"]:
        for phase in ("forward", "train"):
            memory = row["device_memory"][phase]
            assert memory["device"] is None
            assert (memory["compiled_mib"] is not None) == (BACKEND == "jax")  # XLA memory_analysis
            if BACKEND == "jax":
                assert memory["compiled_mib"] > 0
    for heading in ("**Summary**", "**Forward pass**, device input", "**Training step**, device input",
                    "**Forward pass**, host input", "| mone e_c=0.5 | forward, device input | float32 | 2 |"):
        assert heading in markdown
    assert "n/a / n/a" in markdown  # peak device memory of dense / MoNE


def test_peer_reference(run):
    peer = run[0]["peer"]
    if HAS_KERAS_HUB:
        assert peer["available"] and peer["dense_over_peer_time"] > 0
    else:
        assert peer == {"available": False, "reason": peer["reason"]}
        assert "keras_hub" in peer["reason"]
    assert "Peer reference" in benchmark.format_markdown(run[0])
    timm = run[0]["timm"]
    if HAS_TIMM and HAS_TORCH:
        assert timm["available"] and set(timm["runs"]) == {"float32"}
    else:
        assert not timm["available"] and timm["reason"].startswith("timm not installed") and not timm["runs"]
        assert "**timm peer**: none (timm not installed" in benchmark.format_markdown(run[0])


def test_files_written(run):
    result, output = run
    files = result["files"]
    assert set(files) == {"json", "markdown", "plot"}
    assert {os.path.basename(p) for p in files.values()} == {
        "benchmark.json", "benchmark.md", "speedup_vs_flops.png"
    }
    with open(os.path.join(output, "benchmark.json")) as f:
        assert json.load(f) == result
    with open(os.path.join(output, "benchmark.md")) as f:
        markdown = f.read()
    assert markdown == benchmark.format_markdown(result)
    for heading in ("**Forward pass**", "**Training step**", "**Routing overhead**"):
        assert heading in markdown
    assert "| dense |" in markdown and "| mone e_c=0.5 |" in markdown
    assert result["command"] in markdown
    with open(os.path.join(output, "speedup_vs_flops.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_command_reproduces_the_settings(run):
    result, output = run
    words = shlex.split(result["command"])
    assert words[0] == f"KERAS_BACKEND={BACKEND}" or f"KERAS_BACKEND={BACKEND}" in words
    args = build_parser().parse_args(words[words.index("keras-mone") + 1:])
    settings = result["settings"]
    assert args.command == "bench" and args.variant == settings["variant"]
    assert [float(c) for c in args.capacities.split(",")] == settings["capacities"]
    assert (args.batch_size, args.image_size, args.repeats, args.warmup, args.seed) == (
        settings["batch_size"], settings["image_size"], settings["repeats"], settings["warmup"], settings["seed"]
    )
    assert (args.train_step, args.memory, args.peer) == (True, False, True)
    assert (args.precision, args.device_input, args.host_input, args.routing_probes, args.timm) == (
        "float32", True, True, True, True
    )
    assert not args.torch_compile
    assert dict(benchmark.parse_model_override(o) for o in args.model_override) == OVERRIDES
    assert args.output == str(output)


def test_cli_prints_and_appends(tmp_path, capsys):
    benchmarks = tmp_path / "BENCHMARKS.md"
    benchmarks.write_text("# Benchmarks\n")
    output = tmp_path / "out"
    argv = [
        "bench", "--variant", "Ti/16", "--capacities", "1.0", "--batch-size", "2",
        "--image-size", str(TINY["image_size"]), "--repeats", "2", "--warmup", "1",
        "--no-train-step", "--no-peer", "--quiet", "--output", str(output),
        "--append-benchmarks", str(benchmarks),
    ]
    argv += [arg for key, value in OVERRIDES.items() for arg in ("--model-override", f"{key}={value}")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "**Forward pass**" in printed and "**Training step**" not in printed
    assert "| mone e_c=1 |" in printed
    text = benchmarks.read_text()
    assert text.startswith("# Benchmarks\n")
    result = json.loads((output / "benchmark.json").read_text())
    full = result["models"][1]
    assert full["train"] is None and full["tokens_per_expert"][-1] == result["model_config"]["num_tokens"]
    assert result["peer"]["available"] is False
    for needle in (result["command"], f"backend {BACKEND}", f"keras {keras.__version__}", "CPU cores"):
        assert needle in text
    assert "--no-train-step" in result["command"] and "--no-peer" in result["command"]


def test_video_family_end_to_end(capsys, tmp_path):
    # ViViT-FE presets shrunk to 4 frames of the tiny geometry, through the command line.
    video = {"num_frames": 4, "temporal_depth": 1}
    argv = [
        "bench", "--family", "vivit", "--variant", "Ti/16", "--capacities", "0.5", "--batch-size", "1",
        "--image-size", str(TINY["image_size"]), "--repeats", "1", "--warmup", "1", "--no-train-step",
        "--no-peer", "--quiet", "--output", str(tmp_path),
        *[f"--model-override={k}={v}" for k, v in {**OVERRIDES, **video}.items()],
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Dense ViViT-FE vs MoNE-ViViT-FE" in text and "at 4x32x32" in text and "--family vivit" in text
    with open(tmp_path / "benchmark.json") as f:
        result = json.load(f)
    config = result["model_config"]
    assert config["presets"] == ["vivit_fe_b16", "mone_vivit_fe_b16"] and config["num_frames"] == 4
    mone = result["models"][1]
    assert sum(mone["tokens_per_expert"]) + mone["dropped_tokens"] == config["num_tokens"]  # per frame
    assert mone["flop_ratio"] > 1.0
    with pytest.raises(ValueError, match="family"):
        benchmark.run_benchmark(**TINY_RUN, family="audio", verbose=False)


def test_memory_probe_reports_rss(capsys):
    # The code a --memory subprocess runs, here in-process (a subprocess would
    # re-import the backend; run_benchmark(memory=True) does that).
    specs = benchmark._model_specs("Ti/16", (0.5,), TINY["image_size"], OVERRIDES)
    _, preset, kwargs = specs[1]
    spec = dict(preset=preset, kwargs=kwargs, mode="forward", batch_size=2, seed=0, calls=2)
    benchmark._memory_child(json.loads(json.dumps(spec)))
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["baseline_bytes"] > 0 and data["peak_bytes"] > 0 and data["peak_before_bytes"] > 0


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_memory_probe_reports_allocations(capsys, mode):
    # jax: compiled temporaries, torch: profiler allocation peak, tensorflow: none (peak RSS stands)
    specs = benchmark._model_specs("Ti/16", (0.5,), TINY["image_size"], OVERRIDES)
    _, preset, kwargs = specs[1]
    spec = dict(preset=preset, kwargs=kwargs, mode=mode, batch_size=2, seed=0, calls=1)
    benchmark._memory_child(spec)
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    if keras.backend.backend() == "tensorflow":
        assert data["allocation_peak_bytes"] is None and data["allocation_measure"] is None
    else:
        # at least the (batch, tokens, D) activations of one block
        model = benchmark._build(preset, kwargs)
        tokens, width = model.backbone.num_tokens, model.backbone.hidden_dim
        assert data["allocation_peak_bytes"] >= 2 * tokens * width * 4
        assert data["allocation_measure"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(capacities=()), "capacities"),
        (dict(warmup=0), "warmup"),
        (dict(repeats=0), "repeats"),
        (dict(model_overrides={"capacity": 0.5}), "capacities"),
        (dict(variant="X/16"), "variant"),
        (dict(precisions=("float64",)), "precisions"),
        (dict(precisions=()), "precisions"),
        (dict(device_input=False, host_input=False), "input path"),
        (dict(torch_compile="max-autotune"), "torch_compile"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        benchmark.run_benchmark(**{**TINY_RUN, **kwargs, "verbose": False})


def test_parse_model_override():
    assert benchmark.parse_model_override("depth=2") == ("depth", 2)
    assert benchmark.parse_model_override("router_positions=[0,1]") == ("router_positions", [0, 1])
    assert benchmark.parse_model_override("use_class_token=true") == ("use_class_token", True)
    assert benchmark.parse_model_override("pooling=token") == ("pooling", "token")
    with pytest.raises(ValueError, match="model-override.*key=value"):
        benchmark.parse_model_override("depth")


def test_one_override_parser_for_bench_and_recipes():
    from keras_mone.recipes import parse_overrides

    for text in ("depth=2", "router_positions=[0, 1]", "use_class_token=true", "pooling=token", "lr=1e-3"):
        key, value = benchmark.parse_model_override(text)
        assert parse_overrides([text]) == {key: value}


def test_unbuilt_layers_are_found_at_any_depth():
    from keras_mone.bench.models import _unbuilt_layers
    from keras_mone.models import MoNEViTBackbone

    backbone = MoNEViTBackbone(capacity=0.5, **TINY)
    unbuilt = _unbuilt_layers(backbone)
    # the blocks' parts sit two containers deep (a list of blocks, then attributes)
    assert len(unbuilt) > 3 * TINY["depth"] and any("attention" in path for path in unbuilt)
    backbone(keras.ops.zeros((1, TINY["image_size"], TINY["image_size"], 3)))
    assert _unbuilt_layers(backbone) == []


@pytest.fixture
def budget_sweep(monkeypatch, tmp_path):
    """``bench/budget_sweep.py`` imported, run from ``tmp_path`` (no repository file within reach),
    its plot replaced by a stub that records where it was asked to draw."""
    import importlib
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    module = importlib.import_module("budget_sweep")
    plots = []

    def plot_sweep(table, dense, path, extra=None):
        plots.append(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()

    monkeypatch.setattr(module, "plot_sweep", plot_sweep)
    monkeypatch.chdir(tmp_path)
    rows = [
        dict(method="isoFLOP dense", target=0.25, seed=0, setting="depth 1, D 64", accuracy=0.9, gmacs=0.0039),
        dict(method="MoNE", target=0.4, seed=0, setting=0.3057, accuracy=0.91, gmacs=0.0061),
    ]
    os.makedirs("sweep")
    with open(os.path.join("sweep", "budget_sweep.json"), "w") as f:
        json.dump(dict(dense_gmacs=0.01488, rows=rows), f)
    return module, plots


def test_budget_sweep_reports_into_its_run_folder_and_the_steps_that_ran(budget_sweep, capsys):
    module, plots = budget_sweep
    argv = ["--report-only", "--from-dense", "--output", "sweep", "--seeds", "0", "--epochs", "2",
            "--samples-per-digit", "1", "--methods", "isoFLOP dense,MoNE"]
    module.main(argv)
    assert plots == [os.path.join("sweep", "accuracy_vs_gmacs_from_dense.png")]
    assert sorted(os.listdir(".")) == ["sweep"]  # no BENCHMARKS.md, no bench/figures
    with open(os.path.join("sweep", "report.md")) as f:
        text = f.read()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    # 1438 training digits x 1 rendering // 128 = 11 steps an epoch (not the recipes' 179)
    assert "trains 2 epoch(s) = 22 steps of 128 fresh renderings" in text
    assert "--samples-per-digit 1`" in text and "--update-benchmarks" not in text
    assert "| MoNE | 0.4 | 0.3057 | 0.00610 | 91.00 +- 0.00 | 1 |" in text

    module.main(argv + ["--update-benchmarks"])
    figure = os.path.join("bench", "figures", "accuracy_vs_gmacs_from_dense.png")
    assert plots[-1] == figure and os.path.exists(figure)
    with open("BENCHMARKS.md") as f:
        section = f.read()
    assert "--samples-per-digit 1 --update-benchmarks`" in section and f"Plot: `{figure}`" in section
    assert section.count("## isoFLOP dense, MoNE across budgets on cluttered digits, converted from vit_digits, 2 epochs") == 1


def test_budget_sweep_steps_follow_the_recipes(budget_sweep):
    from argparse import Namespace

    module, _ = budget_sweep
    # 16 renderings of each of the 1438 training digits, whole batches of 128
    for from_dense in (False, True):
        assert module.steps_per_epoch(Namespace(from_dense=from_dense, samples_per_digit=None)) == (179, 128)
    assert module.steps_per_epoch(Namespace(from_dense=True, samples_per_digit=4)) == (44, 128)
