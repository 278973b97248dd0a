"""Benchmark measurements: interleaved timing and its statistics, peak memory in
subprocesses, the machine's environment, and the command that reproduces a run."""

import datetime
import gc
import importlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import keras
import numpy as np

from keras_mone.layers import platform_forms
from keras_mone.version import __version__ as KERAS_MONE_VERSION
from keras_mone.bench.device import cpu_model, device_info, precision_policy
from keras_mone.bench.memory import allocation_measure, peak_allocation_bytes
from keras_mone.bench.models import _batch, _build, _compile
from keras_mone.bench.torch_compile import compile_modes

def _stats(times, batch_size):
    times = [float(t) for t in times]
    median = statistics.median(times)
    q25, q75 = (float(q) for q in np.percentile(times, [25, 75]))
    return {
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "q25_s": q25,
        "q75_s": q75,
        "iqr_s": q75 - q25,
        "relative_iqr": (q75 - q25) / median if median > 0 else None,
        "latency_ms": median * 1e3,
        "images_per_s": batch_size / median if median > 0 else None,
        "times_s": times,
    }


def _time_interleaved(functions, repeats, warmup, phase, log):
    """Times every callable in ``functions`` round-robin over ``repeats``.

    Every callable first runs ``warmup`` times (the first call, timed
    separately as ``first_call_s``, compiles). Each repeat then times each
    callable once; the starting callable rotates from repeat to repeat.
    Returns ``({label: [seconds]}, {label: first_call_seconds})``.
    """
    labels = list(functions)
    first = {}
    for index, label in enumerate(labels):
        start = time.perf_counter()
        functions[label]()
        first[label] = time.perf_counter() - start
        for _ in range(warmup - 1):
            functions[label]()
        log(f"{phase}: warm-up {index + 1}/{len(labels)} {label} (first call {first[label]:.2f} s)")
    times = {label: [] for label in labels}
    for repeat in range(repeats):
        shift = repeat % len(labels)
        start_round = time.perf_counter()
        for label in labels[shift:] + labels[:shift]:
            start = time.perf_counter()
            functions[label]()
            times[label].append(time.perf_counter() - start)
        log(f"{phase}: repeat {repeat + 1}/{repeats} ({time.perf_counter() - start_round:.2f} s)")
    return times, first


# ---------------------------------------------------------------------------
# memory (subprocesses)
# ---------------------------------------------------------------------------
def _current_rss_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes():
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _reset_peak_rss():
    """Resets the kernel's peak-RSS mark (``VmHWM``, Linux >= 4.0); True if it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _vm_hwm_bytes() is not None
    except OSError:
        return False


def _vm_hwm_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_child(spec):
    """Runs in the subprocess: builds one model, runs it, prints its memory as JSON.

    The peak-RSS mark is reset (Linux) after the build and again after the
    first call, which compiles, so that the remaining calls give the
    steady-state peak as well.
    """
    keras.utils.set_random_seed(spec["seed"])
    train = spec["mode"] == "train"
    with precision_policy(spec.get("precision")):
        model = _compile(_build(spec["preset"], spec["kwargs"]), train)
    images, labels = _batch(model.backbone, model.num_classes, spec["batch_size"], spec["seed"])

    def step():
        if train:
            model.train_on_batch(images, labels)
        else:
            model.predict_on_batch(images)

    gc.collect()
    baseline = _current_rss_bytes()
    peak_before = _peak_rss_bytes()
    # The peak mark is reset after the build and after the first (compiling) call.
    # After a reset, VmHWM is the peak since the reset; ru_maxrss is not a clean
    # substitute there, since it also keeps the marks of threads that have exited.
    reset = _reset_peak_rss()
    peak = _vm_hwm_bytes if reset else _peak_rss_bytes
    step()
    peak_first = peak()
    steady = reset and spec["calls"] > 1 and _reset_peak_rss()
    for _ in range(spec["calls"] - 1):
        step()
    peak_rest = peak()
    allocated = peak_allocation_bytes(model, images, labels, train)  # after the RSS marks: it compiles again
    print(json.dumps({
        "allocation_peak_bytes": allocated,
        "allocation_measure": allocation_measure(),
        "baseline_bytes": baseline,
        "peak_before_bytes": peak_before,
        "peak_bytes": max(peak_first, peak_rest),
        "peak_mark_reset": reset,
        "steady_peak_bytes": peak_rest if steady else None,
        "ru_maxrss_bytes": _peak_rss_bytes(),
    }))


def _measure_memory(label, preset, kwargs, mode, batch_size, seed, calls, log, precision=None):
    spec = dict(preset=preset, kwargs=kwargs, mode=mode, batch_size=batch_size, seed=seed, calls=calls,
                precision=precision)
    command = [sys.executable, "-m", "keras_mone.bench.benchmark", "--memory-probe", json.dumps(spec)]
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    start = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    lines = [line for line in process.stdout.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        tail = (process.stderr or process.stdout).strip().splitlines()[-5:]
        log(f"memory: {label} {mode} {precision or ''} FAILED ({elapsed:.1f} s)")
        return {"error": f"subprocess exited with {process.returncode}: " + " | ".join(tail)}
    data = json.loads(lines[-1])
    delta = max(data["peak_bytes"] - data["baseline_bytes"], 0)
    out = {
        "baseline_rss_mb": data["baseline_bytes"] / 2**20,
        "peak_rss_mb": data["peak_bytes"] / 2**20,
        "peak_minus_baseline_mb": delta / 2**20,
        # without a reset of the peak mark, a run that never exceeded the peak of the
        # imports only gives a lower bound
        "exact": bool(data.get("peak_mark_reset")) or data["peak_bytes"] > data["peak_before_bytes"],
        # peak over the calls after the first (compiling) one
        "steady_peak_minus_baseline_mb": (
            None
            if data.get("steady_peak_bytes") is None
            else max(data["steady_peak_bytes"] - data["baseline_bytes"], 0) / 2**20
        ),
        "calls": calls,
        "allocation_peak_mb": None if data.get("allocation_peak_bytes") is None else data["allocation_peak_bytes"] / 2**20,
        "allocation_measure": data.get("allocation_measure"),
    }
    log(f"memory: {label} {mode} {precision or ''} +{out['peak_minus_baseline_mb']:.0f} MB ({elapsed:.1f} s)")
    return out


# ---------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------
def _environment():
    backend = keras.backend.backend()
    versions = {"keras": keras.__version__, "keras_mone": KERAS_MONE_VERSION, "numpy": np.__version__}
    module = {"jax": "jax", "tensorflow": "tensorflow", "torch": "torch"}.get(backend)
    if module:
        try:
            versions[module] = importlib.import_module(module).__version__
        except Exception:
            pass
    env_vars = {
        k: os.environ[k]
        for k in ("XLA_FLAGS", "OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "OPENBLAS_CORETYPE",
                  *platform_forms.VARIABLES)
        if k in os.environ
    }
    return {
        "backend": backend,
        "device": device_info(backend),
        "versions": versions,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": cpu_model(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "environment_variables": env_vars,
        **platform_forms.current_forms(),  # attention_form, mlp_form, gelu_form, patches_form, order_form
    }


def reproduce_command(settings, backend=None):
    """The ``keras-mone bench`` command line that reruns a benchmark with ``settings``."""
    backend = backend or keras.backend.backend()
    env = f"KERAS_BACKEND={backend}"
    if os.environ.get("XLA_FLAGS") and backend in ("jax", "tensorflow"):
        env = f"XLA_FLAGS={shlex.quote(os.environ['XLA_FLAGS'])} " + env
    parts = [
        "keras-mone", "bench",
        "--variant", settings["variant"],
        *(["--family", settings["family"]] if settings.get("family", "vit") != "vit" else []),
        "--capacities", ",".join(f"{c:g}" for c in settings["capacities"]),
        "--batch-size", str(settings["batch_size"]),
        "--image-size", str(settings["image_size"]),
        "--repeats", str(settings["repeats"]),
        "--warmup", str(settings["warmup"]),
        "--seed", str(settings["seed"]),
    ]
    if settings.get("precisions", ["float32"]) != ["float32"]:
        parts += ["--precision", ",".join(settings["precisions"])]
    for key, value in (settings.get("model_overrides") or {}).items():
        parts += ["--model-override", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    if not settings["train_step"]:
        parts.append("--no-train-step")
    if settings["memory"]:
        parts.append("--memory")
        if settings.get("memory_calls", 3) != 3:
            parts += ["--memory-calls", str(settings["memory_calls"])]
    for key, flag in (("device_input", "--no-device-input"), ("host_input", "--no-host-input"),
                      ("routing_probes", "--no-routing-probes"), ("timm_peer", "--no-timm")):
        if not settings.get(key, True):
            parts.append(flag)
    modes = compile_modes(settings.get("torch_compile"))
    if modes == ["default"]:
        parts.append("--torch-compile")
    elif modes:
        parts += ["--torch-compile", ",".join(modes)]
    if not settings["peer"]:
        parts.append("--no-peer")
    if settings.get("output_dir"):
        parts += ["--output", settings["output_dir"]]
    return env + " " + " ".join(shlex.quote(p) for p in parts)
