"""Publishing a trained run as the shipped weights of a preset (``keras-mone presets publish``).

The run directory of ``keras-mone train`` holds ``model.keras`` and the
resolved ``recipe.toml``. Publishing copies the trained weights into the
preset's architecture (``from_preset(name, load_weights=False)``: a run that
does not fit the preset is refused), measures test accuracy on the recipe's
test split at every capacity (MoNE), width (MatViT) or execution (ACM), writes
``<zoo>/weights/<name>.weights.h5`` atomically and records file, sha256,
recipe, command and accuracies in ``<zoo>/weights/manifest.toml``.
"""

import os
import tempfile
import tomllib

import numpy as np

from keras_mone.methods.registry import scoring, set_setting
from keras_mone.models.weights_file import load_saved_model
from keras_mone.presets import registry
from keras_mone.presets.weights import (
    MANIFEST,
    WEIGHTS_FOLDER,
    sha256_of,
    write_manifest,
    zoo_folders,
)

EVAL_BATCH_SIZE = 512


def evaluation_settings(model, architecture=None):
    """``(setting, values)`` at which a preset's accuracy is recorded: its method's
    ``scored_at`` (``keras_mone.methods``; e.g. MoNE capacities, MatViT widths,
    ACM's executions)."""
    scored = scoring(model, architecture)
    return scored.setting, scored.values


#: Datasets whose runs can be published: name -> loader of their test split.
PUBLISHABLE_DATASETS = ("cluttered_digits", "moving_digits")


def test_split_arguments(recipe):
    """Arguments of ``load_cluttered_digits`` / ``load_moving_digits`` for a
    digits recipe's test split (clips ``num_frames`` long: the recipes' frame
    stride 1)."""
    from keras_mone.data.digit_tasks import cluttered_digits_arguments, moving_digits_arguments

    if recipe["dataset"] not in PUBLISHABLE_DATASETS:
        raise ValueError(
            f"Only runs on the bundled tasks {PUBLISHABLE_DATASETS} can be published, got dataset {recipe['dataset']!r}."
        )
    if recipe["dataset"] == "moving_digits":
        if recipe["frame_stride"] != 1:
            raise ValueError(f"Only moving-digits runs with frame_stride 1 can be published, got {recipe['frame_stride']}.")
        return moving_digits_arguments(recipe, "test")
    return cluttered_digits_arguments(recipe, "test")


def load_test_split(test_split, dataset="cluttered_digits"):
    """``(inputs in [-1, 1], int labels)`` of a recorded test split."""
    from keras_mone.data import load_cluttered_digits, load_moving_digits

    if dataset not in PUBLISHABLE_DATASETS:
        raise ValueError(f"dataset must be one of {PUBLISHABLE_DATASETS}, got {dataset!r}.")
    load = load_moving_digits if dataset == "moving_digits" else load_cluttered_digits
    inputs, labels = load(**test_split)
    return inputs * 2.0 - 1.0, labels


def measure_accuracy(model, setting, values, test_split, dataset="cluttered_digits"):
    """``{str(value): test accuracy}`` of ``model`` at each capacity / width / ACM execution on
    the test split of ``dataset`` rendered with ``test_split``."""
    images, labels = load_test_split(test_split, dataset)
    accuracy = {}
    scored = scoring(model)
    for value in values:
        set_setting(model, setting, value)
        logits = model.predict(images, batch_size=EVAL_BATCH_SIZE, verbose=0)
        accuracy[str(value)] = float(np.mean(np.argmax(logits, axis=-1) == labels))
    if scored.setting == setting:
        set_setting(model, setting, scored.current)  # back to the setting it came with
    return accuracy


def publish_run(run_dir, name, command="", zoo_folder=None):
    """Publishes the model trained in ``run_dir`` as the weights of preset ``name``.

    Args:
        run_dir: a ``keras-mone train`` output directory (``model.keras``,
            ``recipe.toml``).
        name: a preset from ``list_presets()`` whose architecture the run has.
        command: how the run was made, recorded in the manifest.
        zoo_folder: zoo folder to write into (default: the bundled zoo).

    Returns:
        The manifest entry written.
    """
    with open(os.path.join(run_dir, "recipe.toml"), "rb") as f:
        header = f.readline().decode()  # "# Resolved recipe 'name'"
        f.seek(0)
        recipe = tomllib.load(f)
    recipe_name = header.split("recipe", 1)[-1].strip().strip("'\"") if header.startswith("#") else ""
    trained = load_saved_model(os.path.join(run_dir, "model.keras"), compile=False)
    model = registry.from_preset(name, load_weights=False)
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "trained.weights.h5")
        trained.save_weights(path)
        try:
            model.load_weights(path)
        except Exception as error:
            raise ValueError(f"The model in {run_dir!r} does not fit preset {name!r}: {error}") from error
    setting, values = evaluation_settings(model, registry.get_preset(name)["architecture"])
    test_split = test_split_arguments(recipe)
    accuracy = measure_accuracy(model, setting, values, test_split, recipe["dataset"])

    folder = os.path.join(zoo_folder or zoo_folders()[0], WEIGHTS_FOLDER)
    os.makedirs(folder, exist_ok=True)
    file = f"{name}.weights.h5"
    partial = os.path.join(folder, f"{name}.partial.weights.h5")
    model.save_weights(partial)
    os.replace(partial, os.path.join(folder, file))
    entry = {
        "file": file,
        "sha256": sha256_of(os.path.join(folder, file)),
        "recipe": recipe_name,
        "command": command,
        "eval": {"setting": setting, "accuracy": accuracy, "dataset": recipe["dataset"], "test_split": test_split},
    }
    manifest_path = os.path.join(folder, MANIFEST)
    manifest = {}
    if os.path.isfile(manifest_path):
        with open(manifest_path, "rb") as f:
            manifest = tomllib.load(f)
    manifest[name] = entry
    write_manifest(manifest_path, manifest)
    registry._load_zoo.cache_clear()
    return entry
