"""Markdown tables of ``keras-mone bench`` results: the summary (one line per MoNE model,
path and precision, as in issue 40), the timing tables per path, and the timm peer."""

MODE_TITLES = {
    "device_forward": ("**Forward pass**, device input", "forward, device input"),
    "compiled_forward": ("**Forward pass**, device input, `torch.compile`", "forward, device input, torch.compile"),
    "cudagraph_forward": ("**Forward pass**, device input, `torch.compile(mode=\"reduce-overhead\")` (CUDA graphs)",
                          "forward, device input, torch.compile + CUDA graphs"),
    "forward": ("**Forward pass**, host input (`predict_on_batch` on numpy)", "forward, host input"),
    "device_train": ("**Training step**, device input (forward, backward, AdamW)", "train step, device input"),
    "train": ("**Training step**, host input (`train_on_batch` on numpy: forward, backward, AdamW)",
              "train step, host input"),
}
"""Section heading and summary label of every timing field, in report order."""

DEVICE_CALLS = {  # how the device-input path calls the model, per backend
    "jax": "`jax.jit` over `model.stateless_call`, the batch placed once with `jax.device_put`, "
    "blocked with `block_until_ready`; the train step adds the gradient and "
    "`optimizer.stateless_apply`, its state carried between calls",
    "torch": "the model called eagerly under `torch.no_grad()` on a torch tensor on Keras' device, "
    "`torch.cuda.synchronize()` after each call on CUDA; the train step is `model.train_step`",
    "tensorflow": "`tf.function` with the model's resolved jit_compile on a tensor on the default device, "
    "read back to wait; the train step is `model.train_step` in it",
}


def ms(seconds):
    """Milliseconds with 3 significant figures ("-" for None)."""
    if seconds is None:
        return "-"
    value = seconds * 1e3
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def table(header, rows):
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _multi_precision(result):
    return len(result["settings"].get("precisions") or ["float32"]) > 1


def device_memory(row, phase):
    """Peak device MiB of a row's device-input step ("<= x": an upper bound; "n/a": no statistics)."""
    peak = ((row.get("device_memory") or {}).get(phase) or {}).get("device")
    if not peak:
        return "n/a"
    return ("" if peak["exact"] else "<= ") + f"{peak['peak_mib']:.0f}"


def _compiled_memory(row, phase):
    value = ((row.get("device_memory") or {}).get(phase) or {}).get("compiled_mib")
    return "-" if value is None else f"{value:.1f}"


def timing_table(result, mode):
    """One path's table: a line per model (and precision), with device memory on device-input paths."""
    multi, phase = _multi_precision(result), "train" if "train" in mode else "forward"
    memory = mode in ("device_forward", "device_train")
    xla = memory and result["environment"]["backend"] == "jax"
    header = [
        "model", *(["precision"] if multi else []), "GMACs", "FLOP ratio", "median ms/batch", "IQR ms",
        "min-max ms", "images/s", "speedup vs dense", "efficiency",
        *(["peak device MiB"] if memory else []), *(["XLA temp+out MiB"] if xla else []),
    ]
    rows = []
    for r in result["models"]:
        t = r.get(mode)
        if not t:
            continue
        rows.append([
            r["label"], *([r.get("precision", "-")] if multi else []), f"{r['gmacs']:.3g}",
            f"{r['flop_ratio']:.2f}x", ms(t["median_s"]), ms(t["iqr_s"]), f"{ms(t['min_s'])}-{ms(t['max_s'])}",
            f"{t['images_per_s']:.1f}", f"{t['speedup']:.2f}x", f"{t['efficiency']:.2f}",
            *([device_memory(r, phase)] if memory else []), *([_compiled_memory(r, phase)] if xla else []),
        ])
    return table(header, rows)


def timing_sections(result):
    """The summary, then one table per timed path."""
    lines = summary_section(result)
    for mode, (title, _) in MODE_TITLES.items():
        if not any(r.get(mode) for r in result["models"]):
            continue
        lines += [title, "", timing_table(result, mode), ""]
    return lines


def summary_section(result):
    """Dense vs each MoNE model per path and precision: the issue-40 table."""
    lines = _summary_lines(result)
    if not lines:
        return []
    header = ["model", "path", "precision", "batch", "dense ms", "MoNE ms", "speed-up", "FLOP ratio",
              "efficiency", "peak device MiB dense / MoNE"]
    return ["**Summary** (medians; speed-up = dense / MoNE time, same path and precision)", "",
            table(header, lines), ""]


def _summary_lines(result):
    s, rows = result["settings"], result["models"]
    dense = {r.get("precision"): r for r in rows if r["kind"] == "dense"}
    lines = []
    for mode, (_, path) in MODE_TITLES.items():
        phase = "train" if "train" in mode else "forward"
        for r in rows:
            d = dense.get(r.get("precision"))
            if r["kind"] == "dense" or not r.get(mode) or not d or not d.get(mode):
                continue
            t = r[mode]
            lines.append([
                r["label"], path, r.get("precision", "-"), s["batch_size"], ms(d[mode]["median_s"]),
                ms(t["median_s"]), f"{t['speedup']:.2f}x", f"{r['flop_ratio']:.2f}", f"{t['efficiency']:.2f}",
                f"{device_memory(d, phase)} / {device_memory(r, phase)}" if mode.startswith("device") else "-",
            ])
    return lines


def timm_section(result):
    """The timm peer: per precision its time and keras_mone dense's time over it, or why it is absent."""
    timm = result.get("timm") or {}
    runs = timm.get("runs") or {}
    if not (timm.get("available") and runs):
        return [f"**timm peer**: none ({timm.get('reason', 'not run')}).", ""]
    rows = []
    for precision, run in runs.items():
        f = run["forward"]
        peak = (run.get("memory") or {}).get("device")
        rows.append([
            precision, ms(f["median_s"]), f"{f['images_per_s']:.1f}", run["compared_with"].replace("_", " "),
            f"{run['dense_over_timm_time']:.2f}",
            "n/a" if not peak else f"{peak['peak_mib']:.0f}",
        ])
    return [
        f"**timm peer**: timm {timm.get('version', '?')} `{timm.get('model')}` (random weights, the dense "
        "model's geometry) in plain PyTorch on the same batch, already on the device, under "
        "`torch.inference_mode()` (`torch.autocast` for mixed precisions"
        + ("; float32 matmuls in TF32, as XLA's default on a GPU" if timm.get("tf32") else "")
        + "), timed in the same interleaved rounds; dense / timm < 1: keras_mone faster",
        "",
        table(["precision", "timm ms/batch", "images/s", "keras_mone dense path", "keras_mone dense / timm time",
               "timm peak device MiB"], rows),
        "",
    ]


def _non_default_forms(env):
    """``", explicit attention"`` / ``", fused MLP"`` where a run took a form other than the
    platform's default (``layers.platform_forms``), else ``""``."""
    forms = []
    if (env.get("environment_variables") or {}).get("KERAS_MONE_ATTENTION"):
        forms.append(f"{env.get('attention_form')} attention")
    if env.get("mlp_form", "plain") != "plain":
        forms.append(f"{env['mlp_form']} MLP")
    variables = env.get("environment_variables") or {}
    for variable, key, label in (("KERAS_MONE_GELU", "gelu_form", "GELU"), ("KERAS_MONE_PATCHES", "patches_form",
                                 "patches"), ("KERAS_MONE_ORDER", "order_form", "slices"),
                                 ("KERAS_MONE_NORMS", "norms_form", "LayerNorms"),
                                 ("KERAS_MONE_STATISTICS", "statistics_form", "LayerNorm statistics"),
                                 ("KERAS_MONE_LAYOUT", "layout_form", "token groups"),
                                 ("KERAS_MONE_RESIDUALS", "residuals_form", "residual writes")):
        if variables.get(variable):
            forms.append(f"{env.get(key)} {label}")
    return "".join(f", {form}" for form in forms)


def combined_table(results):
    """One table over several ``run_benchmark`` results (``bench/gpu.sh``): per run, path, precision
    and MoNE model the dense and MoNE medians, speed-up and FLOP ratio; then each timm comparison."""
    rows, peers = [], []
    for result in results:
        s, env = result["settings"], result["environment"]
        cfg, family = result["model_config"], "ViViT-FE" if s.get("family") == "vivit" else "ViT"
        clip = f"{cfg['num_frames']}x" if cfg.get("num_frames") else ""
        name = f"{family}-{s['variant']} {clip}{cfg['image_size'][0]}x{cfg['image_size'][1]}"
        forms = _non_default_forms(env)
        for line in _summary_lines(result):
            label, path, precision, batch, dense, mone, speedup, ratio, _, memory = line
            rows.append([f"{name}, {label.replace('mone ', '')}", f"{env['backend']}, {precision}", path + forms, batch,
                         dense, mone, speedup, ratio, memory])
        timm = result.get("timm") or {}
        for precision, run in (timm.get("runs") or {}).items():
            dense = next(r for r in result["models"] if r["kind"] == "dense" and r.get("precision") == precision)
            peers.append([f"{name}, timm {timm.get('model')}", f"torch, {precision}", s["batch_size"],
                          ms(dense[run["compared_with"]]["median_s"]), ms(run["forward"]["median_s"]),
                          f"{run['dense_over_timm_time']:.2f}"])
    devices = sorted({r["environment"].get("device", {}).get("name", "?") for r in results})
    lines = [f"Device: {', '.join(devices)}.", "",
             table(["model", "backend, precision", "path", "batch", "dense ms", "MoNE ms", "speed-up", "FLOP ratio",
                    "peak device MiB dense / MoNE"], rows), ""]
    if peers:
        lines += [table(["peer", "backend, precision", "batch", "keras_mone dense ms", "timm ms",
                         "dense / timm time"], peers), ""]
    else:
        reasons = sorted({(r.get("timm") or {}).get("reason", "not run") for r in results})
        lines += [f"timm peer: none ({'; '.join(reasons)}).", ""]
    return "\n".join(lines)
