"""Speed benchmark of dense ViT vs MoNE-ViT on the current Keras backend and device.

``run_benchmark()`` builds the dense classifier of a variant and one MoNE
classifier per effective capacity, once per precision policy (``float32``,
``mixed_bfloat16``: ``keras.mixed_precision.set_global_policy`` around the
builds, restored after), and times them *in the same process, interleaved
round-robin* over the repeats (the starting model rotates every repeat), so
machine noise hits all models alike. The figures to quote are the ratios to
the dense model of the same run and precision:

- device input (``device_forward``, ``device_train``; ``bench_device``): the
  batch placed on the device once, the forward pass compiled (jax: ``jax.jit``
  over ``model.stateless_call``; torch: eager, and with ``torch_compile`` also
  under ``torch.compile``; tensorflow: ``tf.function``) and waited for; the
  training step adds the cross-entropy gradient and an AdamW update; with
  each model's peak device memory where the device reports it;
- host input (``forward``, ``train``): ``model.predict_on_batch(x)`` and
  ``model.train_on_batch(x, y)`` on numpy arrays (AdamW 1e-4, sparse
  categorical cross-entropy from logits), host-to-device copies included;
- speedup (dense median / model median) next to the analytic FLOP ratio
  (``keras_mone.analysis.flop_ratio``; the training FLOP ratio is the same
  ratio, since every counted product costs ~3x in a training step) and their
  quotient, the *efficiency* (1.0 = the FLOP savings are fully realised);
- the share of the MoNE forward pass spent routing (first precision only): a
  compiled probe running patch embedding + router + Expert Preferred Routing
  + the token gathers (``token_routing().before_block``), minus a probe
  running the patch embedding only, over the MoNE host-input forward median
  (a second probe also restores the token order, as after the last block);
- optionally peak host memory (``memory=True``): one subprocess per model,
  mode and precision, peak RSS minus the RSS after imports and model build;
- peers: ``keras_hub.models.ViTBackbone`` of the same size (first precision,
  when ``keras_hub`` is importable) and timm's ``vit_base_patch16_224`` in
  plain PyTorch (every precision, when torch and timm are importable).

The result is a JSON-serialisable dict that includes the command line that
reproduces it and the device's name; ``format_markdown(result)`` renders it,
and ``output_dir`` receives ``benchmark.json``, ``benchmark.md`` and
``speedup_vs_flops.png``. The same benchmark runs from the shell as
``keras-mone bench``. Its parts: ``bench_models`` (specs, builds, routing
probes, keras-hub peer), ``bench_device`` (device, precision, device-input
steps, device memory, timm peer), ``bench_measure`` (timing, host memory,
environment) and ``bench_report`` (files, tables, plot); this module runs them.
"""

import json
import sys

import keras

from keras_mone.bench.device import check_precisions
from keras_mone.bench.measure import (  # noqa: F401  (_memory_child: the -m entry point below)
    _environment,
    _memory_child,
    reproduce_command,
)
from keras_mone.bench.models import (  # noqa: F401  (_model_specs, mone_label: used by tests and reports)
    DEFAULT_CAPACITIES,
    SCHEMA_VERSION,
    _build,
    _model_specs,
    mone_label,
)
from keras_mone.bench.precision import MODES, _add_rss_memory, _run_precision  # noqa: F401
from keras_mone.bench.torch_compile import compile_modes
from keras_mone.bench.report import (  # noqa: F401  (re-exported: the benchmark's public API)
    _jsonable,
    append_to_benchmarks,
    format_markdown,
    parse_model_override,
    plot_speedup_vs_flops,
    write_outputs,
)

__all__ = [
    "append_to_benchmarks", "format_markdown", "parse_model_override", "plot_speedup_vs_flops", "reproduce_command",
    "run_benchmark", "write_outputs",
]

def run_benchmark(
    variant="B/16", family="vit", capacities=DEFAULT_CAPACITIES, batch_size=8, image_size=224, repeats=10,
    warmup=2, train_step=True, memory=False, peer=True, output_dir=None, seed=0, model_overrides=None,
    memory_calls=3, verbose=True, precisions=("float32",), device_input=True, host_input=True,
    routing_probes=True, timm_peer=True, torch_compile=False,
):
    """Times dense and MoNE classifiers of ``variant`` on the current backend and device.

    Args:
        variant: ViT size and patch, e.g. "B/16" (presets ``vit_b16`` and
            ``mone_vit_b16``); a variant without presets uses the B/16
            presets with its size.
        family: "vit" (images) or "vivit" (ViViT-FE on clips: presets
            ``vivit_fe_b16`` / ``mone_vivit_fe_b16``, 32 frames; change the
            clip length with ``model_overrides={"num_frames": 8}``).
        capacities: MoNE effective capacities ``e_c``, one model each.
        batch_size: images per batch.
        image_size: image (or frame) side (the presets' other settings are kept).
        repeats: timed calls per model, interleaved round-robin.
        warmup: untimed calls per model before timing (>= 1; the first compiles).
        train_step: also time training steps (AdamW 1e-4, cross-entropy).
        memory: measure peak RSS of every model and mode in a subprocess.
        peer: time keras_hub's ``ViTBackbone`` of the same size if importable.
        output_dir: if given, write ``benchmark.json`` / ``.md`` and the plot there.
        seed: seed of weights and data.
        model_overrides: extra ``from_preset`` arguments for all models, e.g.
            ``dict(patch_size=8, hidden_dim=32, depth=2, num_heads=4,
            mlp_dim=64, num_classes=10)`` (MoNE-only ones such as
            ``router_positions`` go to the MoNE models only);
            ``image_size`` here overrides the argument.
        memory_calls: calls per memory subprocess (the first compiles; the
            others' peak is the steady state).
        verbose: print progress lines.
        precisions: Keras dtype policies, each a separate set of models
            (``bench_device.PRECISIONS``); speed-ups compare within one.
        device_input: time compiled steps on a batch already on the device.
        host_input: time ``predict_on_batch`` / ``train_on_batch`` on numpy.
        routing_probes: time the routing probes (first precision).
        timm_peer: time timm's ViT where torch and timm are importable.
        torch_compile: torch only: also time the forward under ``torch.compile``:
            ``True`` (its default mode, as Keras' ``jit_compile=True``) or modes of
            ``bench.torch_compile.PATHS``, e.g. ``("default",
            "reduce-overhead")`` (the second replays the forward as a CUDA graph).

    Returns:
        A JSON-serialisable dict: ``settings``, ``command`` (reproduces the
        run), ``environment`` (with ``device``), ``model_config``, ``models``
        (one entry per model and precision: FLOPs, the timing fields of
        ``MODES``, ``device_memory``, ``routing``, ``memory``),
        ``routing_probe``, ``peer``, ``timm`` and ``files``.
    """
    settings = _settings(
        variant, family, capacities, batch_size, image_size, repeats, warmup, train_step, memory, peer,
        output_dir, seed, model_overrides, memory_calls, precisions, device_input, host_input,
        routing_probes, timm_peer, torch_compile,
    )
    log = (lambda message: print(f"[bench] {message}", flush=True)) if verbose else (lambda message: None)
    environment = _environment()
    command = reproduce_command(settings, environment["backend"])
    log(f"backend {environment['backend']} on {environment['device']['name']}, keras {keras.__version__}; {command}")
    specs = _model_specs(variant, settings["capacities"], image_size, settings["model_overrides"], family)
    order = settings["precisions"]
    # mixed precisions first: jax's peak-memory mark never resets, so smaller steps go first
    parts, cache = {}, {}
    for precision in sorted(order, key=lambda p: p == "float32"):
        parts[precision] = _run_precision(specs, precision, settings, precision == order[0], cache, log)
    result = _result(settings, command, environment, [parts[p] for p in order], cache.get("timm_info"))
    if memory:
        _add_rss_memory(specs, result["models"], settings, log)
    if output_dir is not None:
        result["files"] = write_outputs(result, output_dir)
        log(f"wrote {', '.join(result['files'].values())}")
    return _jsonable(result)


def _result(settings, command, environment, parts, timm_info):
    """The result dict from the precisions' parts (in the order asked)."""
    first = parts[0]
    timm_runs = {p: part["timm"] for p, part in zip(settings["precisions"], parts) if part["timm"]}
    return {
        "schema": SCHEMA_VERSION,
        "title": f"dense vs MoNE speed ({settings['family']})",
        "command": command,
        "settings": settings,
        "environment": environment,
        "model_config": first["model_config"],
        "models": [row for part in parts for row in part["rows"]],
        "routing_probe": first["routing_probe"],
        "peer": first["peer"],
        "timm": dict(timm_info or {}, runs=timm_runs),
        "warnings": [w for part in parts for w in part["warnings"]],
        "files": {},
    }


def _settings(variant, family, capacities, batch_size, image_size, repeats, warmup, train_step, memory, peer,
              output_dir, seed, model_overrides, memory_calls, precisions, device_input, host_input,
              routing_probes, timm_peer, torch_compile):
    """The validated settings dict of a run (what ``reproduce_command`` reads)."""
    capacities = tuple({mone_label(float(c)): float(c) for c in capacities}.values())
    if not capacities:
        raise ValueError("`capacities` must list at least one effective capacity.")
    for name, value, minimum in (
        ("batch_size", batch_size, 1), ("repeats", repeats, 1), ("warmup", warmup, 1), ("memory_calls", memory_calls, 1)
    ):
        if not isinstance(value, int) or value < minimum:
            raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}.")
    if not (device_input or host_input):
        raise ValueError("Time at least one input path: `device_input` or `host_input`.")
    return dict(
        variant=str(variant), family=family, capacities=list(capacities), batch_size=batch_size,
        image_size=image_size, repeats=repeats, warmup=warmup, train_step=bool(train_step), memory=bool(memory),
        peer=bool(peer), output_dir=None if output_dir is None else str(output_dir), seed=seed,
        model_overrides=dict(model_overrides or {}), memory_calls=memory_calls,
        precisions=check_precisions(precisions), device_input=bool(device_input), host_input=bool(host_input),
        routing_probes=bool(routing_probes), timm_peer=bool(timm_peer),
        torch_compile=compile_modes(torch_compile),
    )


def _main(argv):
    """``python -m keras_mone.bench.benchmark --memory-probe SPEC``: one memory subprocess."""
    if len(argv) == 2 and argv[0] == "--memory-probe":
        _memory_child(json.loads(argv[1]))
        return 0
    print("Run benchmarks with `keras-mone bench` (see `keras-mone bench --help`).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
