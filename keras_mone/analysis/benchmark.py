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
  patch embedding + router + Expert Preferred Routing + the token gathers of
  ``MoNEViTBackbone._regroup``, minus a probe running the patch embedding only,
  over the MoNE forward median (a second probe also restores the token order,
  as the model does after the last block);
- optionally peak memory (``memory=True``): one subprocess per model and mode,
  peak RSS minus the RSS after imports and model build;
- a peer reference: ``keras_hub.models.ViTBackbone`` of the same size, when
  ``keras_hub`` is importable.

The result is a JSON-serialisable dict that includes the command line that
reproduces it; ``format_markdown(result)`` renders it, and ``output_dir``
receives ``benchmark.json``, ``benchmark.md`` and ``speedup_vs_flops.png``.
The same benchmark runs from the shell as ``keras-mone bench``.
"""

import datetime
import gc
import importlib
import inspect
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

from keras_mone.analysis.flops import flops
from keras_mone.layers.config import config_argument_names
from keras_mone.models.mone_vit_backbone import MoNEViTBackbone, _TokenGroups
from keras_mone.models.variants import decode_variant
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.version import __version__ as KERAS_MONE_VERSION

DEFAULT_CAPACITIES = (0.2, 0.3, 0.5, 0.75, 1.0)
SCHEMA_VERSION = 1
DENSE = "dense"
PROBE_CALLS = 5
"""Calls per timing sample of the (cheap) routing probes; their times are per call."""
PEER = "keras_hub ViTBackbone"

# Backbone arguments that only MoNE models accept: model_overrides with these
# keys go to the MoNE models only.
_MONE_ONLY = tuple(
    sorted(set(config_argument_names(MoNEViTBackbone)) - set(config_argument_names(ViTBackbone)))
)


def mone_label(capacity):
    """Row label of the MoNE model at effective capacity ``capacity``."""
    return f"mone e_c={capacity:g}"


# ---------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------
FAMILIES = {"vit": "vit_{}", "vivit": "vivit_fe_{}"}
"""Model families the bench times: dense preset name pattern (MoNE: ``mone_`` + it)."""


def _preset_names(variant, family="vit"):
    """Dense and MoNE preset names of ``variant`` in ``family``, plus size overrides.

    A variant without presets (e.g. "H/14") builds from the family's B/16
    presets with the variant's size table entry as overrides.
    """
    from keras_mone.presets import list_presets

    if family not in FAMILIES:
        raise ValueError(f"`family` must be one of {sorted(FAMILIES)}, got {family!r}.")
    size = decode_variant(variant)  # validates the variant
    key = str(variant).replace("/", "").lower()
    dense = FAMILIES[family].format(key)
    available = set(list_presets())
    if dense in available and "mone_" + dense in available:
        return dense, "mone_" + dense, {}
    dense = FAMILIES[family].format("b16")
    return dense, "mone_" + dense, size


def _model_specs(variant, capacities, image_size, model_overrides, family="vit"):
    """``[(label, preset, kwargs)]``: the dense model, then one MoNE model per capacity."""
    overrides = dict(model_overrides or {})
    if "capacity" in overrides:
        raise ValueError("Pass MoNE capacities with `capacities`, not in `model_overrides`.")
    dense_preset, mone_preset, size = _preset_names(variant, family)
    common = {**size, "image_size": image_size}
    common.update({k: v for k, v in overrides.items() if k not in _MONE_ONLY})
    mone_only = {k: v for k, v in overrides.items() if k in _MONE_ONLY}
    specs = [(DENSE, dense_preset, dict(common))]
    for capacity in capacities:
        specs.append((mone_label(capacity), mone_preset, {**common, **mone_only, "capacity": capacity}))
    return specs


def _build(preset, kwargs):
    from keras_mone.presets import from_preset

    return from_preset(preset, load_weights=False, **kwargs)


def _compile(model, train):
    if train:
        model.compile(
            optimizer=keras.optimizers.AdamW(1e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile="auto",
        )
    else:
        model.compile(jit_compile="auto")
    return model


def _batch(backbone, num_classes, batch_size, seed):
    rng = np.random.default_rng(seed)
    shape = (batch_size, *backbone.input_shape_per_example)
    images = rng.uniform(-1.0, 1.0, shape).astype("float32")
    labels = rng.integers(0, num_classes, (batch_size,)).astype("int32")
    return images, labels


# ---------------------------------------------------------------------------
# routing probes
# ---------------------------------------------------------------------------
class _EmbeddingProbe(keras.Model):
    """Patch embedding of a backbone, alone (the baseline of the routing probes)."""

    def __init__(self, backbone, **kwargs):
        super().__init__(**kwargs)
        self.patch_embedding = backbone.patch_embedding
        self.built = True

    def call(self, images):
        return _checksum([self.patch_embedding(images)])


class _RoutingProbe(keras.Model):
    """Patch embedding + first router + EPR grouping + token gathers of a MoNE backbone.

    It runs the backbone's own ``_regroup`` (router probabilities, EPR
    ``routing.group``, gathers of tokens and gates, the token order). With
    ``restore=True`` it also concatenates the groups and puts the tokens back
    in their original order, as the backbone does after its last block. Both
    probes return a per-example checksum of what they computed.
    """

    def __init__(self, backbone, restore=False, **kwargs):
        super().__init__(**kwargs)
        self.source = _Untracked(backbone)  # not tracked: the probe holds no block weights
        self.patch_embedding = backbone.patch_embedding
        self.router = backbone.routers[0]
        self.restore = restore
        self.built = True

    def call(self, images):
        backbone = self.source.value
        tokens = self.patch_embedding(images)
        probs = self.router(tokens)
        # Exactly the model's own routing step (EPR grouping, token and gate gathers).
        state = backbone._regroup(_TokenGroups(tokens, backbone.hidden_dim), probs)
        if self.restore:
            return _checksum([state.restored()])
        dropped = [state.dropped] if state.dropped is not None else []
        gates = list(state.gates or [])
        order = [] if state.order is None else [keras.ops.cast(state.order, "float32")]
        return _checksum([*state.groups, *dropped, *gates, *order])


def _checksum(tensors):
    """One number per example that depends on every element of ``tensors``.

    The probes return this rather than token features so that copying their
    outputs to numpy costs next to nothing; the gathers still have to run.
    """
    total = None
    for x in tensors:
        part = keras.ops.sum(keras.ops.reshape(keras.ops.cast(x, "float32"), (keras.ops.shape(x)[0], -1)), axis=1)
        total = part if total is None else total + part
    return total


class _Untracked:
    """Holds a layer without Keras tracking it (and its weights) as a sub-layer."""

    def __init__(self, value):
        self.value = value


def _unbuilt_layers(model):
    """Paths of the layers of ``model`` (itself included) whose ``built`` is False."""
    return [getattr(layer, "path", None) or layer.name for layer in model._flatten_layers() if not layer.built]


def _probe(probe):
    probe.compile(jit_compile="auto")
    return probe


# ---------------------------------------------------------------------------
# peer (keras_hub)
# ---------------------------------------------------------------------------
def _build_peer(backbone):
    """``(model, info)``: keras_hub's ViTBackbone of the same size, or ``(None, info)``."""
    try:
        keras_hub = importlib.import_module("keras_hub")
    except Exception as error:  # ImportError, or a broken install
        return None, {
            "available": False,
            "reason": f"keras_hub is not importable ({type(error).__name__}: {error}); "
            "install keras-hub to compare with it.",
        }
    info = {"available": True, "package": "keras_hub", "version": getattr(keras_hub, "__version__", "?")}
    height, width = backbone.image_size
    config = dict(
        image_shape=(height, width, backbone.num_channels),
        patch_size=backbone.patch_size,
        num_layers=backbone.depth,
        num_heads=backbone.num_heads,
        hidden_dim=backbone.hidden_dim,
        mlp_dim=backbone.mlp_dim,
    )
    try:
        cls = keras_hub.models.ViTBackbone
        accepted = inspect.signature(cls.__init__).parameters
        optional = {
            "dropout_rate": 0.0,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "layer_norm_epsilon": backbone.layer_norm_epsilon,
            "use_class_token": backbone.use_class_token,
        }
        config.update({k: v for k, v in optional.items() if k in accepted})
        model = cls(**config)
    except Exception as error:
        info.update(available=False, reason=f"keras_hub ViTBackbone could not be built: {error}")
        return None, info
    info["config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    info["parameters"] = int(model.count_params())
    return model, info


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------
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
    model = _build(spec["preset"], spec["kwargs"])
    train = spec["mode"] == "train"
    _compile(model, train)
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
    print(json.dumps({
        "baseline_bytes": baseline,
        "peak_before_bytes": peak_before,
        "peak_bytes": max(peak_first, peak_rest),
        "peak_mark_reset": reset,
        "steady_peak_bytes": peak_rest if steady else None,
        "ru_maxrss_bytes": _peak_rss_bytes(),
    }))


def _measure_memory(label, preset, kwargs, mode, batch_size, seed, calls, log):
    spec = dict(preset=preset, kwargs=kwargs, mode=mode, batch_size=batch_size, seed=seed, calls=calls)
    command = [sys.executable, "-m", "keras_mone.analysis.benchmark", "--memory-probe", json.dumps(spec)]
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    start = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    lines = [line for line in process.stdout.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        tail = (process.stderr or process.stdout).strip().splitlines()[-5:]
        log(f"memory: {label} {mode} FAILED ({elapsed:.1f} s)")
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
    }
    log(f"memory: {label} {mode} +{out['peak_minus_baseline_mb']:.0f} MB ({elapsed:.1f} s)")
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
        for k in ("XLA_FLAGS", "OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "OPENBLAS_CORETYPE")
        if k in os.environ
    }
    return {
        "backend": backend,
        "versions": versions,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "environment_variables": env_vars,
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
    for key, value in (settings.get("model_overrides") or {}).items():
        parts += ["--model-override", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    if not settings["train_step"]:
        parts.append("--no-train-step")
    if settings["memory"]:
        parts.append("--memory")
        if settings.get("memory_calls", 3) != 3:
            parts += ["--memory-calls", str(settings["memory_calls"])]
    if not settings["peer"]:
        parts.append("--no-peer")
    if settings.get("output_dir"):
        parts += ["--output", settings["output_dir"]]
    return env + " " + " ".join(shlex.quote(p) for p in parts)


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
        memory_rows = []
        for r in result["models"]:
            for mode, m in (r.get("memory") or {}).items():
                if "error" in m:
                    memory_rows.append([r["label"], mode, "-", "-", f"error: {m['error'][:80]}", "-"])
                    continue
                steady = m.get("steady_peak_minus_baseline_mb")
                memory_rows.append([
                    r["label"], mode, f"{m['baseline_rss_mb']:.0f}", f"{m['peak_rss_mb']:.0f}",
                    f"{m['peak_minus_baseline_mb']:.0f}" + ("" if m["exact"] else " (lower bound)"),
                    "-" if steady is None else f"{steady:.0f}",
                ])
        lines += [
            f"**Peak memory** (one subprocess per model and mode, {s.get('memory_calls', '?')} calls; baseline = "
            "RSS after imports and model build; peak = peak RSS over all calls, compilation included "
            "(VmHWM after a reset of the mark; ru_maxrss where that is not possible); "
            "steady = peak over the calls after the first; the peak mark is reset before each)",
            "",
            _table(
                ["model", "mode", "RSS after build MB", "peak RSS MB", "peak - baseline MB", "steady peak - baseline MB"],
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
    """``"key=value"`` -> ``(key, value)`` with JSON values (ints, floats, lists, true/false), else strings."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"`--model-override` must look like KEY=VALUE, got {text!r}.")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _main(argv):
    if len(argv) == 2 and argv[0] == "--memory-probe":
        _memory_child(json.loads(argv[1]))
        return 0
    from keras_mone.cli.main import main

    return main(["bench", *argv])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
