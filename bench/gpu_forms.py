"""Which forms turn MoNE's FLOP savings into GPU time (issue 40): one jax process, many forms.

A form is a set of the switches of ``layers.platform_forms``, which a layer reads when a
call is traced, so one process compiles every form of the same two models:

    present        the platform's defaults (on jax's GPU: fused attention, plain MLP, tied
                   slices, rational GELU, patches by matmul at inference, by convolution in
                   training steps, one-pass LayerNorm statistics)
    free           $KERAS_MONE_ORDER=free: no ties (``nested_dense.after``) between the
                   weight slices, token groups and the tensors they follow
    fused_mlp      $KERAS_MONE_MLP=fused: each nested group's MLP half as one Pallas kernel
    mlp_kernel     $KERAS_MONE_MLP=mlp_kernel: each nested group's MLP alone as one Pallas kernel
                   (its LayerNorm and residual XLA's)
    explicit       $KERAS_MONE_ATTENTION=explicit: the CPU's batched matmuls
    rational_gelu  $KERAS_MONE_GELU=rational: exact GELU as one cheap elementwise pass
    library_gelu   $KERAS_MONE_GELU=library: jax.nn.gelu (the CPU's form)
    patch_matmul   $KERAS_MONE_PATCHES=matmul: the patch embedding as one matmul
    patch_conv     $KERAS_MONE_PATCHES=conv: Keras' strided convolution (the CPU's form)
    joint_norms    $KERAS_MONE_NORMS=joint: a block's LayerNorms over its groups joined
    keras_statistics
                   $KERAS_MONE_STATISTICS=keras: Keras' LayerNorm statistics (two
                   reductions; the GPU's default before 2026-11-28)
    one_pass_statistics
                   $KERAS_MONE_STATISTICS=one_pass: each LayerNorm's mean and mean square
                   in one reduction (jax's GPU default)
    fused_statistics
                   $KERAS_MONE_STATISTICS=fused: two-pass statistics written so that XLA
                   makes each LayerNorm one Triton kernel
    kernel_statistics
                   $KERAS_MONE_STATISTICS=kernel: each LayerNorm's mean and rstd by one Pallas
                   kernel (``kernels.row_statistics``), for the grouped kernels' prologues: no
                   rsqrt pass of XLA's after the reduction (both models)
    packed         $KERAS_MONE_LAYOUT=packed: a block's groups in one token-major tensor
    fused_residuals
                   $KERAS_MONE_RESIDUALS=fused: the groups' residuals never written apart
                   (the program before the block barrier: less traffic, a larger heap)
    grouped_kernel $KERAS_MONE_PROJECTIONS=grouped_kernel: each nested projection of a block
                   one Pallas launch over all its token groups, bias, GELU, residual and gate in
                   the kernels' epilogues (``layers.grouped_block``)
    flash_attention
                   $KERAS_MONE_ATTENTION=flash: attention as one Pallas kernel that never writes
                   the scores, in float32 too (``kernels.flash_attention``; both models)
    half_block_residuals
                   $KERAS_MONE_RESIDUALS=half_block: the groups' residuals also written after
                   attention (XLA's heap as dense's; more traffic)

joined with "+" (``free+fused_mlp``). Per batch size the dense and the MoNE classifier
are built once (random weights, one precision); each form's forward on a batch already
on the device is compiled (``jax.jit`` over ``stateless_call``) and timed interleaved
with the dense model's in the same form (medians; the speed-up is dense / MoNE). With
``--profile`` the last batch size's programs are traced (``bench.kernel_profile``):
device time by kernel kind and the top kernels. ``--train-batch`` adds training steps
(AdamW) of ``--train-forms``; ``--timm`` times timm's ViT at the same batch and precision;
``--gelu-approximate`` builds both models with the tanh GELU of the AugReg presets (which
cuBLASLt takes into fc1 under ``XLA_FLAGS="--xla_gpu_enable_triton_gemm=false
--xla_gpu_enable_cublaslt=true"``).

    KERAS_BACKEND=jax python bench/gpu_forms.py --batch-sizes 64,256 --profile --output runs/gpu_forms
    # a CPU smoke test with a tiny model:
    KERAS_BACKEND=jax python bench/gpu_forms.py --tiny --batch-sizes 2 --forms present,free --profile
"""

import argparse
import contextlib
import gzip
import json
import os
import statistics
import sys
import time

import jax
import keras
import numpy as np

from keras_mone.analysis import flop_ratio
from keras_mone.bench.device import (
    build_timm_peer, device_batch, device_info, forward_step, precision_policy, timm_step, train_step,
)
from keras_mone.bench.gpu_program import MATMUL_PRECISIONS, matmul_precision_note
from keras_mone.bench.kernel_profile import format_kernel_tables, kernel_table, trace_calls
from keras_mone.bench.models import _batch, _build, _model_specs
from keras_mone.layers import platform_forms

SWITCHES = {
    "present": {},
    "free": {platform_forms.ORDER_ENV: "free"},
    "fused_mlp": {platform_forms.MLP_ENV: "fused"},
    "mlp_kernel": {platform_forms.MLP_ENV: "mlp_kernel"},
    "explicit": {platform_forms.ATTENTION_ENV: "explicit"},
    "rational_gelu": {platform_forms.GELU_ENV: "rational"},
    "library_gelu": {platform_forms.GELU_ENV: "library"},
    "patch_matmul": {platform_forms.PATCHES_ENV: "matmul"},
    "patch_conv": {platform_forms.PATCHES_ENV: "conv"},
    "joint_norms": {platform_forms.NORMS_ENV: "joint"},
    "keras_statistics": {platform_forms.STATISTICS_ENV: "keras"},
    "one_pass_statistics": {platform_forms.STATISTICS_ENV: "one_pass"},
    "fused_statistics": {platform_forms.STATISTICS_ENV: "fused"},
    "kernel_statistics": {platform_forms.STATISTICS_ENV: "kernel"},
    "packed": {platform_forms.LAYOUT_ENV: "packed"},
    "fused_residuals": {platform_forms.RESIDUALS_ENV: "fused"},
    "half_block_residuals": {platform_forms.RESIDUALS_ENV: "half_block"},
    "grouped_kernel": {platform_forms.PROJECTIONS_ENV: "grouped_kernel"},
    "grouped_kernel_all": {platform_forms.PROJECTIONS_ENV: "grouped_kernel_all"},
    "flash_attention": {platform_forms.ATTENTION_ENV: "flash"},
}
DENSE_SWITCHES = (platform_forms.ATTENTION_ENV, platform_forms.GELU_ENV, platform_forms.PATCHES_ENV,
                  platform_forms.STATISTICS_ENV)
"""The switches a dense model reads (the others act on nested token groups only)."""
TANH_GELU_NOTE = ", tanh GELU (`gelu_approximate`, as the AugReg presets)"
"""What a report says of ``--gelu-approximate`` (here and in ``bench/gpu_program.py``)."""
TINY = dict(patch_size=8, hidden_dim=64, depth=2, num_heads=4, mlp_dim=128)
TILE_VARIABLES = ("XLA_FLAGS", "KERAS_MONE_MLP_TILES", "KERAS_MONE_PROJECTION_TILES")
"""The environment a report names when set (what else changes the programs it times)."""


def form_settings(form):
    """The environment of a form name such as ``free+fused_mlp``."""
    settings = {}
    for part in form.split("+"):
        if part not in SWITCHES:
            raise ValueError(f"Unknown form part {part!r} in {form!r}; parts: {sorted(SWITCHES)}.")
        settings.update(SWITCHES[part])
    return settings


@contextlib.contextmanager
def form_environment(form):
    """The switches of ``form`` set (the others unset) while a call is traced."""
    names = platform_forms.VARIABLES
    saved = {name: os.environ.pop(name, None) for name in names}
    os.environ.update(form_settings(form))
    try:
        yield
    finally:
        for name in names:
            os.environ.pop(name, None)
            if saved[name] is not None:
                os.environ[name] = saved[name]


def compiled(make_step, form):
    """A ``_Step`` of ``form``, traced and compiled now; returns ``(step, compile seconds)``."""
    started = time.perf_counter()
    with form_environment(form):
        step = make_step().prepare()
        step()
    return step, time.perf_counter() - started


def interleaved_ms(steps, repeats):
    """``{label: median ms}`` of the steps, timed round-robin (start rotating)."""
    labels, times = list(steps), {label: [] for label in steps}
    for repeat in range(repeats):
        shift = repeat % len(labels)
        for label in labels[shift:] + labels[:shift]:
            started = time.perf_counter()
            steps[label]()
            times[label].append(time.perf_counter() - started)
    return {label: 1e3 * statistics.median(t) for label, t in times.items()}


def _dense_key(form):
    """The dense model ignores the MoNE-only switches: one dense program per setting of the others
    (and of the projections where ``grouped_kernel_all`` runs its full-width blocks through the kernels)."""
    settings = form_settings(form)
    key = [f"{name.split('_')[-1].lower()}={settings[name]}" for name in DENSE_SWITCHES if name in settings]
    if settings.get(platform_forms.PROJECTIONS_ENV) == "grouped_kernel_all":
        key.append("projections=grouped_kernel_all")
    return "+".join(key)


def _names(text):
    """The comma-separated form names in ``text``."""
    return [name.strip() for name in text.split(",") if name.strip()]


def timed_pair(kind, batch_size, form, make_step, models, dense_steps, args, notes, log):
    """``make_step(model)`` of the dense and the MoNE model in ``form``, compiled (the dense
    one once per ``_dense_key``, kept in ``dense_steps``) and timed interleaved. Returns
    ``(row, dense step, MoNE step)``, or ``None`` with a note: one form failing (a kernel the
    card rejects) ends only its row."""
    dense, mone = models
    key = _dense_key(form)
    try:
        if key not in dense_steps:
            dense_steps[key], seconds = compiled(lambda: make_step(dense), form)
            log(f"{kind}, batch {batch_size}: dense ({key or 'default forms'}) compiled in {seconds:.1f} s")
        step, seconds = compiled(lambda: make_step(mone), form)
        log(f"{kind}, batch {batch_size}: MoNE {form} compiled in {seconds:.1f} s")
        ms = interleaved_ms({"dense": dense_steps[key], "mone": step}, args.repeats)
    except Exception as error:
        notes.append(f"{kind}, batch {batch_size}, {form}: {type(error).__name__}: {str(error)[:300]}")
        log(notes[-1])
        return None
    log(f"{kind}, batch {batch_size}, {form}: dense {ms['dense']:.2f} ms, MoNE {ms['mone']:.2f} ms, "
        f"{ms['dense'] / ms['mone']:.2f}x")
    return (kind, batch_size, form, ms["dense"], ms["mone"], seconds), dense_steps[key], step


def _random_heads(models, seed):
    """Random weights in each classifier's head, which ViTs start at zero: with them every logit
    would be the zero bias and ``_compare_logits`` would compare nothing (timings unchanged)."""
    rng = np.random.default_rng(seed)
    for model in models:
        for weight in model.head.weights:
            if not np.any(np.asarray(weight)):
                weight.assign((0.02 * rng.standard_normal(weight.shape)).astype(weight.dtype))


def _compare_logits(logits, first, form, first_form, batch_size, notes, model="MoNE"):
    """Notes how far ``model``'s logits in ``form`` lie from those of the batch's first form (every
    form computes the same function: a kernel that a card miscompiles shows here); returns the
    first form's logits."""
    logits = np.asarray(logits, np.float32)
    if first is None:
        return logits
    error = float(np.abs(logits - first).max() / max(1.0, float(np.abs(first).max())))
    notes.append(f"forward, batch {batch_size}, {form}: {model}'s logits within {error:.1e} of {first_form}'s "
                 "(largest difference over max(1, largest logit))")
    return first


def profile_pair(labels_and_steps, args, profiles, notes, log):
    """Traces each ``(label, step)`` not yet in ``profiles`` (``kernel_profile``) and, with
    ``--output``, writes its optimised HLO beside the report; a failure leaves a note."""
    try:
        for label, traced in labels_and_steps:
            if label in profiles:
                continue
            profiles[label] = kernel_table(trace_calls(traced, args.profile_calls), args.profile_calls)
            if args.output:  # the optimised HLO: what each profiled op name computes
                os.makedirs(args.output, exist_ok=True)  # the first profile comes before the first report
                name = label.replace(" ", "_").replace("+", "_").replace("=", "_")
                with gzip.open(os.path.join(args.output, f"hlo_{name}.txt.gz"), "wt") as f:
                    f.write(traced.executable.as_text())
    except Exception as error:  # the timings stand without a profile
        notes.append(f"profile of {labels_and_steps[-1][0]}: {type(error).__name__}: {str(error)[:300]}")
        log(notes[-1])


def run(args):
    """Times every form (``--matmul-precision``: jax's precision for every trace)."""
    with jax.default_matmul_precision(args.matmul_precision):
        return _run_forms(args)


def _run_forms(args):
    log = (lambda message: print(f"[gpu_forms] {message}", file=sys.stderr, flush=True))
    forms, train_forms = _names(args.forms), _names(args.train_forms)
    for form in forms + train_forms:
        form_settings(form)  # fails early on a bad name
    overrides = dict(TINY) if args.tiny else {}
    if args.gelu_approximate:
        overrides["gelu_approximate"] = True
    specs = _model_specs(args.variant, [args.capacity], args.image_size, overrides, args.family)
    (_, dense_preset, dense_kwargs), (_, mone_preset, mone_kwargs) = specs
    rows, profiles, notes = [], {}, []
    with precision_policy(args.precision):
        models = dense, mone = _build(dense_preset, dense_kwargs), _build(mone_preset, mone_kwargs)
    ratio = flop_ratio(dense.backbone, mone.backbone)
    _random_heads(models, args.seed)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]

    def save():
        report(args, rows, profiles, notes, ratio)  # after every row: a run cut short keeps its figures

    for batch_size in batch_sizes:
        images, labels = _batch(dense.backbone, dense.num_classes, batch_size, args.seed)
        x, _ = device_batch(images, labels)
        dense_steps, first_logits, first_dense, dense_keys = {}, None, None, set()
        for form in forms:
            timed = timed_pair("forward", batch_size, form, lambda model: forward_step(model, x), models,
                               dense_steps, args, notes, log)
            if timed is not None:
                rows.append(timed[0])
                first_logits = _compare_logits(timed[2](), first_logits, form, forms[0], batch_size, notes)
                if _dense_key(form) not in dense_keys:  # a dense program of its own (e.g. grouped_kernel_all)
                    dense_keys.add(_dense_key(form))
                    first_form, first = first_dense or (form, None)
                    first_dense = first_form, _compare_logits(timed[1](), first, form, first_form, batch_size, notes,
                                                              "dense")
                if args.profile and batch_size == batch_sizes[-1]:
                    dense_label = f"dense {_dense_key(form) or 'default'}"
                    profile_pair([(dense_label, timed[1]), (f"MoNE {form}", timed[2])], args, profiles, notes, log)
            save()
            del timed
        if args.timm:
            model, info = build_timm_peer(dense.backbone, dense.num_classes, dense.pooling)
            if model is None:
                notes.append(f"timm: {info['reason']}")
                args.timm = False
            else:
                step = timm_step(model, images, args.precision, tf32=args.matmul_precision != "highest")
                step()
                rows.append(("timm forward", batch_size, "timm", interleaved_ms({"t": step}, args.repeats)["t"],
                             None, None))
                del model, step
            save()
    if args.train_batch:
        images, labels = _batch(dense.backbone, dense.num_classes, args.train_batch, args.seed)
        x, y = device_batch(images, labels)
        dense_steps = {}
        for form in train_forms:
            timed = timed_pair("train step", args.train_batch, form, lambda model: train_step(model, x, y), models,
                               dense_steps, args, notes, log)
            if timed is not None:
                rows.append(timed[0])
            save()
            del timed
    return report(args, rows, profiles, notes, ratio)


def report(args, rows, profiles, notes, ratio):
    device = device_info("jax")
    lines = [
        f"`{' '.join(['KERAS_BACKEND=jax python bench/gpu_forms.py'] + sys.argv[1:])}`",
        "",
        f"{device['name']}; jax {jax.__version__}, keras {keras.__version__}; {args.family} {args.variant} "
        f"{args.image_size}px{' (tiny)' if args.tiny else ''}, MoNE e_c {args.capacity:g} (FLOP ratio "
        f"{ratio:.2f}), {args.precision}"
        + (TANH_GELU_NOTE if args.gelu_approximate else "")
        + matmul_precision_note(args.matmul_precision)
        + f", device input, medians of {args.repeats} interleaved calls; "
        f"{time.strftime('%Y-%m-%d')}."
        + "".join(f" {name}={os.environ[name]!r}." for name in TILE_VARIABLES if os.environ.get(name)),
        "",
        "| step | batch | form | dense ms | MoNE ms | speed-up | efficiency | MoNE compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, batch, form, dense_ms, mone_ms, seconds in rows:
        if mone_ms is None:
            lines.append(f"| {kind} | {batch} | {form} | {dense_ms:.2f} | | | | |")
            continue
        speedup = dense_ms / mone_ms
        lines.append(f"| {kind} | {batch} | {form} | {dense_ms:.2f} | {mone_ms:.2f} | **{speedup:.2f}x** | "
                     f"{speedup / ratio:.2f} | {seconds:.0f} |")
    if profiles:
        lines += ["", f"Device time per forward at batch {args.batch_sizes.split(',')[-1]} "
                  f"(jax.profiler, {args.profile_calls} traced calls):", "", format_kernel_tables(profiles)]
    lines += [f"- {note}" for note in notes]
    text = "\n".join(lines) + "\n"
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "gpu_forms.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.output, "gpu_forms.json"), "w") as f:
            json.dump({"rows": rows, "profiles": profiles, "notes": notes, "flop_ratio": ratio,
                       "device": device, "argv": sys.argv[1:]}, f, indent=1)
    return text


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="vit", choices=("vit", "vivit"))
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--image-size", type=int, default=None, help="default 224 (vit), 256 (vivit); 32 with --tiny")
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--precision", default="mixed_bfloat16")
    parser.add_argument("--matmul-precision", default="default", choices=MATMUL_PRECISIONS,
                        help="jax's matmul precision: 'highest' runs float32 matmuls without TF32, as a V100 "
                        "(MoNE Table 1) does; timm's peer then runs without TF32 too")
    parser.add_argument("--forms", default="present,free,fused_mlp,free+fused_mlp")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="trace the last batch size's programs")
    parser.add_argument("--profile-calls", type=int, default=3)
    parser.add_argument("--train-batch", type=int, default=0, help="also time training steps at this batch")
    parser.add_argument("--train-forms", default="present,free")
    parser.add_argument("--timm", action="store_true", help="time timm's ViT at each batch size (torch)")
    parser.add_argument("--tiny", action="store_true", help="a 2-block model for a CPU smoke test")
    parser.add_argument("--gelu-approximate", action="store_true",
                        help="both models with the tanh GELU, as the AugReg presets (zoo/vit.toml) compute it; "
                        "timm's peer keeps its exact GELU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.image_size is None:
        args.image_size = 32 if args.tiny else (256 if args.family == "vivit" else 224)
    if not args.train_batch:
        args.train_forms = ""
    return args


if __name__ == "__main__":
    if keras.backend.backend() != "jax":
        sys.exit("bench/gpu_forms.py compiles jax programs: run it with KERAS_BACKEND=jax.")
    print(run(parse()))
