"""Tubelet embedding of ViViT (Arnab et al. 2021, Sec. 3.2): videos to per-frame tokens."""

import keras
import numpy as np
from keras import ops

from keras_mone.layers.config import ConfigMixin, register
from keras_mone.layers.patch_embedding import check_floating, strided_projection, validate_image_geometry
from keras_mone.layers.token_sequence import (
    add_sequence_weights,
    prepend_class_token_and_add_positions,
)

INFLATION_METHODS = ("central_frame", "average")


@register
class TubeletEmbedding(ConfigMixin, keras.layers.Layer):
    """Videos ``(batch, T, H, W, C)`` to tokens ``(batch * T/t, N [+1], D)``.

    A non-overlapping 3D convolution with ``t x p x p`` tubelets
    (``tubelet_size`` x ``patch_size`` x ``patch_size``) gives ``T/t`` "frame
    indices" of ``N = (H/p)(W/p)`` tokens each. For the factorised encoder
    (ViViT Model 3) every frame index is an independent sequence for the
    spatial transformer, so frame indices are folded into the batch: row
    ``b * T/t + f`` holds frame index ``f`` of clip ``b``. Each sequence gets
    the (shared) spatial class token in front when ``use_class_token`` and the
    spatial position embeddings, shared by all frame indices.

    Inputs are checked against ``num_frames``, ``image_size`` and
    ``num_channels`` with errors that name the argument.
    """

    def __init__(
        self,
        num_frames,
        image_size,
        patch_size,
        hidden_dim,
        tubelet_size=2,
        num_channels=3,
        use_class_token=True,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.image_size = validate_image_geometry(image_size, patch_size)
        self.num_frames = validate_frame_geometry(num_frames, tubelet_size)
        self.patch_size = patch_size
        self.hidden_dim = hidden_dim
        self.tubelet_size = tubelet_size
        self.num_channels = num_channels
        self.use_class_token = use_class_token
        self.projection = keras.layers.Conv3D(
            hidden_dim,
            (tubelet_size, patch_size, patch_size),
            strides=(tubelet_size, patch_size, patch_size),
            padding="valid",
            kernel_initializer=keras.initializers.LecunNormal(),
            dtype=self.dtype_policy,
            name="projection",
        )

    @property
    def grid_size(self):
        return (self.image_size[0] // self.patch_size, self.image_size[1] // self.patch_size)

    @property
    def num_frame_indices(self):
        """``T / t``: sequences per clip seen by the spatial transformer."""
        return self.num_frames // self.tubelet_size

    @property
    def num_tokens(self):
        """Tokens per frame index, class token included."""
        return self.grid_size[0] * self.grid_size[1] + int(self.use_class_token)

    def build(self, input_shape):
        self.projection.build((None, self.num_frames, *self.image_size, self.num_channels))
        add_sequence_weights(self, self.num_tokens, self.hidden_dim, self.use_class_token)

    def check_inputs(self, videos):
        """Raises a ``ValueError`` if ``videos`` (any array with a shape and dtype) do not fit."""
        check_videos(videos, self.num_frames, self.image_size, self.num_channels)

    def call(self, videos, training=None):
        self.check_inputs(videos)
        tokens = strided_projection(self.projection, videos, training)  # (batch, T/t, H/p, W/p, D)
        patches = self.grid_size[0] * self.grid_size[1]
        tokens = ops.reshape(tokens, (-1, patches, self.hidden_dim))
        return prepend_class_token_and_add_positions(tokens, self.class_token, self.position_embedding)

    def compute_output_shape(self, input_shape):
        batch = None if input_shape[0] is None else input_shape[0] * self.num_frame_indices
        return (batch, self.num_tokens, self.hidden_dim)


def inflate_patch_kernel(kernel, tubelet_size, method="central_frame"):
    """A 2D patch kernel ``(p, p, C, D)`` as a 3D tubelet kernel ``(t, p, p, C, D)``.

    ``"central_frame"`` (ViViT Sec. 3.4) puts the 2D kernel at temporal index
    ``t // 2`` and zeros elsewhere, so a static clip embeds exactly as its
    frames do in the image model. ``"average"`` (filter inflation, I3D)
    repeats ``kernel / t`` over time, which gives the same result on a static
    clip but mixes frames of a moving one.
    """
    kernel = np.asarray(kernel)
    if kernel.ndim != 4:
        raise ValueError(f"`kernel` must be a 2D conv kernel (p, p, C, D), got shape {kernel.shape}.")
    if not isinstance(tubelet_size, int) or tubelet_size < 1:
        raise ValueError(f"`tubelet_size` must be a positive int, got {tubelet_size!r}.")
    if method == "central_frame":
        inflated = np.zeros((tubelet_size, *kernel.shape), kernel.dtype)
        inflated[tubelet_size // 2] = kernel
        return inflated
    if method == "average":
        return np.repeat(kernel[None] / tubelet_size, tubelet_size, axis=0).astype(kernel.dtype)
    raise ValueError(f"`method` must be one of {INFLATION_METHODS}, got {method!r}.")


def validate_frame_geometry(num_frames, tubelet_size):
    """Returns ``num_frames`` or raises naming the bad argument."""
    if not isinstance(tubelet_size, int) or tubelet_size <= 0:
        raise ValueError(f"`tubelet_size` must be a positive int, got {tubelet_size!r}.")
    if not isinstance(num_frames, int) or num_frames <= 0 or num_frames % tubelet_size:
        raise ValueError(
            f"`num_frames` must be a positive multiple of `tubelet_size` ({tubelet_size}), "
            f"got {num_frames!r}."
        )
    return num_frames


def check_videos(videos, num_frames, image_size, num_channels):
    """Raises a ``ValueError`` naming ``videos`` if its static shape or dtype does not fit."""
    check_floating("videos", videos)
    shape = tuple(videos.shape)
    if len(shape) != 5:
        raise ValueError(
            f"`videos` must have shape (batch, frames, height, width, channels), got {shape}."
        )
    if shape[4] is not None and shape[4] != num_channels:
        raise ValueError(
            f"`videos` has {shape[4]} channels but the model expects `num_channels`={num_channels}."
        )
    if shape[1] is not None and shape[1] != num_frames:
        raise ValueError(
            f"`videos` has {shape[1]} frames but the model was built for `num_frames`={num_frames}; "
            "sample clips of that length or build the model with "
            f"num_frames={shape[1]} (a multiple of its tubelet size)."
        )
    if None not in shape[2:4] and tuple(shape[2:4]) != tuple(image_size):
        raise ValueError(
            f"`videos` frames are {shape[2]}x{shape[3]} but the model was built for "
            f"`image_size`={tuple(image_size)}; resize the frames or build the model with "
            f"image_size={shape[2]}."
        )
