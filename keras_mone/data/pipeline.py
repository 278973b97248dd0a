"""tf.data input pipelines of the training recipes (usable as input on every backend).

Sources: TFDS (``imagenet2012``, ``imagenet21k``, ..., prepared by the user),
an image folder (``root/<split>/<class>/*.png|jpg``) or the bundled cluttered
digits. Pre-processing follows AugReg (Steiner et al. 2021): train = inception
crop -> random flip -> RandAugment -> values in [-1, 1] -> batch -> MixUp;
eval = resize the shorter side to ``image_size * 256 / 224`` -> centre crop.

The train stream is ``shuffle(seed) -> repeat -> skip(start_step * batch)``
over *undecoded* examples, so a resumed run continues the same example order
from the step where it stopped, without decoding the skipped images.
"""

import dataclasses
import hashlib
import os
import re

import numpy as np

#: Augmentation levels of AugReg (+ ViViT SSv2): name -> (mixup alpha, RandAugment layers, magnitude).
AUGMENTATIONS = {
    "none": (0.0, 0, 0),
    "light1": (0.0, 2, 0),
    "light2": (0.2, 2, 10),
    "medium1": (0.2, 2, 15),
    "medium2": (0.5, 2, 15),
    "strong1": (0.5, 2, 20),
    "strong2": (0.8, 2, 20),
    # Not an AugReg level: ViViT's SSv2 recipe (MixUp 0.3, RandAugment(2, 20)).
    "vivit_ssv2": (0.3, 2, 20),
}
#: big_vision's RandAugment magnitudes run to 30; Keras' ``factor`` to 1.
RANDAUGMENT_MAX_MAGNITUDE = 30.0
PREPROCESSINGS = ("inception", "plain")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def _tf():
    try:
        import tensorflow as tf
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError(
            "Training on an image folder or TFDS uses a tf.data input pipeline, and tensorflow is not "
            'installed: pip install "keras-mone[tensorflow]" (tensorflow-cpu; it feeds every Keras backend, '
            "your models still run on the one KERAS_BACKEND names)."
        ) from error
    return tf


@dataclasses.dataclass
class Source:
    """Undecoded examples of one split, and how to decode them."""

    examples: object  # tf.data.Dataset of (raw image, int label)
    num_examples: int
    num_classes: int
    decode: object  # raw image -> float32 (H, W, 3) in [0, 255]
    labels: object = None  # int array of every label when known up front (checked then, see label_guard)
    split: str = ""  # the split's name, for messages


def label_message(label, num_classes, split):
    """``"label 12 in split 'train' is outside num_classes=10 (labels must be 0..9)"``."""
    return (
        f"label {label} in split {split!r} is outside num_classes={num_classes} "
        f"(labels must be 0..{num_classes - 1})"
    )


def check_labels(labels, num_classes, split):
    """Raises ``ValueError`` naming the first of ``labels`` outside ``0..num_classes - 1``
    (its one-hot row would be all zeros: a loss of 0 and nothing learned)."""
    labels = np.asarray(labels).reshape(-1)
    outside = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if outside.size:
        raise ValueError(
            f"{label_message(int(labels[outside[0]]), num_classes, split)}; outside: {outside.size} of "
            f"{labels.size} labels."
        )


def label_guard(source, num_classes):
    """``labels -> labels`` for a tf.data map that refuses labels outside ``num_classes``:
    a source whose labels are known (``source.labels``) is checked now (``ValueError``)
    and the guard does nothing; otherwise each label is asserted in the pipeline
    (``InvalidArgumentError`` when the batch holding it is read)."""
    split = getattr(source, "split", "")
    if getattr(source, "labels", None) is not None:
        check_labels(source.labels, num_classes, split)
        return lambda labels: labels
    tf = _tf()
    # no quotes: tf.debugging.Assert prints them escaped
    allowed = f"in split {split} is outside num_classes={num_classes} (labels must be 0..{num_classes - 1})"

    def guard(labels):
        flat = tf.reshape(labels, [-1])
        outside = tf.logical_or(flat < 0, flat >= num_classes)
        found = tf.boolean_mask(flat, outside)
        check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(outside)), ["label", found, allowed])
        with tf.control_dependencies([check]):
            return tf.identity(labels)

    return guard


def image_folder_source(root, split, class_names=None):
    """``root/<folder>/<class>/*.png|jpg``; classes are the sorted folder names.

    ``split`` is a folder name or a TFDS-style slice of one (``train[:99%]``,
    ``train[99%:]``, ``full[51200:]``; see ``split_files``).
    """
    tf = _tf()
    folder_name, bounds = parse_split(split)
    folder, class_names, class_dirs = class_folders(root, folder_name, class_names, "Image")
    files = []
    for label, directory in class_dirs:
        for file in sorted(os.listdir(directory)):
            if file.lower().endswith(IMAGE_SUFFIXES):
                files.append((os.path.join(directory, file), label))
    if not files:
        raise FileNotFoundError(f"No {IMAGE_SUFFIXES} images under {folder!r}.")
    total = len(files)
    files = split_files(files, bounds, folder)
    if not files:
        raise ValueError(f"Split {split!r} selects none of the {total} images under {folder!r}.")
    paths, labels = zip(*files)
    examples = tf.data.Dataset.from_tensor_slices((list(paths), np.asarray(labels, "int32")))
    examples = examples.map(lambda path, label: (tf.io.read_file(path), label))
    return Source(examples, len(paths), len(class_names), _decode_bytes, np.asarray(labels, "int32"), split)


_SPLIT = re.compile(r"([^\[\]]+)(?:\[(-?\d*)(%?):(-?\d*)(%?)\])?")


def parse_split(split):
    """``"train[:99%]"`` -> ``("train", ((None, ""), (99, "%")))``; ``"val"`` -> ``("val", None)``."""
    match = _SPLIT.fullmatch(split)
    if not match:
        raise ValueError(
            f"Split {split!r}: expected a folder name, optionally sliced TFDS-style as "
            "'name[start:stop]' with integer or percent bounds, e.g. 'train[:99%]', 'train[99%:]', 'full[51200:]'."
        )
    folder, start, start_unit, stop, stop_unit = match.groups()
    if start is None:
        return folder, None
    return folder, ((int(start) if start else None, start_unit), (int(stop) if stop else None, stop_unit))


def split_files(files, bounds, folder):
    """The slice ``bounds`` of ``files`` (``[(path, label)]``), TFDS-style.

    The files are put in a fixed order first (by an MD5 of their path relative to
    ``folder``: shuffled across classes, the same on every machine), so any slice
    holds every class in about its share; percent bounds round to the closest
    file, as TFDS does; ``[:99%]`` and ``[99%:]`` are complementary.
    """
    if bounds is None:
        return files
    files = sorted(files, key=lambda item: hashlib.md5(os.path.relpath(item[0], folder).encode()).hexdigest())

    def index(bound):
        value, unit = bound
        if value is None:
            return None
        return round(value * len(files) / 100) if unit else value

    return files[slice(index(bounds[0]), index(bounds[1]))]


def class_folders(root, split, class_names, kind):
    """``(split folder, class names, [(label, class folder)])`` of ``root/split/<class>/``.

    Class names default to the sorted sub-folder names; listed classes without
    a folder are skipped (their label is kept). ``kind`` names the folder in the
    error raised when the split is missing.
    """
    folder = os.path.join(root, split)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{kind} folder split {folder!r} does not exist.")
    class_names = class_names or sorted(
        d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))
    )
    class_dirs = [
        (label, os.path.join(folder, name))
        for label, name in enumerate(class_names)
        if os.path.isdir(os.path.join(folder, name))
    ]
    return folder, class_names, class_dirs


def tfds_source(name, split, data_dir=None, seed=0):
    """A TFDS split (images left encoded until after shuffling and skipping)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as error:
        raise ImportError(
            f"dataset='tfds' ({name!r}) needs tensorflow-datasets: "
            "`pip install tensorflow-datasets` (or `pip install keras-mone[tfds]`), "
            "and the dataset prepared under `data_dir` (see the TFDS docs for ImageNet)."
        ) from error
    builder = tfds.builder(name, data_dir=data_dir or None)
    examples = builder.as_dataset(
        split=split,
        shuffle_files=True,
        decoders={"image": tfds.decode.SkipDecoding()},
        read_config=tfds.ReadConfig(shuffle_seed=seed),
    )
    examples = examples.map(lambda e: (e["image"], e["label"]))
    info = builder.info
    return Source(
        examples, info.splits[split].num_examples, info.features["label"].num_classes, _decode_bytes,
        split=split,
    )


def cluttered_digits_source(split, image_size, digit_scale, clutter, samples_per_digit, seed, position_step=1):
    """A fixed set of the bundled cluttered digits (``keras_mone.data.load_cluttered_digits``)."""
    tf = _tf()
    from keras_mone.data.cluttered_digits import NUM_CLASSES, load_cluttered_digits

    images, labels = load_cluttered_digits(
        samples_per_digit=samples_per_digit, split=split, image_size=image_size,
        digit_scale=digit_scale, clutter=clutter, seed=seed, position_step=position_step,
    )
    examples = tf.data.Dataset.from_tensor_slices(
        (images.astype("float32") * 255.0, labels.astype("int32"))
    )
    return Source(examples, len(images), NUM_CLASSES, lambda image: image, labels.astype("int32"), split)


def _decode_bytes(raw):
    tf = _tf()
    image = tf.io.decode_image(raw, channels=3, expand_animations=False)
    return tf.cast(image, "float32")


def train_dataset(
    source, image_size, batch_size, num_classes, preprocessing="inception", augmentation="none",
    shuffle_buffer=50_000, start_step=0, seed=0,
):
    """Endless, shuffled, augmented batches ``(images in [-1, 1], one-hot labels)``.

    ``start_step`` skips that many batches of the stream (resuming a run).
    """
    tf = _tf()
    import keras

    from keras_mone.data.augment.inception_crop import InceptionCrop
    from keras_mone.data.augment.mixup import RolledMixUp

    mixup_alpha, num_ops, magnitude = AUGMENTATIONS[augmentation]
    crop = InceptionCrop(image_size, image_size, seed=seed) if preprocessing == "inception" else None
    flip = keras.layers.RandomFlip("horizontal", seed=seed + 1) if preprocessing == "inception" else None
    randaugment = None
    if num_ops:
        randaugment = keras.layers.RandAugment(
            value_range=(0, 255), num_ops=num_ops, factor=magnitude / RANDAUGMENT_MAX_MAGNITUDE,
            seed=seed + 2,
        )
    mixup = RolledMixUp(mixup_alpha, seed=seed + 3) if mixup_alpha else None

    def preprocess(raw, label):
        image = source.decode(raw)
        if crop is not None:
            image = crop(image)
        else:
            image = _resize(image, image_size)
        if flip is not None:
            image = flip(image)
        if randaugment is not None:
            image = randaugment(image)
        return _scale(tf.ensure_shape(image, (image_size, image_size, 3))), label

    return training_stream(
        source, preprocess, batch_size, num_classes, mixup, shuffle_buffer, seed, start_step
    )


def eval_dataset(source, image_size, batch_size, num_classes, preprocessing="inception", full_batches=False):
    """Batches ``(images in [-1, 1], one-hot labels)`` of one pass over ``source``;
    ``full_batches``: ``(images, labels, sample weights)`` padded as ``full_batches`` does."""
    tf = _tf()
    guard = label_guard(source, num_classes)

    def preprocess(raw, label):
        image = source.decode(raw)
        if preprocessing == "inception":
            image = _resize_shorter_and_crop(image, image_size)
        else:
            image = _resize(image, image_size)
        image = tf.ensure_shape(image, (image_size, image_size, 3))
        return _scale(image), tf.one_hot(guard(label), num_classes)

    ds = source.examples.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
    if full_batches:
        return pad_to_full_batches(ds, source.num_examples, batch_size).prefetch(tf.data.AUTOTUNE)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def padding_weight(num_examples, batch_size):
    """``(padded count, weight of a real example)`` of ``num_examples`` padded to
    whole batches. Keras averages the loss over whole batches (padding
    included), so real examples weigh ``padded / num_examples``: the loss and
    every weighted metric are then the means over the real examples alone."""
    padded = -(-num_examples // batch_size) * batch_size
    return padded, padded / num_examples


def pad_to_full_batches(ds, num_examples, batch_size):
    """``(x, y)`` examples -> full batches ``(x, y, sample_weight)``: the last batch is
    filled up with repeats of the first examples at weight 0 (every device gets an
    equal share; every example counts once)."""
    tf = _tf()
    padded, weight = padding_weight(num_examples, batch_size)

    def weigh(index, example):
        return (*example, tf.where(index < num_examples, tf.constant(weight, "float32"), 0.0))

    ds = ds.repeat().take(padded).enumerate().map(weigh)
    return ds.batch(batch_size, drop_remainder=True)


def _scale(image):
    return image / 127.5 - 1.0


def _resize(image, size):
    tf = _tf()
    if image.shape[0] == size and image.shape[1] == size:
        return image
    return tf.image.resize(image, (size, size))


def _resize_shorter_and_crop(image, size):
    """Shorter side to ``size * 256 / 224``, then the central ``size x size`` crop."""
    tf = _tf()
    shape = tf.cast(tf.shape(image)[:2], "float32")
    scale = (size * 256.0 / 224.0) / tf.reduce_min(shape)
    new = tf.cast(tf.round(shape * scale), "int32")
    image = tf.image.resize(image, new)
    top = (new[0] - size) // 2
    left = (new[1] - size) // 2
    return image[top : top + size, left : left + size]


def training_stream(source, preprocess, batch_size, num_classes, mixup, shuffle_buffer, seed, start_step):
    """Shuffled, repeated, preprocessed batches of one-hot labelled examples, MixUp applied
    per batch; the first ``start_step`` batches are skipped before decoding (resume).
    Labels outside ``num_classes`` are refused (``label_guard``)."""
    tf = _tf()
    guard = label_guard(source, num_classes)

    def finish(inputs, labels):
        labels = tf.one_hot(guard(labels), num_classes)
        if mixup is not None:
            mixed = mixup({"images": inputs, "labels": labels})
            inputs, labels = mixed["images"], mixed["labels"]
        return inputs, labels

    buffer = max(1, min(shuffle_buffer, source.num_examples))
    ds = source.examples.shuffle(buffer, seed=seed, reshuffle_each_iteration=True).repeat()
    if start_step:
        ds = ds.skip(int(start_step) * batch_size)
    ds = ds.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(batch_size, drop_remainder=True).map(finish, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)
