"""One precision of ``keras-mone bench``: build the dense and MoNE models under a dtype
policy, time every path of them interleaved (device input, host input, routing probes,
keras-hub and timm peers) and turn the timings into result rows."""

import time

import keras

from keras_mone.analysis.flops import flops
from keras_mone.bench import torch_compile
from keras_mone.bench.device import (
    Measured,
    build_timm_peer,
    device_batch,
    forward_step,
    precision_policy,
    timm_step,
    train_step as device_train_step,
)
from keras_mone.bench.measure import _measure_memory, _stats, _time_interleaved
from keras_mone.bench.models import (
    DENSE,
    PEER,
    PROBE_CALLS,
    TIMM,
    _batch,
    _build,
    _build_peer,
    _compile,
    _EmbeddingProbe,
    _probe,
    _RoutingProbe,
    _unbuilt_layers,
    mone_label,
)

MODES = {
    "forward": ("forward", "{}"),
    "train": ("train", "{}"),
    "device_forward": ("forward", "device {}"),
    "compiled_forward": ("forward", torch_compile.PATHS["default"] + " {}"),
    "cudagraph_forward": ("forward", torch_compile.PATHS["reduce-overhead"] + " {}"),
    "device_train": ("train", "device {}"),
}
"""Row timing fields: ``(phase, timing key pattern)``; plain keys are the host-input path."""


def _run_precision(specs, precision, s, first, cache, log):
    """Builds the models in ``precision`` and times all their paths interleaved; returns that part's results."""
    keras.utils.set_random_seed(s["seed"])
    models = {}
    with precision_policy(precision):
        for label, preset, kwargs in specs:
            start = time.perf_counter()
            models[label] = _compile(_build(preset, kwargs), s["train_step"])
            log(f"built {label} ({precision}) from {preset} ({time.perf_counter() - start:.1f} s)")
    dense = models[DENSE]
    images, labels = _batch(dense.backbone, dense.num_classes, s["batch_size"], s["seed"])
    skips = torch_compile.cudagraph_skips()  # inductor falls back from CUDA graphs as it compiles
    calls, measured = _timed_calls(models, images, labels, s)
    probes = _routing_probes(models, s["capacities"]) if first and s["routing_probes"] else {}
    for name, probe in probes.items():
        calls["forward"][f"probe {name}"] = lambda p=probe: [p.predict_on_batch(images) for _ in range(PROBE_CALLS)]
    peer_model, peer_info = _keras_hub_peer(dense, s, first, log)
    if peer_model is not None:
        calls["forward"][PEER] = lambda: peer_model.predict_on_batch(images)
    timm = _timm_call(dense, images, precision, s, cache, log)
    if timm is not None:
        calls["forward"][TIMM] = measured["forward"][TIMM] = timm
    stats = {}
    for phase, functions in calls.items():
        if functions:
            times, firsts = _time_interleaved(functions, s["repeats"], s["warmup"], f"{phase} {precision}", log)
            for key in functions:
                scale = PROBE_CALLS if key.startswith("probe ") else 1  # a probe sample times PROBE_CALLS calls
                stats.setdefault(phase, {})[key] = dict(
                    _stats([t / scale for t in times[key]], s["batch_size"]), first_call_s=firsts[key] / scale
                )
    rows, warnings = _rows(models, precision, stats, measured, log)
    skipped = torch_compile.cudagraph_skips() - skips
    if skipped and "reduce-overhead" in s["torch_compile"]:
        warnings.append(
            f"torch.compile(mode='reduce-overhead') ran without CUDA graphs {skipped} time(s) ({precision}; "
            "always on a CPU, which has none; on a GPU inductor's log says why): those 'CUDA graphs' rows "
            "time compiled forwards that launch every kernel."
        )
    if peer_model is not None:
        dense_forward = stats["forward"].get(DENSE) or stats["forward"][f"device {DENSE}"]
        peer_info.update(
            forward=stats["forward"][PEER], jit_compile=bool(peer_model.jit_compile),
            dense_over_peer_time=dense_forward["median_s"] / stats["forward"][PEER]["median_s"],
            note="keras_hub times its backbone (no head); the keras_mone dense time includes pooling and "
            "the classification head (< 0.1% of the MACs at ImageNet sizes).",
        )
    return dict(
        rows=rows, warnings=warnings, peer=peer_info, timm=_timm_run(stats, measured, timm),
        model_config=_model_config(models, specs) if first else None,
        routing_probe={name: stats["forward"][f"probe {name}"] for name in probes},
    )


def _timed_calls(models, images, labels, s):
    """``({"forward": {key: fn}, "train": {key: fn}}, {phase: {key: Measured}})``.

    Device steps come first, in ascending FLOPs, so that their warm-up calls
    (which measure peak device memory) meet jax's never-reset peak mark rising."""
    calls, measured = {"forward": {}, "train": {}}, {"forward": {}, "train": {}}
    if s["device_input"]:
        x, y = device_batch(images, labels)
        for label in sorted(models, key=lambda name: flops(models[name]).total):
            steps = [("forward", "device", lambda m=models[label]: forward_step(m, x))]
            if keras.backend.backend() == "torch":
                steps += [
                    ("forward", torch_compile.PATHS[mode], lambda m=models[label], mode=mode: forward_step(m, x, mode))
                    for mode in s["torch_compile"]
                ]
            if s["train_step"]:
                steps.append(("train", "device", lambda m=models[label]: device_train_step(m, x, y)))
            for phase, path, make in steps:
                calls[phase][f"{path} {label}"] = measured[phase][f"{path} {label}"] = Measured(make())
    if s["host_input"]:
        for label, model in models.items():
            calls["forward"][label] = lambda m=model: m.predict_on_batch(images)
            if s["train_step"]:
                calls["train"][label] = lambda m=model: m.train_on_batch(images, labels)
    return calls, measured


def _routing_probes(models, capacities):
    backbone = models[DENSE].backbone
    probes = {"embedding": _probe(_EmbeddingProbe(backbone, name="embedding_probe"))}
    for capacity in capacities:
        mone_backbone = models[mone_label(capacity)].backbone
        probes[f"route {capacity:g}"] = _probe(_RoutingProbe(mone_backbone, name="routing_probe"))
        probes[f"route+restore {capacity:g}"] = _probe(
            _RoutingProbe(mone_backbone, restore=True, name="routing_restore_probe")
        )
    return probes


def _keras_hub_peer(dense, s, first, log):
    if not s["peer"]:
        return None, {"available": False, "reason": "not requested (peer=False)"}
    if s["family"] != "vit":
        return None, {"available": False, "reason": f"no keras_hub peer for family {s['family']!r}"}
    if not first:
        return None, {"available": False, "reason": "timed at the first precision only"}
    model, info = _build_peer(dense.backbone)
    if model is None:
        log(f"peer: {info['reason']}")
    else:
        model.compile(jit_compile="auto")
    return model, info


def _timm_call(dense, images, precision, s, cache, log):
    """timm's forward as a ``Measured`` step (its model built once per run), or None; info in ``cache``."""
    if "timm_info" not in cache:
        if not s["timm_peer"]:
            cache["timm_info"] = {"available": False, "reason": "not requested (timm_peer=False)"}
        elif s["family"] != "vit":
            cache["timm_info"] = {"available": False, "reason": f"no timm peer for family {s['family']!r}"}
        else:
            cache["timm_model"], cache["timm_info"] = build_timm_peer(dense.backbone, dense.num_classes, dense.pooling)
            if cache["timm_model"] is None:
                log(f"timm: {cache['timm_info']['reason']}")
    if cache.get("timm_model") is None:
        return None
    tf32 = keras.backend.backend() == "jax"  # XLA's float32 GPU matmuls are TF32; torch's own setting stands
    cache["timm_info"]["tf32"] = tf32 or None
    return Measured(timm_step(cache["timm_model"], images, precision, tf32=tf32 or None), backend="torch")


def _timm_run(stats, measured, timm):
    if timm is None:
        return None
    own = stats["forward"][TIMM]
    mode = "device_forward" if f"device {DENSE}" in stats["forward"] else "forward"
    dense = stats["forward"][MODES[mode][1].format(DENSE)]
    return {"forward": own, "memory": timm.memory, "compared_with": mode,
            "dense_over_timm_time": dense["median_s"] / own["median_s"]}


def _rows(models, precision, stats, measured, log):
    """One result row per model of one precision, and the warnings about them."""
    warnings, unbuilt = [], {label: _unbuilt_layers(m) for label, m in models.items()}
    if any(unbuilt.values()):
        names = sorted({name for names in unbuilt.values() for name in names})
        affected = [label for label, names in unbuilt.items() if names]
        warnings.append(
            f"Layer(s) {names} of {affected} ({precision}) are still unbuilt after the warm-up calls. Keras then "
            "rebuilds the model on every call: `predict_on_batch` on jax runs one eager (uncompiled) "
            "forward pass per call, and `train_on_batch` traces the model symbolically per call on "
            "every backend, so those timings include a large per-call overhead that has nothing to "
            "do with the compiled model. Build (or mark built) these layers in the backbone's build()."
        )
        log("WARNING: " + warnings[-1])
    dense_total = flops(models[DENSE]).total
    rows = []
    for label, model in models.items():
        count = flops(model)
        ratio = dense_total / count.total
        row = {
            "label": label, "kind": "dense" if label == DENSE else "mone", "precision": precision,
            "dtype_policy": model.dtype_policy.name,
            "capacity": float(model.capacity), "jit_compile": bool(model.jit_compile),
            "parameters": int(model.count_params()), "gmacs": count.gmacs,
            "macs_breakdown": dict(count.breakdown), "flop_ratio": ratio,
        }
        if label != DENSE:
            tokens, dropped = model.backbone.expert_token_counts()
            row["expert_capacities"] = [float(c) for c in model.backbone.expert_capacities]
            row["tokens_per_expert"] = list(tokens)
            row["dropped_tokens"] = dropped
        for mode, (phase, key) in MODES.items():
            own, dense = (stats.get(phase, {}).get(key.format(name)) for name in (label, DENSE))
            speedup = None if own is None else dense["median_s"] / own["median_s"]
            row[mode] = None if own is None else dict(own, speedup=speedup, flop_ratio=ratio,
                                                      efficiency=speedup / ratio)
        memory = {phase: steps[f"device {label}"].memory for phase, steps in measured.items()
                  if f"device {label}" in steps}
        row["device_memory"] = memory or None
        row["routing"] = _routing(label, model, stats.get("forward", {}))
        row["unbuilt_layers"] = unbuilt[label]
        row["memory"] = None
        rows.append(row)
    return rows, warnings


def _routing(label, model, forward):
    """The routing share of a MoNE row from the probes' medians, or None."""
    c = model.capacity
    keys = ("probe embedding", f"probe route {c:g}", f"probe route+restore {c:g}")
    reference = forward.get(label) or forward.get(f"device {label}")
    if label == DENSE or not all(k in forward for k in keys) or reference is None:
        return None
    embed, route, restore = (forward[k]["median_s"] for k in keys)
    return {
        "embedding_probe_s": embed,
        "routing_probe_s": route,
        "routing_restore_probe_s": restore,
        "router_epr_s": route - embed,
        "router_epr_restore_s": restore - embed,
        "share_of_forward": (route - embed) / reference["median_s"],
        "share_of_forward_with_restore": (restore - embed) / reference["median_s"],
        "routers_in_model": len(model.backbone.router_positions),
    }


def _model_config(models, specs):
    dense = models[DENSE]
    backbone, mone = dense.backbone, models[specs[1][0]].backbone
    return dict(
        image_size=list(backbone.image_size), patch_size=backbone.patch_size, hidden_dim=backbone.hidden_dim,
        depth=backbone.depth, num_heads=backbone.num_heads, mlp_dim=backbone.mlp_dim,
        num_channels=backbone.num_channels, use_class_token=backbone.use_class_token,
        num_tokens=backbone.num_tokens, num_classes=dense.num_classes, pooling=dense.pooling,
        num_experts=mone.num_experts, expert_widths=list(mone.expert_widths),
        capacity_method=mone.capacity_method, router_positions=list(mone.router_positions),
        router_type=mone.router_type, presets=[specs[0][1], specs[1][1]],
        num_frames=getattr(backbone, "num_frames", None), tubelet_size=getattr(backbone, "tubelet_size", None),
    )


def _add_rss_memory(specs, rows, s, log):
    """Peak RSS per model, mode and precision, each in a subprocess (``memory=True``)."""
    by_label = {label: (preset, kwargs) for label, preset, kwargs in specs}
    modes = ("forward", "train") if s["train_step"] else ("forward",)
    for row in rows:
        preset, kwargs = by_label[row["label"]]
        row["memory"] = {
            mode: _measure_memory(row["label"], preset, kwargs, mode, s["batch_size"], s["seed"],
                                  s["memory_calls"], log, row["precision"])
            for mode in modes
        }
