"""The CPU quickstart: MoNE vs dense ViT on cluttered digits, in a few minutes.

Trains the recipes ``cluttered_digits_vit`` (dense ViT) and
``cluttered_digits_mone`` (MoNE-ViT of the same size at e_c 0.5) through the
one training loop of keras_mone (``keras_mone.recipes.load(...).fit()``, as
``keras-mone train`` does), each in its own run directory under the output
(``dense/``, ``mone/``: checkpoints, ``history.csv``, ``model.keras``; an
interrupted quickstart resumes where it stopped). Digits recipes need no
tf.data (fresh renderings from :class:`keras_mone.data.ClutteredDigitsStream`,
the test split in memory), so a jax or torch install is enough. Then evaluates MoNE at several effective capacities on the 5026-image
test split and writes ``results.json`` (with per-epoch histories: loss,
accuracy, MoNE's alpha and router entropy, and the wall-clock seconds of each
phase: ``phase_seconds``), ``accuracy_vs_gmacs.png`` and ``routing.png`` (tokens
sent to the full expert, as in Fig. 1 and 8 of the MoNE paper). After each
phase it prints the time elapsed and about how long the rest will take."""

import contextlib
import csv
import json
import os
import time

import keras
import numpy as np

from keras_mone.analysis import expert_share_of_tokens, flops
from keras_mone.analysis.throughput import images_per_second
from keras_mone.analysis.token_maps import padded_batches
from keras_mone.data import load_cluttered_digits, patch_coverage
from keras_mone.data.cluttered_digits import NUM_CLASSES
from keras_mone.models.variants import decode_variant
from keras_mone.file_io import atomic_write_text
from keras_mone.recipes import RecipeError, load, resolve
from keras_mone.data.digit_tasks import cluttered_digits_arguments
from keras_mone.recipes.data_sources import digits_stream

DENSE_RECIPE = "cluttered_digits_vit"
MONE_RECIPE = "cluttered_digits_mone"
EVAL_CAPACITIES = (0.2, 0.3, 0.5, 1.0)
THROUGHPUT_IMAGES = 2048  # test images timed per model and capacity
ROUTING_IMAGES = 1024  # test images whose digit tokens' experts are counted
#: Seconds of the default quickstart's phases on a quiet 2-core machine (BENCHMARKS.md, "Quickstart",
#: 2026-11-26: 716 training steps a model, compilation included; four MoNE capacities evaluated);
#: the estimate of the time left scales them to the run's steps, capacities and speed.
REFERENCE_SECONDS = dict(
    test_data=0.1, dense_step=88.0 / 716, dense_evaluation=2.4, mone_step=88.9 / 716,
    evaluation_per_capacity=16.9 / 4, plots=2.2,
)


def load_test_data(recipe):
    """The recipe's test split: ``((images in [-1, 1], one-hot labels), digit_tokens)``,
    images scaled as the recipe pipeline scales them; ``digit_tokens`` (bool,
    images x patches) marks the patches that hold digit pixels."""
    images, labels, masks = load_cluttered_digits(**cluttered_digits_arguments(recipe, "test"), return_masks=True)
    patch_size = {**decode_variant(recipe["variant"]), **recipe["model_args"]}["patch_size"]
    digit_tokens = patch_coverage(masks, patch_size) > 0
    return (images * 2 - 1, np.eye(NUM_CLASSES, dtype="float32")[labels]), digit_tokens


def resolve_recipe(name, overrides):
    """The validated recipe ``name`` with ``overrides``; only fixed-capacity
    (or dense) cluttered-digits recipes can run in memory."""
    recipe, _ = resolve(name, **overrides)
    if recipe["dataset"] != "cluttered_digits" or recipe["mode"] != "fixed" or not recipe["fresh_renderings"]:
        raise RecipeError(
            f"recipe {name!r}: the quickstart runs dataset 'cluttered_digits' in mode 'fixed' with "
            f"fresh_renderings, got dataset {recipe['dataset']!r}, mode {recipe['mode']!r}, "
            f"fresh_renderings {recipe['fresh_renderings']!r}."
        )
    return recipe


def training_schedule(recipe):
    """``(epochs, steps per epoch, batch size)`` of a fresh-renderings digits recipe:
    its ``steps_per_epoch``, else the whole batches of one epoch's renderings
    (the training loop leaves the rest out)."""
    steps = recipe["steps_per_epoch"] or digits_stream(recipe).steps_per_epoch
    return recipe["epochs"], steps, recipe["batch_size"]


def train_recipe(name, output_dir, overrides, verbose="auto"):
    """Trains recipe ``name`` with ``overrides`` in ``output_dir`` (resuming a run
    of the same recipe there) through ``keras_mone.recipes.load(...).fit()``;
    returns the trained model, its per-epoch history (``history.csv``: loss,
    accuracy, validation metrics, MoNE's alpha and router entropy) and the
    steps this call trained (fewer on a resumed run)."""
    setup = load(name, resume=True, **{**overrides, "output_dir": output_dir})
    steps = setup.total_steps - setup.initial_step
    setup.fit(verbose=verbose)
    with open(os.path.join(output_dir, "history.csv")) as f:
        rows = list(csv.DictReader(f))
    history = {key: [float(row[key]) for row in rows if row[key] != ""] for key in (rows[0] if rows else {}) if key != "epoch"}
    return setup.model, history, steps


def top1_accuracy(model, test_data, batch_size=256):
    """Top-1 accuracy (argmax of the logits against argmax of the one-hot
    labels, as Keras' ``accuracy``) from ``predict_on_batch`` over whole batches,
    the last padded and its padding not counted: the one compiled function per
    capacity that ``images_per_second`` times as well (``model.evaluate``
    compiled a test function besides, two shapes of it: 4-5 s per capacity on
    2 CPU cores, where this pass takes 0.5 s)."""
    images, labels = test_data
    correct, start = 0, 0
    for batch, count in padded_batches(images, batch_size):
        logits = np.asarray(model.predict_on_batch(batch))[:count]
        correct += int(np.sum(np.argmax(logits, axis=-1) == np.argmax(labels[start : start + count], axis=-1)))
        start += count
    return correct / len(images)


def evaluate(model, test_data, digit_tokens=None, batch_size=256):
    """Accuracy, GMACs per image and measured images per second at the current
    capacity; for MoNE also the share of digit tokens each expert receives
    (``digit_tokens_by_expert``, smallest expert first) and the experts'
    capacities (a random router's shares)."""
    result = dict(
        capacity=model.capacity,
        accuracy=top1_accuracy(model, test_data, batch_size),
        gmacs=flops(model).total / 1e9,
        images_per_second=images_per_second(model, test_data[0][:THROUGHPUT_IMAGES], batch_size=batch_size),
    )
    if digit_tokens is not None and hasattr(model.backbone, "expert_capacities"):
        images = test_data[0][:ROUTING_IMAGES]
        shares = expert_share_of_tokens(model, images, digit_tokens[:ROUTING_IMAGES], batch_size=batch_size)
        result["digit_tokens_by_expert"] = [float(v) for v in shares]
        result["expert_capacities"] = [float(v) for v in model.backbone.expert_capacities]
    return result


@contextlib.contextmanager
def timed(phase_seconds, phase):
    """Adds the wall-clock seconds of the ``with`` body to ``phase_seconds[phase]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        phase_seconds[phase] = phase_seconds.get(phase, 0.0) + time.perf_counter() - started


def time_left(done, left):
    """``(seconds left, slowdown)``: the reference seconds of the phases ``left``
    times the slowdown, this run's seconds over the reference's in the phases
    ``done`` (``{phase: (seconds, reference seconds)}``) that should take a second
    or more (None, and the reference's seconds, before one is done)."""
    counted = [(seconds, reference) for seconds, reference in done.values() if reference >= 1.0]
    slowdown = sum(s for s, _ in counted) / sum(r for _, r in counted) if counted else None
    return (slowdown or 1.0) * sum(left.values()), slowdown


class Progress:
    """Prints, after each phase, the time elapsed and about how long the phases
    left will take (``time_left``); ``expected`` maps each phase, in order, to its
    reference seconds."""

    def __init__(self, expected, phase_seconds, started):
        self.expected, self.phase_seconds, self.started = dict(expected), phase_seconds, started
        self.done = {}

    def finished(self, phase, reference=None):
        """Prints the line for ``phase`` (``reference``: its reference seconds, now known)."""
        expected = self.expected.pop(phase)
        self.done[phase] = (self.phase_seconds[phase], expected if reference is None else reference)
        line = f"Progress: {phase.replace('_', ' ')} done, {time.perf_counter() - self.started:.0f} s elapsed"
        if self.expected:
            seconds, slowdown = time_left(self.done, self.expected)
            pace = ("at a quiet 2-core machine's speed" if slowdown is None
                    else f"this machine has taken {slowdown:.1f}x a quiet 2-core machine's time so far")
            line += f"; about {seconds:.0f} s left ({pace})"
        print(line, flush=True)


def run_quickstart(output_dir, overrides=None, eval_capacities=EVAL_CAPACITIES, verbose="auto"):
    """Runs the quickstart and writes its outputs to ``output_dir``; returns the results.

    Args:
        overrides: recipe keys applied to both recipes (``model_args`` as a
            dict), e.g. ``{"epochs": 3}``; checked before anything trains.
        eval_capacities: effective capacities MoNE is evaluated at.
    """
    overrides = dict(overrides or {})
    dense_recipe = resolve_recipe(DENSE_RECIPE, overrides)
    mone_recipe = resolve_recipe(MONE_RECIPE, overrides)
    _check_capacities(eval_capacities)
    os.makedirs(output_dir, exist_ok=True)
    epochs, steps, batch = training_schedule(dense_recipe)
    expected = _expected_seconds((epochs, steps), training_schedule(mone_recipe)[:2], len(eval_capacities))
    started = time.perf_counter()
    phases = {}
    progress = Progress(expected, phases, started)
    with timed(phases, "test_data"):
        test_data, digit_tokens = load_test_data(dense_recipe)
    progress.finished("test_data")
    results = {
        "backend": keras.backend.backend(),
        "recipes": {"dense": DENSE_RECIPE, "mone": MONE_RECIPE},
        "overrides": overrides,
        "epochs": epochs,
        "train_images": epochs * steps * batch,
        "test_images": len(test_data[0]),
        "phase_seconds": phases,
    }

    print(
        f"Training the dense ViT ({DENSE_RECIPE}: {epochs} epochs of {steps} steps x {batch} = "
        f"{steps * batch:,} fresh images; test split {len(test_data[0])} images)"
    )
    dense, results["dense_history"] = _train("dense", output_dir, overrides, verbose, progress)
    with timed(phases, "dense_evaluation"):
        results["dense"] = evaluate(dense, test_data)
    progress.finished("dense_evaluation")

    print(f"Training MoNE-ViT ({MONE_RECIPE}: effective capacity {mone_recipe['capacity']:g})")
    mone, results["mone_history"] = _train("mone", output_dir, overrides, verbose, progress)
    results["train_capacity"] = mone_recipe["capacity"]
    with timed(phases, "mone_evaluation"):
        results["mone"] = _evaluate_capacities(mone, test_data, digit_tokens, eval_capacities)
    progress.finished("mone_evaluation")

    results["seconds"] = time.perf_counter() - started
    write_results(results, output_dir)  # before the plots: a failing plot loses no result
    _write_plots(results, mone, test_data, eval_capacities, output_dir, phases)
    progress.finished("plots")
    results["seconds"] = time.perf_counter() - started
    write_results(results, output_dir)
    _print_summary(results, output_dir)
    return results


def _check_capacities(eval_capacities):
    """Refuses an evaluation capacity outside (0, 1]."""
    for capacity in eval_capacities:
        if not 0.0 < capacity <= 1.0:
            raise ValueError(f"eval_capacities must lie in (0, 1], got {capacity!r}.")


def _expected_seconds(dense_schedule, mone_schedule, num_capacities):
    """The reference seconds of each phase, in order, for ``(epochs, steps per epoch)`` of each model."""
    reference = REFERENCE_SECONDS
    (epochs, steps), (mone_epochs, mone_steps) = dense_schedule, mone_schedule
    return dict(
        test_data=reference["test_data"],
        dense_training=reference["dense_step"] * epochs * steps,
        dense_evaluation=reference["dense_evaluation"],
        mone_training=reference["mone_step"] * mone_epochs * mone_steps,
        mone_evaluation=reference["evaluation_per_capacity"] * num_capacities,
        plots=reference["plots"],
    )


def _train(kind, output_dir, overrides, verbose, progress):
    """Trains the ``kind`` (``"dense"``, ``"mone"``) recipe in ``output_dir/kind``, timed; returns model and history."""
    name = {"dense": DENSE_RECIPE, "mone": MONE_RECIPE}[kind]
    with timed(progress.phase_seconds, f"{kind}_training"):
        model, history, trained = train_recipe(name, os.path.join(output_dir, kind), overrides, verbose)
    progress.finished(f"{kind}_training", REFERENCE_SECONDS[f"{kind}_step"] * trained)
    return model, history


def _evaluate_capacities(mone, test_data, digit_tokens, eval_capacities):
    """MoNE's ``evaluate`` results at each capacity, in order (the model is left at the last one)."""
    evaluations = []
    for capacity in eval_capacities:
        mone.set_capacity(capacity)
        evaluations.append(evaluate(mone, test_data, digit_tokens))
    return evaluations


def _write_plots(results, mone, test_data, eval_capacities, output_dir, phases):
    """Writes ``accuracy_vs_gmacs.png`` and ``routing.png`` (MoNE at the capacity nearest 0.3), timed."""
    from keras_mone.cli import quickstart_plots

    with timed(phases, "plots"):
        quickstart_plots.plot_accuracy_vs_gmacs(results, os.path.join(output_dir, "accuracy_vs_gmacs.png"))
        mone.set_capacity(min(eval_capacities, key=lambda c: abs(c - 0.3)))
        quickstart_plots.plot_routing(mone, test_data, os.path.join(output_dir, "routing.png"))


def _print_summary(results, output_dir):
    """Prints the results table, the seconds of each phase and the files written."""
    print(format_results(results))
    print(format_phases(results))
    print(f"Wrote results.json, accuracy_vs_gmacs.png and routing.png to {output_dir}")


def write_results(results, output_dir):
    """Writes ``results`` to ``output_dir/results.json`` through a temporary file,
    so that rewriting it after the plots cannot leave a truncated file."""
    atomic_write_text(os.path.join(output_dir, "results.json"), json.dumps(results, indent=2))


def format_phases(results):
    """One line: the seconds of each phase and the total (training includes
    compilation, per-epoch validation and checkpoints)."""
    parts = ", ".join(f"{phase.replace('_', ' ')} {seconds:.1f} s" for phase, seconds in results["phase_seconds"].items())
    return f"Time: {parts}; total {results['seconds']:.1f} s"


def format_results(results):
    """The quickstart's results as a plain-text table."""
    dense = results["dense"]
    rows = [("dense ViT", 1.0, dense)] + [("MoNE-ViT", r["capacity"], r) for r in results["mone"]]
    lines = [
        f"{'model':<10} {'e_c':>5} {'accuracy':>9} {'GMACs':>8} {'vs dense':>9} {'images/s':>9}"
        f"  digit tokens to D (its capacity)",
    ]
    for name, capacity, r in rows:
        routing = ""
        if "digit_tokens_by_expert" in r:
            routing = f"  {100 * r['digit_tokens_by_expert'][-1]:.0f}% ({100 * r['expert_capacities'][-1]:.0f}%)"
        lines.append(
            f"{name:<10} {capacity:>5.2f} {100 * r['accuracy']:>8.2f}% {r['gmacs']:>8.4f} "
            f"{r['gmacs'] / dense['gmacs']:>8.2f}x {r['images_per_second']:>9.0f}{routing}"
        )
    return "\n".join(lines)
