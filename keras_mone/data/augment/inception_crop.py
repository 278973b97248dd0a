"""Inception crop (Szegedy et al. 2015), the train-time crop of the AugReg recipes.

Keras has no RandomResizedCrop layer, so this is one: a random box covering
5-100% of the image area with aspect ratio 3/4-4/3 (AugReg, Steiner et al.
2021, via big_vision's ``inception_crop``) is resized bilinearly to the output
size.
"""

import math

from keras_mone.layers.config import ConfigMixin, register
from keras_mone.data.augment.data_layer import DataLayer


@register
class InceptionCrop(ConfigMixin, DataLayer):
    """Random-area, random-aspect crop resized to ``(height, width)``.

    Up to ``max_attempts`` boxes are drawn per image (area fraction uniform in
    ``area_range``, log aspect ratio uniform in ``log(aspect_ratio_range)``,
    aspect = box width / box height in pixels); the first one that fits is
    used, else the whole image (as ``tf.image.sample_distorted_bounding_box``).
    The box's position is uniform. Resizing is bilinear with half-pixel
    centres and no antialiasing, and every output value is a convex
    combination of input values, so the value range is kept.

    It is a keras_mone data layer: it runs on numpy or backend tensors on every
    backend, and inside ``tf.data`` pipelines whatever the backend (its math
    is ``self.ops``: ``keras.ops``, or TensorFlow's inside ``tf.data``). Input is
    one image ``(H, W, C)`` or a batch ``(B, H, W, C)``, channels last; each
    image gets its own box. With ``training=False`` the whole image is resized.

    Args:
        height, width: output size.
        area_range: range of the box area as a fraction of the image area.
        aspect_ratio_range: range of box width / box height.
        max_attempts: boxes drawn per image before falling back to the image.
        seed: seed of the random boxes.
    """

    def __init__(
        self,
        height,
        width,
        area_range=(0.05, 1.0),
        aspect_ratio_range=(3 / 4, 4 / 3),
        max_attempts=10,
        seed=None,
        **kwargs,
    ):
        super().__init__(seed=seed, **kwargs)
        area_range, aspect_ratio_range = tuple(area_range), tuple(aspect_ratio_range)
        if not 0 < area_range[0] <= area_range[1] <= 1:
            raise ValueError(f"`area_range` must satisfy 0 < low <= high <= 1, got {area_range}.")
        if not 0 < aspect_ratio_range[0] <= aspect_ratio_range[1]:
            raise ValueError(f"`aspect_ratio_range` must satisfy 0 < low <= high, got {aspect_ratio_range}.")
        self.height = int(height)
        self.width = int(width)
        self.area_range = area_range
        self.aspect_ratio_range = aspect_ratio_range
        self.max_attempts = int(max_attempts)

    def sample_boxes(self, batch_size, image_height, image_width):
        """``(top, left, box_height, box_width)``, each ``(batch_size,)`` float32 pixels."""
        b = self.ops
        image_height = b.cast(image_height, "float32")
        image_width = b.cast(image_width, "float32")
        shape = (batch_size, self.max_attempts)
        area = b.random.uniform(shape, *self.area_range) * image_height * image_width
        log_low, log_high = (math.log(r) for r in self.aspect_ratio_range)
        ratio = b.numpy.exp(b.random.uniform(shape, log_low, log_high))
        box_w = b.numpy.sqrt(area * ratio)
        box_h = b.numpy.sqrt(area / ratio)
        fits = b.numpy.logical_and(box_w <= image_width, box_h <= image_height)
        first = b.numpy.argmax(b.cast(fits, "int32"), axis=1)[:, None]
        found = b.numpy.any(fits, axis=1)
        box_h = b.numpy.where(found, b.numpy.take_along_axis(box_h, first, axis=1)[:, 0], image_height)
        box_w = b.numpy.where(found, b.numpy.take_along_axis(box_w, first, axis=1)[:, 0], image_width)
        top = b.random.uniform((batch_size,)) * (image_height - box_h)
        left = b.random.uniform((batch_size,)) * (image_width - box_w)
        return top, left, box_h, box_w

    def call(self, images, training=True):
        b = self.ops
        images = b.cast(images, self.compute_dtype)
        unbatched = len(images.shape) == 3
        if unbatched:
            images = b.numpy.expand_dims(images, 0)
        shape = b.shape(images)
        batch, height, width = shape[0], shape[1], shape[2]
        if training:
            top, left, box_h, box_w = self.sample_boxes(batch, height, width)
        else:
            zeros = b.numpy.zeros((batch,), "float32")
            ones = b.numpy.ones((batch,), "float32")
            top, left = zeros, zeros
            box_h, box_w = ones * b.cast(height, "float32"), ones * b.cast(width, "float32")
        rows = _sample_axis(b, images, top, box_h, self.height, axis_size=height)
        # Rows are done: put the width axis first (after batch) and repeat.
        rows = b.numpy.transpose(rows, (0, 2, 1, 3))
        out = _sample_axis(b, rows, left, box_w, self.width, axis_size=width)
        out = b.numpy.transpose(out, (0, 2, 1, 3))
        return out[0] if unbatched else out

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-3], self.height, self.width, input_shape[-1])


def _sample_axis(b, images, start, length, size, axis_size):
    """Bilinear samples of axis 1 of ``images`` (B, A, X, C) at ``size`` points
    evenly covering ``[start, start + length)`` per image (half-pixel centres)."""
    batch = b.shape(images)[0]
    steps = (b.cast(b.numpy.arange(size), "float32") + 0.5) / size
    coords = start[:, None] + steps[None, :] * length[:, None] - 0.5  # (B, size)
    last = b.cast(axis_size, "float32") - 1.0
    coords = b.numpy.clip(coords, 0.0, last)
    low = b.numpy.floor(coords)
    frac = b.cast(coords - low, images.dtype)[:, :, None, None]
    low = b.cast(low, "int32")
    high = b.numpy.minimum(low + 1, b.cast(axis_size, "int32") - 1)
    # Gather rows of every image from the flattened (B * A, X, C) array.
    offsets = b.numpy.arange(batch, dtype="int32")[:, None] * b.cast(axis_size, "int32")
    flat = b.numpy.reshape(images, (-1, b.shape(images)[2], b.shape(images)[3]))

    def gather(indices):
        picked = b.numpy.take(flat, b.numpy.reshape(indices + offsets, (-1,)), axis=0)
        return b.numpy.reshape(picked, (batch, size, b.shape(images)[2], b.shape(images)[3]))

    return gather(low) * (1.0 - frac) + gather(high) * frac
