"""tf.data input pipelines of the video recipes (ViViT / MoNE-ViViT), on every backend.

Sources: a folder of extracted frames (``root/<split>/<class>/<clip>/*.jpg|png``,
frames in file-name order) or the bundled moving digits. Clips stay
undecoded until after shuffling and skipping, as in ``pipeline``.

Temporal sampling (DMVR / scenic ViViT): ``num_frames`` frames ``frame_stride``
apart, from a random start (train) or centred in the clip (eval); a clip shorter
than that span is looped.

Spatial pre-processing, the same for every frame of a clip:

* ``"scale_jitter"``: train = shorter side to ``image_size * 256 / 224`` times a
  factor drawn from ``scale_jitter`` (ViViT K400: 0.9-1.33) -> random crop ->
  optional horizontal flip -> RandAugment; eval = shorter side to
  ``image_size * 256 / 224`` -> centre crop;
* ``"plain"``: frames resized to ``image_size`` (train: then the flip and
  RandAugment), for data already at that size (moving digits).

Values end in ``[-1, 1]``; labels are one-hot; MixUp mixes whole clips.
"""

import dataclasses
import os

import numpy as np

from keras_mone.data.pipeline import (
    AUGMENTATIONS,
    IMAGE_SUFFIXES,
    RANDAUGMENT_MAX_MAGNITUDE,
    _scale,
    _tf,
    class_folders,
    label_guard,
    pad_to_full_batches,
    training_stream,
)

VIDEO_PREPROCESSINGS = ("scale_jitter", "plain")
#: Shorter side before cropping, relative to the crop (256 for a 224 crop).
RESIZE_RATIO = 256.0 / 224.0


@dataclasses.dataclass
class VideoSource:
    """Undecoded clips of one split.

    ``examples`` yields ``(raw clip, int label)``; ``length(raw)`` is the
    clip's frame count and ``frames(raw, indices)`` decodes the frames at
    ``indices`` to float32 ``(len(indices), H, W, 3)`` in ``[0, 255]``.
    """

    examples: object
    num_examples: int
    num_classes: int
    length: object
    frames: object
    labels: object = None  # int array of every label when known up front (pipeline.label_guard)
    split: str = ""


def video_folder_source(root, split, class_names=None):
    """``root/split/<class>/<clip>/<frame>.jpg|png``; classes are the sorted folder names.

    A clip is a folder of frames, ordered by file name (the usual layout of
    extracted Kinetics / SSv2 frames, e.g. ``000001.jpg``).
    """
    tf = _tf()
    folder, class_names, class_dirs = class_folders(root, split, class_names, "Video")
    clips, labels = [], []
    for label, class_dir in class_dirs:
        for clip in sorted(os.listdir(class_dir)):
            clip_dir = os.path.join(class_dir, clip)
            if not os.path.isdir(clip_dir):
                continue
            frames = sorted(f for f in os.listdir(clip_dir) if f.lower().endswith(IMAGE_SUFFIXES))
            if frames:
                clips.append("\n".join(os.path.join(clip_dir, f) for f in frames))
                labels.append(label)
    if not clips:
        raise FileNotFoundError(f"No clip folders of {IMAGE_SUFFIXES} frames under {folder!r}.")
    examples = tf.data.Dataset.from_tensor_slices((clips, np.asarray(labels, "int32")))

    def length(raw):
        return tf.size(tf.strings.split(raw, "\n"))

    def frames(raw, indices):
        paths = tf.gather(tf.strings.split(raw, "\n"), indices)
        decoded = tf.map_fn(
            lambda path: tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False),
            paths, fn_output_signature=tf.TensorSpec((None, None, 3), tf.uint8),
        )
        return tf.cast(decoded, "float32")

    return VideoSource(examples, len(clips), len(class_names), length, frames, np.asarray(labels, "int32"), split)


def moving_digits_source(split, num_frames, image_size, digit_scale, clutter, samples_per_digit, target, seed,
                         **render_args):
    """The bundled moving digits (``keras_mone.data.load_moving_digits``), ``num_frames`` per clip;
    ``render_args`` (``position_step``, ``speed_step``, ...) go to ``load_moving_digits``."""
    tf = _tf()
    from keras_mone.data.moving_digits import MOVING_TARGETS, load_moving_digits

    videos, labels = load_moving_digits(
        num_frames=num_frames, image_size=image_size, digit_scale=digit_scale, clutter=clutter,
        samples_per_digit=samples_per_digit, target=target, seed=seed, split=split, **render_args,
    )
    examples = tf.data.Dataset.from_tensor_slices((videos * 255.0, labels.astype("int32")))
    return VideoSource(
        examples, len(videos), MOVING_TARGETS[target],
        length=lambda raw: tf.shape(raw)[0],
        frames=lambda raw, indices: tf.gather(raw, indices),
        labels=labels.astype("int32"), split=split,
    )


def sample_frame_indices(length, num_frames, frame_stride, training, seed=None):
    """``num_frames`` indices ``frame_stride`` apart into a clip of ``length`` frames.

    The start is uniform over the valid starts (train) or centres the span
    (eval); indices past the end wrap around (a short clip is looped).
    """
    tf = _tf()
    span = (num_frames - 1) * frame_stride + 1
    last_start = tf.maximum(length - span, 0)
    if training:
        start = tf.random.uniform((), 0, last_start + 1, dtype="int32", seed=seed)
    else:
        start = last_start // 2
    return (start + tf.range(num_frames) * frame_stride) % length


def _resize_shorter(frames, shorter):
    tf = _tf()
    shape = tf.cast(tf.shape(frames)[1:3], "float32")
    new = tf.cast(tf.math.ceil(shape * shorter / tf.reduce_min(shape)), "int32")
    return tf.image.resize(frames, new)


def _centre_crop(frames, size):
    tf = _tf()
    height, width = tf.shape(frames)[1], tf.shape(frames)[2]
    top, left = (height - size) // 2, (width - size) // 2
    return frames[:, top : top + size, left : left + size]


def train_dataset(
    source, num_frames, image_size, batch_size, num_classes, frame_stride=1, preprocessing="scale_jitter",
    scale_jitter=(0.9, 1.33), flip=True, augmentation="none", shuffle_buffer=10_000, start_step=0, seed=0,
):
    """Endless, shuffled, augmented batches ``(clips (B, T, S, S, 3) in [-1, 1], one-hot labels)``.

    ``start_step`` skips that many batches of the stream (resuming a run).
    RandAugment draws its ops once per clip; Keras draws their magnitudes per
    frame.
    """
    tf = _tf()
    import keras

    from keras_mone.data.augment.mixup import RolledMixUp

    mixup_alpha, num_ops, magnitude = AUGMENTATIONS[augmentation]
    randaugment = None
    if num_ops:
        randaugment = keras.layers.RandAugment(
            value_range=(0, 255), num_ops=num_ops, factor=magnitude / RANDAUGMENT_MAX_MAGNITUDE, seed=seed + 2,
        )
    mixup = RolledMixUp(mixup_alpha, seed=seed + 3) if mixup_alpha else None
    low, high = scale_jitter

    def preprocess(raw, label):
        indices = sample_frame_indices(source.length(raw), num_frames, frame_stride, True, seed=seed)
        frames = source.frames(raw, indices)
        if preprocessing == "scale_jitter":
            factor = tf.random.uniform((), low, high, seed=seed + 4)
            shorter = tf.maximum(image_size * RESIZE_RATIO * factor, float(image_size))
            frames = _resize_shorter(frames, shorter)
            frames = tf.image.random_crop(frames, (num_frames, image_size, image_size, 3), seed=seed + 5)
        else:
            frames = tf.image.resize(frames, (image_size, image_size))
        if flip:
            frames = tf.cond(
                tf.random.uniform((), seed=seed + 1) < 0.5, lambda: tf.reverse(frames, axis=[2]), lambda: frames
            )
        if randaugment is not None:
            frames = randaugment(frames)
        frames = tf.ensure_shape(frames, (num_frames, image_size, image_size, 3))
        return _scale(frames), label

    return training_stream(
        source, preprocess, batch_size, num_classes, mixup, shuffle_buffer, seed, start_step
    )


def eval_dataset(
    source, num_frames, image_size, batch_size, num_classes, frame_stride=1, preprocessing="scale_jitter",
    full_batches=False,
):
    """One deterministic pass: centred frames, shorter side ``image_size * 256/224`` and
    centre crop (``"scale_jitter"``) or a plain resize; ``(clips in [-1, 1], one-hot)``,
    or with ``full_batches`` padded batches with sample weights (``pipeline.pad_to_full_batches``)."""
    tf = _tf()
    guard = label_guard(source, num_classes)

    def preprocess(raw, label):
        indices = sample_frame_indices(source.length(raw), num_frames, frame_stride, False)
        frames = source.frames(raw, indices)
        if preprocessing == "scale_jitter":
            frames = _centre_crop(_resize_shorter(frames, image_size * RESIZE_RATIO), image_size)
        else:
            frames = tf.image.resize(frames, (image_size, image_size))
        frames = tf.ensure_shape(frames, (num_frames, image_size, image_size, 3))
        return _scale(frames), tf.one_hot(guard(label), num_classes)

    ds = source.examples.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
    if full_batches:
        return pad_to_full_batches(ds, source.num_examples, batch_size).prefetch(tf.data.AUTOTUNE)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)
