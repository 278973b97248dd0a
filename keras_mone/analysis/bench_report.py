"""Benchmark results as files: JSON, markdown tables, the speed-up vs FLOP-ratio plot,
the BENCHMARKS.md appendix; and the ``--model-override`` parser."""

import json
import os

import numpy as np

from keras_mone.analysis.bench_models import PROBE_CALLS
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
    for mode, marker, color in (("forward", "o", "tab:blue"), ("train", "s", "tab:orange")):
        points = sorted(
            (r["flop_ratio"], r[mode]["speedup"], r["capacity"])
            for r in result["models"]
            if r.get(mode) and r["kind"] != "dense"
        )
        if not points:
            continue
        x, y, _ = zip(*points)
        extent += list(x) + list(y)
        name = "forward (predict_on_batch)" if mode == "forward" else "train step (train_on_batch)"
        axes.plot(x, y, marker=marker, linestyle="-", color=color, label=name)
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
        f"batch {settings['batch_size']}, {env['backend']}",
        fontsize=8,
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
    return path


def _ms(seconds):
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    if abs(ms) >= 100:
        return f"{ms:.0f}"
    if abs(ms) >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _timing_table(result, mode):
    header = [
        "model", "GMACs", "FLOP ratio", "median ms/batch", "IQR ms", "min-max ms",
        "images/s", "speedup vs dense", "efficiency",
    ]
    rows = []
    for r in result["models"]:
        t = r.get(mode)
        if not t:
            continue
        rows.append([
            r["label"], f"{r['gmacs']:.3g}", f"{r['flop_ratio']:.2f}x", _ms(t["median_s"]), _ms(t["iqr_s"]),
            f"{_ms(t['min_s'])}-{_ms(t['max_s'])}", f"{t['images_per_s']:.1f}", f"{t['speedup']:.2f}x",
            f"{t['efficiency']:.2f}",
        ])
    return _table(header, rows)


def format_markdown(result):
    """Markdown report of a ``run_benchmark`` result (title, command, context, tables)."""
    s, env = result["settings"], result["environment"]
    cfg = result["model_config"]
    machine = env["machine"]
    height, width = cfg["image_size"]
    overrides = s.get("model_overrides") or {}
    size = f"{s['variant']}" + (f" with overrides {overrides}" if overrides else "")
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    env_vars = ", ".join(f"{k}={v}" for k, v in env.get("environment_variables", {}).items())
    jit = sorted({str(r["jit_compile"]) for r in result["models"]})
    names = "ViViT-FE" if s.get("family") == "vivit" else "ViT"
    clip = f"{cfg['num_frames']}x" if cfg.get("num_frames") else ""
    per_frame = f" per frame index (tubelet {cfg['tubelet_size']})" if cfg.get("num_frames") else ""
    lines = [
        f"### Dense {names} vs MoNE-{names}, {size} at {clip}{height}x{width}, batch {s['batch_size']}, "
        f"backend {env['backend']}",
        "",
        f"`{result['command']}`",
        "",
        f"{env['date']}; {versions}; {machine['platform']} ({machine['processor']}, "
        f"{machine['cpu_count']} CPU cores, python {machine['python']})"
        + (f"; {env_vars}" if env_vars else "")
        + ".",
        f"{cfg['num_tokens']} tokens{per_frame}, D={cfg['hidden_dim']}, depth {cfg['depth']}, "
        f"{cfg['num_experts']} experts of widths {cfg['expert_widths']}, routers at {cfg['router_positions']}; "
        f"jit_compile resolved to {'/'.join(jit)}. {s['repeats']} interleaved round-robin repeats after "
        f"{s['warmup']} warm-up call(s) per model; speedup = dense median / model median, "
        "efficiency = speedup / FLOP ratio (1.0 = FLOP savings fully realised).",
        "",
        *[f"> **Warning:** {w}\n" for w in result.get("warnings", [])],
        "**Forward pass** (`predict_on_batch`)",
        "",
        _timing_table(result, "forward"),
        "",
    ]
    if any(r.get("train") for r in result["models"]):
        lines += [
            "**Training step** (`train_on_batch`: forward, backward, AdamW; FLOP ratio as forward)",
            "",
            _timing_table(result, "train"),
            "",
        ]
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
    if routing_rows:
        lines += [
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
    if s.get("memory"):
        memory_rows, measure = [], None
        for r in result["models"]:
            for mode, m in (r.get("memory") or {}).items():
                if "error" in m:
                    memory_rows.append([r["label"], mode, "-", "-", f"error: {m['error'][:80]}", "-", "-"])
                    continue
                steady = m.get("steady_peak_minus_baseline_mb")
                memory_rows.append([
                    r["label"], mode, f"{m['baseline_rss_mb']:.0f}", f"{m['peak_rss_mb']:.0f}",
                    f"{m['peak_minus_baseline_mb']:.0f}" + ("" if m["exact"] else " (lower bound)"),
                    "-" if steady is None else f"{steady:.0f}",
                    "-" if m.get("allocation_peak_mb") is None else f"{m['allocation_peak_mb']:.1f}",
                ])
                measure = m.get("allocation_measure") or measure
        lines += [
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
    peer = result.get("peer") or {}
    if peer.get("available") and peer.get("forward"):
        f = peer["forward"]
        lines += [
            f"**Peer reference**: keras_hub {peer.get('version', '?')} `ViTBackbone` of the same size: "
            f"median {_ms(f['median_s'])} ms/batch (IQR {_ms(f['iqr_s'])} ms, {f['images_per_s']:.1f} images/s); "
            f"keras_mone dense / keras_hub time = {peer['dense_over_peer_time']:.2f} "
            "(< 1: keras_mone faster). " + peer.get("note", ""),
            "",
        ]
    else:
        lines += [f"**Peer reference**: none ({peer.get('reason', 'not run')}).", ""]
    return "\n".join(lines)


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
