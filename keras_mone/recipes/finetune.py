"""Fine-tuning a preset on your own images: ``keras-mone finetune PRESET DATA_DIR``.

``plan(preset, data_dir)`` turns a preset (a built-in name, a preset folder or
hub handle) and an image folder into a recipe: the bundled CPU recipe of the
preset's architecture (its ``*_from_dense`` fine-tuning form where there is
one: a lower learning rate, one epoch) with

* the model: exactly the preset's (its backbone and classifier configuration
  as ``model_args``), initialised from it (``init_from = "preset:<handle>"``);
  the head is copied when the class counts agree, else it is a new head (said
  in ``notes``);
* the data: ``dataset = "image_folder"`` over ``DATA_DIR``, laid out as
  ``DATA_DIR/train/<class>/*.png|jpg`` (plus ``val``, ``validation`` or
  ``test`` beside it if you have one) or simply ``DATA_DIR/<class>/*``; with
  no held-out split, ``eval_fraction`` of the training images (a fixed
  shuffle across classes) is held out (``train[:80%]`` / ``train[80%:]``);
* the run directory ``runs/finetune/<preset>-<folder>`` (run the same
  command again to resume, as any recipe).

Any recipe key can still be given (``epochs=5``, ``learning_rate=1e-4``,
``batch_size=32``, ``output_dir=...``). Video presets are refused (their
recipes take ``init_from = "preset:<name>"`` directly, docs/training.md).
"""

import dataclasses
import inspect
import os

from keras_mone.data.pipeline import IMAGE_SUFFIXES
from keras_mone.methods.registry import architectures
from keras_mone.recipes.files import list_recipes, resolve
from keras_mone.recipes.schema import PRESET_PREFIX, RecipeError

EVAL_SPLITS = ("val", "validation", "test")
#: configuration entries that are no model argument a recipe may set
_NOT_MODEL_ARGS = {"name", "trainable", "dtype", "backbone", "image_size", "num_classes"}


@dataclasses.dataclass
class FinetunePlan:
    """What ``keras-mone finetune`` runs: ``recipes.load(recipe, **overrides)``; ``notes`` say why."""

    recipe: str
    overrides: dict
    notes: list


def _class_names(folder):
    return sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))


def _holds_images(folder):
    return any(name.lower().endswith(IMAGE_SUFFIXES) for name in os.listdir(folder))


def _count_images(folder):
    return sum(
        name.lower().endswith(IMAGE_SUFFIXES)
        for cls in _class_names(folder) for name in os.listdir(os.path.join(folder, cls))
    )


def data_layout(data_dir, eval_fraction):
    """``(data_dir, train_split, eval_split, class names, training images, note)`` of an image folder."""
    root = os.path.abspath(os.path.expanduser(os.fspath(data_dir)))
    if not os.path.isdir(root):
        raise RecipeError(f"finetune: DATA_DIR {os.fspath(data_dir)!r} is not a folder.")
    if not 0.0 < eval_fraction < 1.0:
        raise RecipeError(f"finetune: eval_fraction must be in (0, 1), got {eval_fraction!r}.")
    if os.path.isdir(os.path.join(root, "train")):
        parent, train = root, "train"
    else:  # DATA_DIR/<class>/*: the folder itself is the one split
        classes = _class_names(root)
        if not classes or not any(_holds_images(os.path.join(root, c)) for c in classes):
            raise RecipeError(
                f"finetune: {root!r} has neither a 'train' folder nor class folders of {IMAGE_SUFFIXES} images; "
                "lay it out as DATA_DIR/train/<class>/*.png (val/ beside train/ optional) or DATA_DIR/<class>/*.png."
            )
        parent, train = os.path.dirname(root), os.path.basename(root)
    classes = _class_names(os.path.join(parent, train))
    if len(classes) < 2:
        raise RecipeError(f"finetune: {os.path.join(parent, train)!r} needs at least two class folders, found {classes}.")
    images = _count_images(os.path.join(parent, train))
    held_out = next((s for s in EVAL_SPLITS if train == "train" and os.path.isdir(os.path.join(parent, s))), None)
    if held_out:
        return parent, train, held_out, classes, images, f"evaluation on the {held_out!r} folder"
    percent = round(100 * (1 - eval_fraction))
    note = f"no held-out folder: {100 - percent}% of {train!r} held out for evaluation ({train}[{percent}%:])"
    return parent, f"{train}[:{percent}%]", f"{train}[{percent}%:]", classes, images * percent // 100, note


def _architecture_of(model):
    for name, architecture in architectures().items():
        if type(model.backbone) is architecture.backbone and isinstance(model, architecture.task):
            return name, architecture
    raise RecipeError(f"finetune: no registered architecture builds a {type(model.backbone).__name__}.")


def _base_recipe(architecture):
    """The bundled CPU recipe of ``architecture``: its ``*_from_dense`` form first, no phased ones."""
    found = []
    for name in list_recipes():
        recipe, _ = resolve(name)
        if recipe["architecture"] == architecture and recipe["dataset"] == "cluttered_digits" and not recipe["phases"]:
            found.append((not name.endswith("_from_dense"), "adaptive" in name, name))
    if not found:
        raise RecipeError(f"finetune: no bundled recipe trains architecture {architecture!r} on images.")
    return min(found)[2]


def _image_size(backbone, preset):
    size = backbone.image_size
    if isinstance(size, int):
        return size
    if len(set(size)) != 1:
        raise RecipeError(f"finetune: preset {preset!r} takes {tuple(size)} images; the recipes train square ones.")
    return int(size[0])


def _none_by_default(cls):
    return {
        name for name, parameter in inspect.signature(cls.__init__).parameters.items()
        if parameter.default is None
    }


def _model_args(model):
    """The preset's backbone and classifier configuration; ``None`` only where it is the default
    (TOML, the run directory's ``recipe.toml``, has no null)."""
    config = {**model.backbone.get_config(), **model.get_config()}
    defaults = _none_by_default(type(model.backbone)) | _none_by_default(type(model))
    unwritable = sorted(k for k, v in config.items() if v is None and k not in defaults and k not in _NOT_MODEL_ARGS)
    if unwritable:
        raise RecipeError(f"finetune: the preset's {unwritable} are None, which a recipe cannot hold.")
    return {k: v for k, v in config.items() if k not in _NOT_MODEL_ARGS and v is not None}


def plan(preset, data_dir, eval_fraction=0.2, **overrides):
    """The recipe that fine-tunes ``preset`` on the image folder ``data_dir`` (see the module docstring)."""
    from keras_mone.presets import from_preset

    model = from_preset(preset, load_weights=False)  # its configuration only: nothing is downloaded
    name, architecture = _architecture_of(model)
    if architecture.video:
        raise RecipeError(
            f"finetune takes image presets; {preset!r} is a video model: train a video recipe with "
            f"init_from='preset:{preset}' (docs/training.md)."
        )
    root, train_split, eval_split, classes, images, data_note = data_layout(data_dir, eval_fraction)
    base = _base_recipe(name)
    batch = resolve(base)[0]["batch_size"]
    while batch > 1 and batch > images:  # a batch no larger than the training set
        batch //= 2
    preset_classes = model.num_classes
    head = (
        f"the preset's {preset_classes}-class head is kept"
        if preset_classes == len(classes) else
        f"a new {len(classes)}-class head (the preset has {preset_classes} classes; the rest comes from the preset)"
    )
    tag = os.path.basename(os.path.normpath(os.fspath(preset))).replace(os.sep, "_")
    folder = os.path.basename(os.path.normpath(os.path.abspath(os.fspath(data_dir))))
    settings = dict(
        architecture=name, image_size=_image_size(model.backbone, preset), model_args=_model_args(model),
        init_from=PRESET_PREFIX + os.fspath(preset), dataset="image_folder", data_dir=root,
        num_classes=len(classes), train_split=train_split, eval_split=eval_split, batch_size=batch,
        output_dir=os.path.join("runs", "finetune", f"{tag}-{folder}"),
    )
    settings.update(overrides)
    notes = [
        f"recipe {base!r} (architecture {name!r}), batch size {settings['batch_size']}",
        f"{len(classes)} classes: {', '.join(classes)}", head, data_note,
    ]
    return FinetunePlan(base, settings, notes)


def load(preset, data_dir, eval_fraction=0.2, resume=True, **overrides):
    """``(TrainingSetup, notes)``: ``plan(...)`` built by ``keras_mone.recipes.load``."""
    from keras_mone.recipes.loader import load as load_recipe

    finetune = plan(preset, data_dir, eval_fraction, **overrides)
    return load_recipe(finetune.recipe, resume=resume, **finetune.overrides), finetune.notes
