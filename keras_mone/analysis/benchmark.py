"""Speed benchmark of dense ViT vs MoNE-ViT on the current Keras backend.

``run_benchmark()`` builds the dense classifier of a variant and one MoNE
classifier per effective capacity and times them *in the same process,
interleaved round-robin* over the repeats (the starting model rotates every
repeat), so machine noise hits all models alike. The figures to quote are the
ratios to the dense model of the same run:

- forward: ``model.predict_on_batch(x)`` (compiled with ``jit_compile="auto"``);
- training step: ``model.train_on_batch(x, y)`` (AdamW 1e-4, sparse categorical
  cross-entropy from logits) -- forward, backward and optimizer update;
- speedup (dense median / model median) next to the analytic FLOP ratio
  (``keras_mone.analysis.flop_ratio``; the training FLOP ratio is the same
  ratio, since every counted product costs ~3x in a training step) and their
  quotient, the *efficiency* (1.0 = the FLOP savings are fully realised);
- the share of the MoNE forward pass spent routing: a compiled probe running
  patch embedding + router + Expert Preferred Routing + the token gathers
  (the routing part's first regrouping, ``token_routing().before_block``),
  minus a probe running the patch embedding only,
  over the MoNE forward median (a second probe also restores the token order,
  as the model does after the last block);
- optionally peak memory (``memory=True``): one subprocess per model and mode,
  peak RSS minus the RSS after imports and model build;
- a peer reference: ``keras_hub.models.ViTBackbone`` of the same size, when
  ``keras_hub`` is importable.

The result is a JSON-serialisable dict that includes the command line that
reproduces it; ``format_markdown(result)`` renders it, and ``output_dir``
receives ``benchmark.json``, ``benchmark.md`` and ``speedup_vs_flops.png``.
The same benchmark runs from the shell as ``keras-mone bench``. Its parts:
``bench_models`` (specs, builds, routing probes, keras-hub peer),
``bench_measure`` (timing, memory, environment) and ``bench_report``
(files, tables, plot); this module runs them.
"""

import json
import sys
import time

import keras

from keras_mone.analysis.flops import flops
from keras_mone.analysis.bench_measure import (  # noqa: F401  (_memory_child: the -m entry point below)
    _environment,
    _measure_memory,
    _memory_child,
    _stats,
    _time_interleaved,
    reproduce_command,
)
from keras_mone.analysis.bench_models import (  # noqa: F401  (_model_specs, mone_label: used by tests and reports)
    DEFAULT_CAPACITIES,
    DENSE,
    PEER,
    PROBE_CALLS,
    SCHEMA_VERSION,
    _batch,
    _build,
    _build_peer,
    _compile,
    _EmbeddingProbe,
    _model_specs,
    _probe,
    _RoutingProbe,
    _unbuilt_layers,
    mone_label,
)
from keras_mone.analysis.bench_report import (  # noqa: F401  (re-exported: the benchmark's public API)
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
    variant="B/16",
    family="vit",
    capacities=DEFAULT_CAPACITIES,
    batch_size=8,
    image_size=224,
    repeats=10,
    warmup=2,
    train_step=True,
    memory=False,
    peer=True,
    output_dir=None,
    seed=0,
    model_overrides=None,
    memory_calls=3,
    verbose=True,
):
    """Times dense and MoNE classifiers of ``variant`` on the current backend.

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
        train_step: also time ``train_on_batch`` (AdamW 1e-4, sparse
            categorical cross-entropy).
        memory: measure peak RSS of every model and mode in a subprocess.
        peer: time ``keras_hub.models.ViTBackbone`` of the same size if
            ``keras_hub`` is importable.
        output_dir: if given, write ``benchmark.json``, ``benchmark.md`` and
            ``speedup_vs_flops.png`` there.
        seed: seed of weights and data.
        model_overrides: extra ``from_preset`` arguments for all models, e.g.
            ``dict(patch_size=8, hidden_dim=32, depth=2, num_heads=4,
            mlp_dim=64, num_classes=10)`` (MoNE-only ones such as
            ``router_positions`` go to the MoNE models only);
            ``image_size`` here overrides the argument.
        memory_calls: calls per memory subprocess (the first compiles; the
            peak of the others is reported separately, as the steady state).
        verbose: print progress lines.

    Returns:
        A JSON-serialisable dict: ``settings``, ``command`` (reproduces the
        run), ``environment``, ``model_config``, ``models`` (one entry per
        model: FLOPs, ``forward``, ``train``, ``routing``, ``memory``),
        ``routing_probe``, ``peer`` and ``files``.
    """
    capacities = tuple({mone_label(float(c)): float(c) for c in capacities}.values())
    if not capacities:
        raise ValueError("`capacities` must list at least one effective capacity.")
    for name, value, minimum in (
        ("batch_size", batch_size, 1), ("repeats", repeats, 1), ("warmup", warmup, 1), ("memory_calls", memory_calls, 1)
    ):
        if not isinstance(value, int) or value < minimum:
            raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}.")
    model_overrides = dict(model_overrides or {})
    settings = dict(
        variant=str(variant),
        family=family,
        capacities=list(capacities),
        batch_size=batch_size,
        image_size=image_size,
        repeats=repeats,
        warmup=warmup,
        train_step=bool(train_step),
        memory=bool(memory),
        peer=bool(peer),
        output_dir=None if output_dir is None else str(output_dir),
        seed=seed,
        model_overrides=model_overrides,
        memory_calls=memory_calls,
    )
    log = (lambda message: print(f"[bench] {message}", flush=True)) if verbose else (lambda message: None)
    environment = _environment()
    command = reproduce_command(settings, environment["backend"])
    log(f"backend {environment['backend']}, keras {keras.__version__}; {command}")

    # -- models ---------------------------------------------------------------
    specs = _model_specs(variant, capacities, image_size, model_overrides, family)
    keras.utils.set_random_seed(seed)
    models = {}
    for label, preset, kwargs in specs:
        start = time.perf_counter()
        models[label] = _compile(_build(preset, kwargs), train_step)
        log(f"built {label} from {preset} ({time.perf_counter() - start:.1f} s)")
    dense = models[DENSE]
    backbone = dense.backbone
    images, labels = _batch(backbone, dense.num_classes, batch_size, seed)
    first_mone = models[mone_label(capacities[0])].backbone
    model_config = dict(
        image_size=list(backbone.image_size),
        patch_size=backbone.patch_size,
        hidden_dim=backbone.hidden_dim,
        depth=backbone.depth,
        num_heads=backbone.num_heads,
        mlp_dim=backbone.mlp_dim,
        num_channels=backbone.num_channels,
        use_class_token=backbone.use_class_token,
        num_tokens=backbone.num_tokens,
        num_classes=dense.num_classes,
        pooling=dense.pooling,
        num_experts=first_mone.num_experts,
        expert_widths=list(first_mone.expert_widths),
        capacity_method=first_mone.capacity_method,
        router_positions=list(first_mone.router_positions),
        router_type=first_mone.router_type,
        presets=[specs[0][1], specs[1][1]],
        num_frames=getattr(backbone, "num_frames", None),
        tubelet_size=getattr(backbone, "tubelet_size", None),
    )

    # -- forward: models, routing probes and the peer, all interleaved ----------
    forward = {label: (lambda m=m: m.predict_on_batch(images)) for label, m in models.items()}
    probes = {"embedding": _probe(_EmbeddingProbe(backbone, name="embedding_probe"))}
    for capacity in capacities:
        mone_backbone = models[mone_label(capacity)].backbone
        probes[f"route {capacity:g}"] = _probe(_RoutingProbe(mone_backbone, name="routing_probe"))
        probes[f"route+restore {capacity:g}"] = _probe(
            _RoutingProbe(mone_backbone, restore=True, name="routing_restore_probe")
        )
    for name, probe in probes.items():
        forward[f"probe {name}"] = lambda p=probe: [p.predict_on_batch(images) for _ in range(PROBE_CALLS)]
    peer_model, peer_info = (None, {"available": False, "reason": "not requested (peer=False)"})
    if peer and family != "vit":
        peer_info = {"available": False, "reason": f"no keras_hub peer for family {family!r}"}
    elif peer:
        peer_model, peer_info = _build_peer(backbone)
        if peer_model is not None:
            peer_model.compile(jit_compile="auto")
            forward[PEER] = lambda: peer_model.predict_on_batch(images)
        else:
            log(f"peer: {peer_info['reason']}")
    forward_times, forward_first = _time_interleaved(forward, repeats, warmup, "forward", log)

    train_times, train_first = {}, {}
    if train_step:
        train = {label: (lambda m=m: m.train_on_batch(images, labels)) for label, m in models.items()}
        train_times, train_first = _time_interleaved(train, repeats, warmup, "train step", log)

    # -- results --------------------------------------------------------------
    warnings = []
    unbuilt = {label: _unbuilt_layers(m) for label, m in models.items()}
    if any(unbuilt.values()):
        names = sorted({name for names in unbuilt.values() for name in names})
        affected = [label for label, names in unbuilt.items() if names]
        warnings.append(
            f"Layer(s) {names} of {affected} are still unbuilt after the warm-up calls. Keras then "
            "rebuilds the model on every call: `predict_on_batch` on jax runs one eager (uncompiled) "
            "forward pass per call, and `train_on_batch` traces the model symbolically per call on "
            "every backend, so those timings include a large per-call overhead that has nothing to "
            "do with the compiled model. Build (or mark built) these layers in the backbone's build()."
        )
        log("WARNING: " + warnings[-1])
    dense_flops = flops(dense)
    for name in probes:  # a probe sample times PROBE_CALLS calls
        forward_times[f"probe {name}"] = [t / PROBE_CALLS for t in forward_times[f"probe {name}"]]
        forward_first[f"probe {name}"] /= PROBE_CALLS
    forward_stats = {k: _stats(v, batch_size) for k, v in forward_times.items()}
    train_stats = {k: _stats(v, batch_size) for k, v in train_times.items()}
    capacity_of = {mone_label(c): c for c in capacities}
    rows = []
    for label, model in models.items():
        count = flops(model)
        ratio = dense_flops.total / count.total
        row = {
            "label": label,
            "kind": "dense" if label == DENSE else "mone",
            "capacity": float(model.capacity),
            "jit_compile": bool(model.jit_compile),
            "parameters": int(model.count_params()),
            "gmacs": count.gmacs,
            "macs_breakdown": dict(count.breakdown),
            "flop_ratio": ratio,
        }
        if label != DENSE:
            tokens, dropped = model.backbone.expert_token_counts()
            row["expert_capacities"] = [float(c) for c in model.backbone.expert_capacities]
            row["tokens_per_expert"] = list(tokens)
            row["dropped_tokens"] = dropped
        for mode, stats, first in (("forward", forward_stats, forward_first), ("train", train_stats, train_first)):
            if label not in stats:
                row[mode] = None
                continue
            entry = dict(stats[label], first_call_s=first[label])
            entry["speedup"] = stats[DENSE]["median_s"] / entry["median_s"]
            entry["flop_ratio"] = ratio
            entry["efficiency"] = entry["speedup"] / ratio
            row[mode] = entry
        row["routing"] = None
        if label != DENSE:
            c = capacity_of[label]
            embed = forward_stats["probe embedding"]["median_s"]
            route = forward_stats[f"probe route {c:g}"]["median_s"]
            restore = forward_stats[f"probe route+restore {c:g}"]["median_s"]
            mone_forward = forward_stats[label]["median_s"]
            row["routing"] = {
                "embedding_probe_s": embed,
                "routing_probe_s": route,
                "routing_restore_probe_s": restore,
                "router_epr_s": route - embed,
                "router_epr_restore_s": restore - embed,
                "share_of_forward": (route - embed) / mone_forward,
                "share_of_forward_with_restore": (restore - embed) / mone_forward,
                "routers_in_model": len(model.backbone.router_positions),
            }
        row["unbuilt_layers"] = unbuilt[label]
        row["memory"] = None
        rows.append(row)

    if memory:
        for (label, preset, kwargs), row in zip(specs, rows):
            modes = ("forward", "train") if train_step else ("forward",)
            row["memory"] = {
                mode: _measure_memory(label, preset, kwargs, mode, batch_size, seed, memory_calls, log)
                for mode in modes
            }

    if peer_model is not None:
        peer_info["forward"] = dict(forward_stats[PEER], first_call_s=forward_first[PEER])
        peer_info["jit_compile"] = bool(peer_model.jit_compile)
        peer_info["dense_over_peer_time"] = forward_stats[DENSE]["median_s"] / forward_stats[PEER]["median_s"]
        peer_info["note"] = (
            "keras_hub times its backbone (no head); the keras_mone dense time includes pooling and "
            "the classification head (< 0.1% of the MACs at ImageNet sizes)."
        )

    result = {
        "schema": SCHEMA_VERSION,
        "title": f"dense vs MoNE speed ({family})",
        "command": command,
        "settings": settings,
        "environment": environment,
        "model_config": model_config,
        "models": rows,
        "routing_probe": {
            name: dict(forward_stats[f"probe {name}"], first_call_s=forward_first[f"probe {name}"])
            for name in probes
        },
        "peer": peer_info,
        "warnings": warnings,
        "files": {},
    }
    if output_dir is not None:
        result["files"] = write_outputs(result, output_dir)
        log(f"wrote {', '.join(result['files'].values())}")
    return _jsonable(result)


# ---------------------------------------------------------------------------
# outputs
# ---------------------------------------------------------------------------


def _main(argv):
    """``python -m keras_mone.analysis.benchmark --memory-probe SPEC``: one memory subprocess."""
    if len(argv) == 2 and argv[0] == "--memory-probe":
        _memory_child(json.loads(argv[1]))
        return 0
    print("Run benchmarks with `keras-mone bench` (see `keras-mone bench --help`).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
