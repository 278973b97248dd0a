"""The keys of a training recipe: defaults, allowed values, checks.

A recipe is one flat TOML table (``recipes/*.toml``); ``base = "_name"``
inherits another file's keys. The keys every recipe shares are listed here
once (``COMMON_KEYS``); each method declares its own and their checks in its
registry entry (``keras_mone.methods``), and ``KEYS`` is both, live. Unknown
keys and bad values raise ``RecipeError`` naming the key and what it allows,
before anything is built or trained.
"""

import math
import os

from keras_mone.data.moving_digits import MOVING_TARGETS
from keras_mone.data.pipeline import AUGMENTATIONS, PREPROCESSINGS
from keras_mone.data.video_pipeline import VIDEO_PREPROCESSINGS
from keras_mone.layers.config import config_argument_names
from keras_mone.methods.registry import ARCHITECTURES as BACKBONE_CLASSES
from keras_mone.methods.registry import TASKS as TASK_CLASSES
from keras_mone.methods.registry import (
    ARCHITECTURE_MODES,
    MODE_NAMES,
    LiveMapping,
    RecipeKey,
    RegistryView,
    architectures,
    key_owners,
    method_of,
    method_recipe_keys,
)
from keras_mone.training.distribution import DISTRIBUTION_STRATEGIES

#: Live views of the method registry (a method registered later is accepted too).
ARCHITECTURES = ARCHITECTURE_MODES
VIDEO_ARCHITECTURES = RegistryView(lambda method, a: a, where=lambda method, a: a.video)
IMAGE_DATASETS = ("tfds", "image_folder", "cluttered_digits")
VIDEO_DATASETS = ("video_folder", "moving_digits")
#: ``init_from = "preset:<name>"`` starts from a preset's shipped weights.
PRESET_PREFIX = "preset:"
DATASETS = IMAGE_DATASETS + VIDEO_DATASETS
LOSSES = ("sigmoid", "softmax")
OPTIMIZERS = ("adamw", "sgd")


class RecipeError(ValueError):
    """A recipe key or value is not valid."""


def _k(default, kind, doc, choices=(), low=None, high=None, above=None):
    return RecipeKey(default, kind, doc, choices, low, high, above)


COMMON_KEYS = {
    "description": _k("", str, "one line shown by `keras-mone train --list`"),
    "base": _k("", str, "recipe whose keys this one inherits (files starting with _ are bases)"),
    # model
    "architecture": _k("vit", str, "backbone family", ARCHITECTURES),
    "variant": _k("S/16", str, "size/patch from keras_mone.models.VIT_SIZES, e.g. B/16"),
    "model_args": _k({}, dict, "other backbone / classifier arguments (e.g. hidden_dim, depth)"),
    "num_classes": _k(0, int, "head size; 0 = the dataset's class count", low=0),
    "pooling": _k("gap", str, "pooling before the head", ("gap", "token")),
    "head_bias_init": _k(0.0, float, "initial head bias (AugReg: -10 i21k, -6.9 i1k)"),
    "dropout_rate": _k(0.0, float, "dropout in attention and MLP", low=0.0, high=0.99),
    "drop_path_rate": _k(0.0, float, "stochastic depth at the last block", low=0.0, high=0.99),
    "init_from": _k("", str, "video: a saved model (.keras) or 'preset:<name>' (a preset with weights): an image model (ViT / MoNE-ViT / MatViT) loaded into the spatial transformer, or a video model (e.g. a MatViT-ViViT) copied as a whole; '' = none"),
    # video (architecture vivit / mone_vivit / matvivit)
    "num_frames": _k(32, int, "video: frames per clip, fed to the model and sampled by the pipeline", low=1),
    "tubelet_size": _k(2, int, "video: frames per tubelet; must divide num_frames", low=1),
    "frame_stride": _k(1, int, "video: sample every frame_stride-th frame of a clip", low=1),
    "scale_jitter": _k([0.9, 1.33], list, "video, preprocessing='scale_jitter': range of the factor on the shorter side before the random crop"),
    "flip": _k(True, bool, "video: random horizontal flip of training clips (false for SSv2)"),
    # data
    "dataset": _k("cluttered_digits", str, "data source", DATASETS),
    "tfds_name": _k("", str, "TFDS dataset name (dataset='tfds'), e.g. imagenet2012"),
    "data_dir": _k("", str, "TFDS data_dir, or the image folder root (dataset='image_folder')"),
    "train_split": _k("train", str, "training split (TFDS split, or sub-folder)"),
    "eval_split": _k("test", str, "evaluation split; '' = no evaluation"),
    "image_size": _k(224, int, "training / evaluation image size", low=1),
    "preprocessing": _k("inception", str, "images: inception crop + flip (train), resize-crop (eval); video: scale_jitter random crop (train), resize-crop (eval); or plain resize", PREPROCESSINGS + VIDEO_PREPROCESSINGS[:1]),
    "augmentation": _k("none", str, "AugReg level: MixUp alpha and RandAugment", tuple(AUGMENTATIONS)),
    "shuffle_buffer": _k(50_000, int, "examples in the shuffle buffer", low=1),
    "digit_scale": _k(2.0, float, "cluttered / moving digits: upscaling of the 8x8 source digit (digit side round(8 * digit_scale) px)", low=1.0),
    "clutter": _k(2, int, "cluttered digits: clutter fragments", low=0),
    "samples_per_digit": _k(4, int, "cluttered / moving digits: train images (clips) per source digit (per epoch with fresh_renderings)", low=1),
    "test_samples_per_digit": _k(2, int, "cluttered / moving digits: test images (clips) per source digit (359 test digits)", low=1),
    "fresh_renderings": _k(True, bool, "cluttered / moving digits: render new training images every epoch, deterministic per (seed, epoch, batch), instead of one fixed set"),
    "position_step": _k(1, int, "cluttered / moving digits: digits sit (start) on multiples of this many pixels (the patch size: every digit covers whole patches)", low=1),
    "speed_step": _k(1, int, "moving digits: speeds (pixels per frame) are multiples of this (with position_step, the digit is back on the patch grid every position_step / speed_step frames)", low=1),
    "test_seed": _k(0, int, "cluttered / moving digits: seed of the test renderings, apart from `seed` so that every training seed meets the same test set", low=0),
    "digits_target": _k("digit_direction", str, "moving digits: label space", tuple(MOVING_TARGETS)),
    # optimisation
    "epochs": _k(300, int, "training epochs (before isoFLOPs scaling)", low=1),
    "batch_size": _k(4096, int, "global batch size", low=1),
    "steps_per_epoch": _k(0, int, "0 = train examples // batch_size", low=0),
    "learning_rate": _k(1e-3, float, "peak learning rate", above=0.0),
    "end_learning_rate": _k(0.0, float, "learning rate at the end of the cosine", low=0.0),
    "warmup_steps": _k(0, int, "linear warm-up steps (capped at the total)", low=0),
    "warmup_epochs": _k(0.0, float, "linear warm-up in epochs, if warmup_steps is 0 (ViViT: 2.5)", low=0.0),
    "warmup_fraction": _k(0.0, float, "warm-up as a fraction of all steps, if warmup_steps and warmup_epochs are 0", low=0.0, high=1.0),
    "optimizer": _k("adamw", str, "adamw (AugReg) or sgd with momentum (ViViT)", OPTIMIZERS),
    "momentum": _k(0.9, float, "SGD momentum (optimizer='sgd')", low=0.0, high=0.999),
    "weight_decay": _k(0.1, float, "decoupled decay (times the learning rate) on kernels only, AdamW and SGD", low=0.0),
    "beta_2": _k(0.999, float, "Adam beta_2", low=0.0, high=1.0),
    "grad_clip": _k(1.0, float, "global gradient-norm clip; 0 = none", low=0.0),
    "loss": _k("sigmoid", str, "sigmoid (AugReg) or softmax cross-entropy", LOSSES),
    "label_smoothing": _k(0.0, float, "label smoothing of the softmax loss", low=0.0, high=0.99),
    # MoNE / MatViT training modes (MoNE Sec. 5)
    "mode": _k("fixed", str, "training mode, owned by the architecture's method (`keras-mone train --help` lists each architecture's; e.g. mone_vit: fixed/adaptive/isoflops/adaptive_isoflops, matvit: fixed/joint)", MODE_NAMES),
    # several training modes in one run directory (keras_mone.recipes.phases)
    "phases": _k([], list, "modes run in order, each from the previous one's weights, in one run directory (e.g. ACM's ['distill', 'gates', 'end_to_end']); [] = one run of `mode`"),
    "phase_epochs": _k([], list, "epochs of each phase (one per entry of `phases`); [] = `epochs` each"),
    "phase_learning_rates": _k([], list, "peak learning rate of each phase (one per entry of `phases`); [] = `learning_rate` each"),
    # infrastructure
    "distribution": _k("none", str, "multi-device training; auto = data_parallel over every local GPU/TPU when there are several, else none", DISTRIBUTION_STRATEGIES),
    "model_parallel_size": _k(2, int, "devices on the model axis (distribution='model_parallel')", low=1),
    "seed": _k(0, int, "seed of initialisation, shuffling and augmentation", low=0),
    "output_dir": _k("", str, "run directory; '' = runs/<recipe name>"),
    "checkpoint_steps": _k(1000, int, "steps between checkpoints (0 = epoch ends only)", low=0),
    "eval_batch_size": _k(0, int, "0 = batch_size", low=0),
}


#: ``COMMON_KEYS`` and every registered method's keys, live (a method registered later brings its keys).
KEYS = LiveMapping(lambda: {**COMMON_KEYS, **method_recipe_keys()})


def _type_name(kind):
    return kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)


def _bounds(key):
    """``be >= 0``, ``be > 0``, ``lie in (0.0, 1.0]`` ... for an error message."""
    low = f"[{key.low}" if key.low is not None else (f"({key.above}" if key.above is not None else None)
    if key.high is None:
        return f"be >= {key.low}" if key.low is not None else f"be > {key.above}"
    if low is None:
        return f"be <= {key.high}"
    return f"lie in {low}, {key.high}]"


def check_value(name, value, recipe_name="recipe"):
    """Coerces and checks one value; raises ``RecipeError``."""
    if name not in KEYS:
        raise RecipeError(
            f"{recipe_name}: unknown key {name!r}. Allowed keys: {', '.join(sorted(KEYS))}."
        )
    key = KEYS[name]
    if key.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, key.kind) or (isinstance(value, bool) and key.kind is not bool):
        raise RecipeError(
            f"{recipe_name}: key {name!r} must be a {_type_name(key.kind)} ({key.doc}), got {value!r}."
        )
    if key.kind is float and not math.isfinite(value):
        raise RecipeError(f"{recipe_name}: key {name!r} must be a finite number ({key.doc}), got {value!r}.")
    if key.choices and value not in key.choices:
        raise RecipeError(
            f"{recipe_name}: key {name!r} must be one of {list(key.choices)}, got {value!r}."
        )
    too_low = (key.low is not None and value < key.low) or (key.above is not None and not value > key.above)
    if too_low or (key.high is not None and value > key.high):
        raise RecipeError(f"{recipe_name}: key {name!r} must {_bounds(key)} ({key.doc}), got {value!r}.")
    return value


def validate(raw, recipe_name="recipe"):
    """All keys with defaults filled in, each checked, plus the cross-key rules."""
    recipe = {name: check_value(name, value, recipe_name) for name, value in raw.items()}
    for name, key in KEYS.items():
        recipe.setdefault(name, key.default)
    _check_cross_keys(recipe, recipe_name)
    return recipe


def _check_cross_keys(recipe, recipe_name):
    def fail(message):
        raise RecipeError(f"{recipe_name}: {message}")

    try:
        architectures()[recipe["architecture"]].decode_variant(recipe["variant"])
    except ValueError as error:
        fail(f"key 'variant': {error}")
    allowed = ARCHITECTURE_MODES[recipe["architecture"]]
    if recipe["mode"] not in allowed:
        fail(
            f"key 'mode' must be one of {list(allowed)} for architecture "
            f"{recipe['architecture']!r}, got {recipe['mode']!r}."
        )
    _check_phases(recipe, allowed, fail)
    _check_method_keys(recipe, fail)
    if recipe["dataset"] == "tfds" and not recipe["tfds_name"]:
        fail("dataset='tfds' needs key 'tfds_name' (e.g. 'imagenet2012').")
    if recipe["dataset"] == "image_folder" and not recipe["data_dir"]:
        fail("dataset='image_folder' needs key 'data_dir' (the folder holding <split>/<class>/ images).")
    if recipe["label_smoothing"] and recipe["loss"] != "softmax":
        fail("key 'label_smoothing' needs loss='softmax'.")
    _check_video_keys(recipe, fail)
    bundled_classes = {"cluttered_digits": 10, "moving_digits": MOVING_TARGETS[recipe["digits_target"]]}
    classes = bundled_classes.get(recipe["dataset"])
    if classes and recipe["num_classes"] not in (0, classes):
        fail(f"key 'num_classes' must be 0 or {classes} (the classes of dataset {recipe['dataset']!r}), got {recipe['num_classes']}.")
    unused = changed_unused_keys(recipe)
    if unused:
        fail(
            f"architecture {recipe['architecture']!r} takes no {sorted(unused)} (set to {unused}); "
            "remove them from the recipe."
        )
    try:
        check_model_args(recipe["architecture"], recipe["model_args"])
    except ValueError as error:
        fail(f"key 'model_args': {error}")
    _check_model_args_fit_the_data(recipe, classes, fail)


def _check_video_keys(recipe, fail):
    """Video architectures take video datasets and a frame count the tubelet divides."""
    video = recipe["architecture"] in VIDEO_ARCHITECTURES
    if video != (recipe["dataset"] in VIDEO_DATASETS):
        wanted = VIDEO_DATASETS if video else IMAGE_DATASETS
        fail(
            f"key 'dataset' must be one of {list(wanted)} for architecture "
            f"{recipe['architecture']!r}, got {recipe['dataset']!r}."
        )
    if not video:
        if recipe["preprocessing"] not in PREPROCESSINGS:
            fail(f"key 'preprocessing' must be one of {list(PREPROCESSINGS)} for images, got {recipe['preprocessing']!r}.")
        return
    if recipe["num_frames"] % recipe["tubelet_size"]:
        fail(
            f"key 'num_frames' ({recipe['num_frames']}) must be a multiple of key "
            f"'tubelet_size' ({recipe['tubelet_size']})."
        )
    if recipe["preprocessing"] not in VIDEO_PREPROCESSINGS:
        fail(f"key 'preprocessing' must be one of {list(VIDEO_PREPROCESSINGS)} for video, got {recipe['preprocessing']!r}.")
    jitter = recipe["scale_jitter"]
    if len(jitter) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in jitter) or not 0 < jitter[0] <= jitter[1]:
        fail(f"key 'scale_jitter' must be [low, high] with 0 < low <= high, got {jitter!r}.")
    if recipe["dataset"] == "video_folder" and not recipe["data_dir"]:
        fail("dataset='video_folder' needs key 'data_dir' (the folder holding <split>/<class>/<clip>/ frames).")
    _check_model_source("init_from", recipe, fail)


def _check_model_source(key, recipe, fail):
    """``recipe[key]`` names a preset with weights, an existing file, or nothing."""
    source = recipe[key]
    if source.startswith(PRESET_PREFIX):
        from keras_mone.presets import shipped_presets

        if source[len(PRESET_PREFIX):] not in shipped_presets():
            fail(f"key {key!r}: {source!r} names no preset with weights; choose from {shipped_presets()}.")
    elif source and not os.path.isfile(os.path.expanduser(source)):
        fail(f"key {key!r}: model file {source!r} does not exist.")


def _check_method_keys(recipe, fail):
    """A method's keys stay at their defaults unless the recipe's method owns them;
    keys naming a model name one that exists; then the method's own checks."""
    method = method_of(recipe["architecture"])
    for name, key in method_recipe_keys().items():
        if name not in method.recipe_keys and recipe[name] != key.default:
            owners = [a.name for owner in key_owners(name) for a in owner.architectures]
            fail(
                f"key {name!r} is for architecture {' / '.join(repr(a) for a in owners)}, not "
                f"{recipe['architecture']!r} (set to {recipe[name]!r}); remove it from the recipe."
            )
        if key.model_source:
            _check_model_source(name, recipe, fail)
    method.check_recipe(recipe, fail)


def _check_phases(recipe, allowed, fail):
    """``phases`` name modes of the architecture and the ``phase_*`` lists match them."""
    phases = recipe["phases"]
    if phases and recipe["mode"] != KEYS["mode"].default:
        fail(f"set either key 'phases' ({phases!r}) or key 'mode' ({recipe['mode']!r}), not both.")
    for name in phases:
        if name not in allowed:
            fail(
                f"key 'phases': {name!r} is no training mode of architecture {recipe['architecture']!r}; "
                f"its modes: {list(allowed)}."
            )
    for key, kind, what in (("phase_epochs", int, "integers >= 1"), ("phase_learning_rates", (int, float), "numbers > 0")):
        values = recipe[key]
        if values and not phases:
            fail(f"key {key!r} needs key 'phases'.")
        if values and len(values) != len(phases):
            fail(f"key {key!r} needs one entry per phase ({len(phases)}: {phases}), got {values!r}.")
        if any(isinstance(v, bool) or not isinstance(v, kind) or not v > 0 or not math.isfinite(v) for v in values):
            fail(f"key {key!r} must hold {what}, got {values!r}.")
    if phases:
        _check_model_source("init_from", recipe, fail)


#: Video geometry comes from recipe keys (they also drive the data pipeline), not model_args.
VIDEO_KEYS = ("num_frames", "tubelet_size")


#: Recipe keys every architecture may take; one an architecture has no use for must stay at its default.
SHARED_MODEL_KEYS = ("image_size", "dropout_rate", "drop_path_rate", "pooling", "head_bias_init")


def changed_unused_keys(recipe):
    """``{key: value}`` of the shared model keys ``recipe`` sets away from their
    defaults although its architecture takes no such argument."""
    backbone, task = allowed_args(recipe["architecture"])
    return {
        k: recipe[k] for k in SHARED_MODEL_KEYS
        if k not in backbone | task and recipe[k] != KEYS[k].default
    }


def allowed_args(architecture):
    """``(backbone argument names, classifier argument names)`` of ``architecture``."""
    backbone = set(config_argument_names(BACKBONE_CLASSES[architecture]))
    task = set(config_argument_names(TASK_CLASSES[architecture])) - {"backbone"}
    return backbone, task


def check_model_args(architecture, model_args):
    """Raises ``ValueError`` if a ``model_args`` key is no constructor argument."""
    backbone, task = allowed_args(architecture)
    unknown = sorted(set(model_args) - backbone - task)
    clashes = sorted(set(model_args) & set(VIDEO_KEYS))
    if clashes:
        raise ValueError(f"set {clashes} as top-level recipe key(s), not in model_args.")
    if unknown:
        raise ValueError(
            f"unknown argument(s) {unknown} for architecture {architecture!r}. "
            f"Allowed: {sorted(backbone | task)}."
        )


def _check_model_args_fit_the_data(recipe, dataset_classes, fail):
    """``model_args`` may repeat, never change, what the data pipeline feeds the model."""
    args = recipe["model_args"]
    size = recipe["image_size"]
    model_size = args.get("image_size", size)
    if (list(model_size) if isinstance(model_size, (list, tuple)) else model_size) not in (size, [size, size]):
        fail(
            f"key 'model_args.image_size' = {args['image_size']!r} differs from key 'image_size' = {size} "
            f"(the size the data pipeline feeds the model); allowed: {size} or none. Set the top-level "
            "key 'image_size' to change both."
        )
    if "num_channels" in args and args["num_channels"] != 3:
        fail(f"key 'model_args.num_channels' = {args['num_channels']!r}: the data pipelines feed RGB; allowed: 3 or none.")
    if "num_classes" not in args:
        return
    classes = recipe["num_classes"] or dataset_classes
    if classes is None:
        fail(
            f"key 'model_args.num_classes' = {args['num_classes']!r} cannot be checked against the labels of "
            f"dataset {recipe['dataset']!r} before they are read; set the top-level key 'num_classes' instead."
        )
    if args["num_classes"] != classes:
        fail(
            f"key 'model_args.num_classes' = {args['num_classes']!r} differs from the {classes} classes of the "
            f"task (the width of its labels); allowed: {classes} or none. Set the top-level key "
            "'num_classes' instead."
        )
