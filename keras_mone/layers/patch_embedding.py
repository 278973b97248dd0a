"""Patch embedding of ViT: non-overlapping patches, optional class token, positions."""

import keras
import numpy as np
from keras import ops

from keras_mone.arguments import integer
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.layers.platform_forms import patches_form
from keras_mone.layers.token_sequence import (
    add_sequence_weights,
    prepend_class_token_and_add_positions,
)


@register
class PatchEmbedding(ConfigMixin, keras.layers.Layer):
    """Images ``(batch, H, W, C)`` to tokens ``(batch, N [+1], D)``.

    A ``patch_size`` x ``patch_size`` convolution with the same stride, an
    optional learned class token in front, and learned position embeddings
    (``use_position_embedding=False``: none, as MLP-Mixer).
    Inputs are checked against ``image_size`` and ``num_channels`` with an
    error that names the argument.
    """

    def __init__(
        self, image_size, patch_size, hidden_dim, num_channels=3, use_class_token=False,
        use_position_embedding=True, **kwargs
    ):
        super().__init__(**kwargs)
        self.image_size = validate_image_geometry(image_size, patch_size)
        self.patch_size = patch_size
        self.hidden_dim = hidden_dim
        self.num_channels = num_channels
        self.use_class_token = use_class_token
        self.use_position_embedding = bool(use_position_embedding)
        self.projection = keras.layers.Conv2D(
            hidden_dim, patch_size, strides=patch_size, padding="valid",
            kernel_initializer=keras.initializers.LecunNormal(),
            dtype=self.dtype_policy, name="projection",
        )

    @property
    def grid_size(self):
        return (self.image_size[0] // self.patch_size, self.image_size[1] // self.patch_size)

    @property
    def num_tokens(self):
        return self.grid_size[0] * self.grid_size[1] + int(self.use_class_token)

    def build(self, input_shape):
        self.projection.build((None, *self.image_size, self.num_channels))
        add_sequence_weights(
            self, self.num_tokens, self.hidden_dim, self.use_class_token, self.use_position_embedding
        )

    def check_inputs(self, images):
        """Raises a ``ValueError`` if ``images`` (any array with a shape and dtype) do not fit."""
        check_images(images, self.image_size, self.num_channels)

    def call(self, images, training=None):
        self.check_inputs(images)
        tokens = strided_projection(self.projection, images, training)
        tokens = ops.reshape(tokens, (-1, tokens.shape[1] * tokens.shape[2], self.hidden_dim))
        return prepend_class_token_and_add_positions(tokens, self.class_token, self.position_embedding)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_tokens, self.hidden_dim)


def strided_projection(conv, inputs, training=None):
    """``conv(inputs)`` for a convolution whose strides equal its kernel (patches, tubelets).

    Where ``layers.platform_forms.patches_form(training)`` is "matmul" (jax's GPU at
    inference, or ``$KERAS_MONE_PATCHES=matmul``) it is one
    matmul: ``inputs`` cut into windows, each flattened in the kernel's ``(*window,
    channels)`` order, times the kernel reshaped to ``(window * channels, filters)``,
    plus the bias. The same sums as the convolution, in another order (float
    rounding); on an H200 cuDNN's strided convolution took 1.5 ms of a ViT-B/16
    forward at batch 256 (BENCHMARKS.md). Otherwise, or when the layer is not such a
    convolution (channels first, padding, dilation, groups, an activation), the layer.
    """
    window = tuple(conv.kernel_size)
    plain = (
        tuple(conv.strides) == window and conv.padding == "valid" and conv.data_format == "channels_last"
        and set(conv.dilation_rate) == {1} and conv.groups == 1 and conv.activation is keras.activations.linear
    )
    if not plain or patches_form(training is True) != "matmul":
        return conv(inputs)
    dims, channels = len(window), inputs.shape[-1]
    grid = [size // step for size, step in zip(inputs.shape[1:-1], window)]
    split = [-1] + [n for g, w in zip(grid, window) for n in (g, w)] + [channels]
    order = [0] + [1 + 2 * i for i in range(dims)] + [2 + 2 * i for i in range(dims)] + [1 + 2 * dims]
    columns = int(np.prod(window)) * channels
    windows = ops.transpose(ops.reshape(ops.cast(inputs, conv.compute_dtype), split), order)
    windows = ops.reshape(windows, [-1, *grid, columns])
    outputs = ops.matmul(windows, ops.reshape(ops.cast(conv.kernel, conv.compute_dtype), (columns, conv.filters)))
    return outputs if conv.bias is None else outputs + ops.cast(conv.bias, conv.compute_dtype)


def validate_image_geometry(image_size, patch_size):
    """Returns ``image_size`` as ``(H, W)`` or raises naming the bad argument."""
    if isinstance(image_size, (int, np.integer)) and not isinstance(image_size, bool):
        image_size = (image_size, image_size)
    if isinstance(image_size, (str, bytes)) or not hasattr(image_size, "__len__") or len(image_size) != 2:
        raise ValueError(f"`image_size` must be a positive int or (height, width), got {image_size!r}.")
    try:
        image_size = tuple(integer("image_size", s) for s in image_size)
    except ValueError:
        raise ValueError(f"`image_size` must be a positive int or (height, width) of ints, got {image_size!r}.") from None
    patch_size = integer("patch_size", patch_size)
    if image_size[0] % patch_size or image_size[1] % patch_size:
        raise ValueError(
            f"`image_size` {image_size} must be divisible by `patch_size` ({patch_size}); "
            f"for example {tuple((s // patch_size or 1) * patch_size for s in image_size)}."
        )
    return image_size


def check_floating(name, inputs):
    """Raises a ``ValueError`` naming ``name`` unless ``inputs`` are floating point."""
    dtype = keras.backend.standardize_dtype(inputs.dtype)
    if "float" not in dtype:
        raise ValueError(
            f"`{name}` must be floating point, got {dtype}: scale the pixels first "
            "(AugReg and the bundled presets use pixels / 127.5 - 1, in [-1, 1])."
        )


def check_images(images, image_size, num_channels):
    """Raises a ``ValueError`` naming ``images`` if its static shape or dtype does not fit."""
    check_floating("images", images)
    shape = tuple(images.shape)
    if len(shape) != 4:
        raise ValueError(
            f"`images` must have shape (batch, height, width, channels), got {shape}."
        )
    if shape[3] is not None and shape[3] != num_channels:
        raise ValueError(
            f"`images` has {shape[3]} channels but the model expects `num_channels`={num_channels}."
        )
    if None not in shape[1:3] and tuple(shape[1:3]) != tuple(image_size):
        raise ValueError(
            f"`images` are {shape[1]}x{shape[2]} but the model was built for "
            f"`image_size`={tuple(image_size)}; resize the images or build the model "
            f"with image_size={shape[1]}."
        )
