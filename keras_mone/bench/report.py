"""Benchmark results as files: JSON, markdown tables, the speed-up vs FLOP-ratio plot,
the BENCHMARKS.md appendix; and the ``--model-override`` parser."""

import json
import os

import numpy as np

from keras_mone.bench.models import PROBE_CALLS
from keras_mone.bench.tables import DEVICE_CALLS, MODE_TITLES, ms as _ms, table as _table, timing_sections, timm_section
from keras_mone.overrides import parse_assignment

def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if np.isfinite(value) else None
    return value


def write_outputs(result, output_dir):
    """Writes ``benchmark.json``, ``benchmark.md`` and ``speedup_vs_flops.png``; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    files = {
        "json": os.path.join(output_dir, "benchmark.json"),
        "markdown": os.path.join(output_dir, "benchmark.md"),
        "plot": os.path.join(output_dir, "speedup_vs_flops.png"),
    }
    result = dict(result, files=files)
    with open(files["json"], "w") as f:
        json.dump(_jsonable(result), f, indent=2, allow_nan=False)
        f.write("\n")
    with open(files["markdown"], "w") as f:
        f.write(format_markdown(result))
    plot_speedup_vs_flops(result, files["plot"])
    return files


def plot_speedup_vs_flops(result, path):
    """Measured speedup against FLOP ratio (forward and train step) with the ideal y = x."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5, 4.5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    extent = [1.0]
    precisions = result["settings"].get("precisions") or ["float32"]
    styles = {"device_forward": ("o", "tab:blue"), "compiled_forward": ("^", "tab:purple"),
              "cudagraph_forward": ("<", "tab:brown"),
              "forward": ("D", "tab:green"), "device_train": ("s", "tab:orange"), "train": ("v", "tab:red")}
    for mode, (marker, color) in styles.items():
        for precision, linestyle in zip(precisions, ("-", ":", "-.")):
            points = sorted(
                (r["flop_ratio"], r[mode]["speedup"], r["capacity"])
                for r in result["models"]
                if r.get(mode) and r["kind"] != "dense" and r.get("precision", precision) == precision
            )
            if not points:
                continue
            x, y, _ = zip(*points)
            extent += list(x) + list(y)
            name = MODE_TITLES[mode][1] + (f", {precision}" if len(precisions) > 1 else "")
            axes.plot(x, y, marker=marker, linestyle=linestyle, color=color, label=name)
            for xi, yi, ci in points:
                axes.annotate(
                    f"e_c={ci:g}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color
                )
    axes.plot([1.0], [1.0], marker="*", markersize=10, linestyle="none", color="black", label="dense ViT")
    top = max(extent) * 1.1
    axes.plot([0, top], [0, top], linestyle="--", color="gray", label="ideal (speedup = FLOP ratio)")
    axes.set_xlim(0, top)
    axes.set_ylim(0, top)
    axes.set_xlabel("FLOP ratio dense / model")
    axes.set_ylabel("measured speedup (dense time / model time)")
    settings, env, cfg = result["settings"], result["environment"], result["model_config"]
    axes.set_title(
        f"MoNE vs dense ViT {settings['variant']}"
        + (" (overridden)" if settings.get("model_overrides") else "")
        + f": D={cfg['hidden_dim']}, depth {cfg['depth']}, {cfg['num_tokens']} tokens, "
        f"batch {settings['batch_size']}, {env['backend']} on {(env.get('device') or {}).get('name', '?')}",
        fontsize=8,
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
    return path


def format_markdown(result):
    """Markdown report of a ``run_benchmark`` result (title, device, command, context, tables)."""
    lines = _header(result) + [f"> **Warning:** {w}\n" for w in result.get("warnings", [])]
    lines += timing_sections(result) + _routing_section(result) + _memory_section(result)
    lines += _peer_section(result) + timm_section(result)
    return "\n".join(lines)


def _header(result):
    s, env, cfg = result["settings"], result["environment"], result["model_config"]
    machine, device = env["machine"], env.get("device") or {"name": "?"}
    height, width = cfg["image_size"]
    overrides = s.get("model_overrides") or {}
    size = f"{s['variant']}" + (f" with overrides {overrides}" if overrides else "")
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    env_vars = ", ".join(f"{k}={v}" for k, v in env.get("environment_variables", {}).items())
    jit = sorted({str(r["jit_compile"]) for r in result["models"]})
    names = "ViViT-FE" if s.get("family") == "vivit" else "ViT"
    clip = f"{cfg['num_frames']}x" if cfg.get("num_frames") else ""
    per_frame = f" per frame index (tubelet {cfg['tubelet_size']})" if cfg.get("num_frames") else ""
    precisions = ", ".join(s.get("precisions") or ["float32"])
    return [
        f"### Dense {names} vs MoNE-{names}, {size} at {clip}{height}x{width}, batch {s['batch_size']}, "
        f"backend {env['backend']} on {device['name']}",
        "",
        f"`{result['command']}`",
        "",
        f"Device: {device['name']}"
        + (f" ({device['count']} x {device['platform']})" if device.get("platform", "cpu") != "cpu" else "")
        + f"; precision {precisions}."
        + (f" Device input: {DEVICE_CALLS[env['backend']]}." if s.get("device_input", True) else ""),
        f"{env['date']}; {versions}; {machine['platform']} ({machine['processor']}, "
        f"{machine['cpu_count']} CPU cores, python {machine['python']})"
        + (f"; {env_vars}" if env_vars else "")
        + ".",
        f"{cfg['num_tokens']} tokens{per_frame}, D={cfg['hidden_dim']}, depth {cfg['depth']}, "
        f"{cfg['num_experts']} experts of widths {cfg['expert_widths']}, routers at {cfg['router_positions']}; "
        f"jit_compile resolved to {'/'.join(jit)}; attention {env.get('attention_form', 'as the backend chose')}, "
        f"MLP {env.get('mlp_form', 'plain')}, GELU {env.get('gelu_form', 'library')}, "
        f"patches by {patches_words(env)}, weight slices {env.get('order_form', 'tied')}. "
        f"{s['repeats']} interleaved round-robin repeats after "
        f"{s['warmup']} warm-up call(s) per model; speedup = dense median / model median, "
        "efficiency = speedup / FLOP ratio (1.0 = FLOP savings fully realised). Peak device memory: one "
        "call after the compiling one, above the bytes already in use ('n/a': the device keeps no "
        "statistics, e.g. the CPU; '<=': jax's peak mark, which never resets, did not rise).",
        "",
    ]


def patches_words(env):
    """How a report names the patch embedding's form: ``"conv"``, or ``"matmul (training
    steps: conv)"`` where a run's training steps took another form than its forwards
    (``platform_forms.patches_form``); reports written before the training form was
    recorded name the one form they have."""
    inference = env.get("patches_form", "conv")
    training = env.get("training_patches_form", inference)
    return inference if training == inference else f"{inference} (training steps: {training})"


def _routing_section(result):
    routing_rows = []
    for r in result["models"]:
        g = r.get("routing")
        if not g:
            continue
        routing_rows.append([
            r["label"], str(r.get("tokens_per_expert")), _ms(g["embedding_probe_s"]), _ms(g["routing_probe_s"]),
            _ms(g["router_epr_s"]), f"{g['share_of_forward']:.1%}", _ms(g["router_epr_restore_s"]),
            f"{g['share_of_forward_with_restore']:.1%}",
        ])
    if not routing_rows:
        return []
    return [
        "**Routing overhead** (compiled probes: patch embedding + router + EPR + token gathers, minus "
        "patch embedding alone; share of the MoNE forward median; '+ restore' also undoes the token "
        f"permutation as after the last block; medians of {PROBE_CALLS}-call averages, so differences "
        "within the noise can come out negative)",
        "",
        _table(
            [
                "model", "tokens per expert", "embedding ms", "embedding+routing ms", "router+EPR ms",
                "share of forward", "router+EPR+restore ms", "share with restore",
            ],
            routing_rows,
        ),
        "",
    ]


def _memory_section(result):
    s = result["settings"]
    if not s.get("memory"):
        return []
    memory_rows, measure = [], None
    for r in result["models"]:
        label = r["label"] + (f" ({r['precision']})" if len(s.get("precisions") or [1]) > 1 else "")
        for mode, m in (r.get("memory") or {}).items():
            if "error" in m:
                memory_rows.append([label, mode, "-", "-", f"error: {m['error'][:80]}", "-", "-"])
                continue
            steady = m.get("steady_peak_minus_baseline_mb")
            memory_rows.append([
                label, mode, f"{m['baseline_rss_mb']:.0f}", f"{m['peak_rss_mb']:.0f}",
                f"{m['peak_minus_baseline_mb']:.0f}" + ("" if m["exact"] else " (lower bound)"),
                "-" if steady is None else f"{steady:.0f}",
                "-" if m.get("allocation_peak_mb") is None else f"{m['allocation_peak_mb']:.1f}",
            ])
            measure = m.get("allocation_measure") or measure
    return [
        f"**Peak memory** (one subprocess per model and mode, {s.get('memory_calls', '?')} calls; baseline = "
        "RSS after imports and model build; peak = peak RSS over all calls, compilation included "
        "(VmHWM after a reset of the mark; ru_maxrss where that is not possible); "
        "steady = peak over the calls after the first; the peak mark is reset before each; "
        f"allocated = {measure or 'none on this backend (no CPU allocator statistics): peak RSS is the measure'}, "
        "train mode on jax: forward + backward without the optimizer update)",
        "",
        _table(
            ["model", "mode", "RSS after build MB", "peak RSS MB", "peak - baseline MB", "steady peak - baseline MB",
             "allocated MiB"],
            memory_rows,
        ),
        "",
    ]


def _peer_section(result):
    peer = result.get("peer") or {}
    if not (peer.get("available") and peer.get("forward")):
        return [f"**Peer reference**: none ({peer.get('reason', 'not run')}).", ""]
    f = peer["forward"]
    return [
        f"**Peer reference**: keras_hub {peer.get('version', '?')} `ViTBackbone` of the same size: "
        f"median {_ms(f['median_s'])} ms/batch (IQR {_ms(f['iqr_s'])} ms, {f['images_per_s']:.1f} images/s); "
        f"keras_mone dense (host input) / keras_hub time = {peer['dense_over_peer_time']:.2f} "
        "(< 1: keras_mone faster). " + peer.get("note", ""),
        "",
    ]


def append_to_benchmarks(result, path):
    """Appends ``format_markdown(result)`` (command, backend, date, versions, machine) to ``path``."""
    text = format_markdown(result)
    prefix = ""
    if os.path.exists(path) and os.path.getsize(path):
        with open(path) as f:
            prefix = "" if f.read().endswith("\n\n") else "\n"
    with open(path, "a") as f:
        f.write(prefix + text + ("" if text.endswith("\n") else "\n"))
    return path


def parse_model_override(text):
    """``"key=value"`` -> ``(key, value)``, values as every keras_mone override
    (``keras_mone.overrides``: TOML values, else strings)."""
    return parse_assignment(text, "`--model-override`")
