"""Where a recipe's examples come from: bundled digits (fixed sets or fresh streams), folders, TFDS."""

import os

from keras_mone.data import pipeline, video_pipeline
from keras_mone.data.cluttered_digits import NUM_CLASSES
from keras_mone.data.digit_tasks import cluttered_digits_arguments, moving_digits_arguments
from keras_mone.recipes import schema


def _video_sources(recipe):
    splits = [recipe["train_split"]] + ([recipe["eval_split"]] if recipe["eval_split"] else [])
    if recipe["dataset"] == "video_folder":
        root = recipe["data_dir"]
        train = video_pipeline.video_folder_source(root, splits[0])
        classes = sorted(d for d in os.listdir(os.path.join(root, splits[0])) if os.path.isdir(os.path.join(root, splits[0], d)))
        test = video_pipeline.video_folder_source(root, splits[1], classes) if len(splits) > 1 else None
        return train, test
    train = None  # fresh renderings: the stream of ``digits_stream`` trains
    if not recipe["fresh_renderings"]:
        train = video_pipeline.moving_digits_source(**moving_digits_arguments(recipe, "train"))
    test = None
    if recipe["eval_split"]:
        test = video_pipeline.moving_digits_source(**moving_digits_arguments(recipe, "test"))
    return train, test


def digits_stream(recipe):
    """The recipe's stream of fresh training renderings (``fresh_renderings = true``)
    of cluttered digits or moving digits; one-hot labels ``num_classes`` wide
    (0 = the task's classes)."""
    from keras_mone.data.digit_stream import ClutteredDigitsStream, MovingDigitsStream

    arguments = cluttered_digits_arguments(recipe, "train")
    del arguments["split"]
    batch, num_classes = recipe["batch_size"], recipe["num_classes"] or None
    try:
        if recipe["dataset"] == "moving_digits":
            return MovingDigitsStream(
                batch, num_classes=num_classes, num_frames=recipe["num_frames"],
                frame_stride=recipe["frame_stride"], target=recipe["digits_target"],
                speed_step=recipe["speed_step"], **arguments,
            )
        return ClutteredDigitsStream(batch, num_classes=num_classes or NUM_CLASSES, **arguments)
    except ValueError as error:  # e.g. num_classes below the task's classes
        raise schema.RecipeError(f"{recipe['dataset']} recipe: {error}") from error


def evaluates_in_memory(recipe):
    """Whether the recipe's eval split is held in memory (cluttered digits, plain
    preprocessing) rather than read through tf.data."""
    return (
        recipe["dataset"] == "cluttered_digits" and recipe["preprocessing"] == "plain"
        and bool(recipe["eval_split"])
    )


def in_memory_eval_data(recipe, num_classes, full_batches=False):
    """The eval split of a cluttered-digits recipe with plain preprocessing as
    ``ArrayBatches`` in memory (no tf.data), the values the tf.data pipeline
    gives (``x * 255 / 127.5 - 1``, one-hot labels); ``None`` for other recipes.
    ``full_batches``: padded, weighted batches for several devices (``ArrayBatches``)."""
    if not evaluates_in_memory(recipe):
        return None
    import numpy as np

    from keras_mone.data.cluttered_digits import load_cluttered_digits
    from keras_mone.data.in_memory import ArrayBatches

    images, labels = load_cluttered_digits(**cluttered_digits_arguments(recipe, "test"))
    try:
        pipeline.check_labels(labels, num_classes, recipe["eval_split"])
    except ValueError as error:
        raise schema.RecipeError(f"{recipe['dataset']} recipe: {error}") from error
    images = images.astype("float32") * np.float32(255.0) / np.float32(127.5) - np.float32(1.0)
    targets = np.eye(num_classes, dtype="float32")[labels]
    return ArrayBatches(images, targets, recipe["eval_batch_size"] or recipe["batch_size"], full_batches)


def check_source_labels(source, num_classes, name):
    """Raises ``RecipeError`` when a source whose labels are known up front (folders,
    bundled arrays) holds one outside ``num_classes``; others are checked as they stream."""
    if source is None or getattr(source, "labels", None) is None:
        return
    try:
        pipeline.check_labels(source.labels, num_classes, source.split)
    except ValueError as error:
        raise schema.RecipeError(
            f"recipe {name!r}: {error} The split has {source.num_classes} classes: set key 'num_classes' to 0 "
            f"(the data's) or to {source.num_classes} or more."
        ) from error


def data_sources(recipe):
    """``(train source or None when a digits stream trains, eval source or None when
    there is none or it is held in memory, ``in_memory_eval_data``)``."""
    dataset = recipe["dataset"]
    if dataset in schema.VIDEO_DATASETS:
        return _video_sources(recipe)
    if dataset == "cluttered_digits":
        train = None  # fresh renderings: the stream of ``digits_stream`` trains
        if not recipe["fresh_renderings"]:
            train = pipeline.cluttered_digits_source(**cluttered_digits_arguments(recipe, "train"))
        test = None
        if recipe["eval_split"] and not evaluates_in_memory(recipe):
            test = pipeline.cluttered_digits_source(**cluttered_digits_arguments(recipe, "test"))
        return train, test
    if dataset == "image_folder":
        train = _folder_split(recipe, "train_split")
        folder = pipeline.parse_split(recipe["train_split"])[0]
        classes = pipeline.class_folders(recipe["data_dir"], folder, None, "Image")[1]
        test = _folder_split(recipe, "eval_split", classes) if recipe["eval_split"] else None
        return train, test
    train = _tfds_split(recipe, "train_split")
    test = _tfds_split(recipe, "eval_split") if recipe["eval_split"] else None
    return train, test


def _folder_split(recipe, key, classes=None):
    try:
        return pipeline.image_folder_source(recipe["data_dir"], recipe[key], classes)
    except ValueError as error:  # a malformed split, or one that selects no image
        raise schema.RecipeError(f"key {key!r}: {error}") from error


class MissingExtra(schema.RecipeError, ImportError):
    """A recipe needs a package that is not installed (the CLI prints it without a traceback)."""


def _tfds_split(recipe, key):
    try:
        import tensorflow_datasets  # noqa: F401
    except ImportError as error:
        raise MissingExtra(
            f"dataset='tfds' (tfds_name={recipe['tfds_name']!r}) needs tensorflow-datasets: "
            '`pip install "keras-mone[tfds]"` (or `pip install tensorflow-datasets`), and the dataset '
            "prepared under data_dir (see the TFDS docs for ImageNet); or use dataset=image_folder "
            "data_dir=ROOT (ROOT/<split>/<class>/*.jpg)."
        ) from error
    return pipeline.tfds_source(recipe["tfds_name"], recipe[key], recipe["data_dir"], recipe["seed"])
