"""Raw images (uint8 or [0, 1]) to the range the zoo's models take ([-1, 1])."""

import math
import numbers

import keras
import numpy as np
from keras import ops

from keras_mone.layers.config import ConfigMixin, register

#: Input range of every preset of the zoo (AugReg / keras-hub ViTs and the digits presets).
PRESET_INPUT_RANGE = (-1.0, 1.0)
UINT8_RANGE = (0, 255)
#: ``name -> spec`` of a built-in preset (raising for an unknown name), set by
#: ``keras_mone.presets`` when imported (data sits below presets).
PRESET_LOOKUP = None


def _value_range(name, value):
    if (
        not isinstance(value, (tuple, list)) or len(value) != 2
        or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in value)
        or not value[0] < value[1]
    ):
        raise ValueError(f"`{name}` must be a pair of finite numbers (low, high) with low < high, got {value!r}.")
    return (float(value[0]), float(value[1]))


def _scale_offset(value_range, target_range):
    scale = (target_range[1] - target_range[0]) / (value_range[1] - value_range[0])
    return scale, target_range[0] - value_range[0] * scale


@register
class ImageConverter(ConfigMixin, keras.layers.Layer):
    """Maps images linearly from ``value_range`` to ``target_range`` (float output).

    keras-hub's image converter, for the zoo: ``ImageConverter()`` takes uint8
    images (0..255), ``ImageConverter(value_range=(0, 1))`` floats in [0, 1];
    both give [-1, 1], what every preset expects. Apply it to the data, not
    inside the model (``set_capacity`` stays a property of the model)::

        converter = ImageConverter.for_preset("vit_digits")
        logits = model.predict(converter(images))
        dataset = dataset.map(lambda x, y: (converter(x), y))

    Shapes are kept: images ``(batch, H, W, C)`` or clips ``(batch, T, H, W, C)``.

    Args:
        value_range: ``(low, high)`` of the raw images.
        target_range: ``(low, high)`` the model takes.
    """

    def __init__(self, value_range=UINT8_RANGE, target_range=PRESET_INPUT_RANGE, **kwargs):
        super().__init__(**kwargs)
        self.value_range = _value_range("value_range", value_range)
        self.target_range = _value_range("target_range", target_range)
        self.scale, self.offset = _scale_offset(self.value_range, self.target_range)

    @classmethod
    def for_preset(cls, name, value_range=UINT8_RANGE):
        """The converter from ``value_range`` to the input range of preset ``name``."""
        if PRESET_LOOKUP is None:
            raise RuntimeError("`ImageConverter.for_preset` needs keras_mone.presets: `import keras_mone` first.")
        PRESET_LOOKUP(name)  # an unknown name is an error naming the presets
        return cls(value_range=value_range, target_range=PRESET_INPUT_RANGE)

    def call(self, images):
        images = ops.cast(images, self.compute_dtype)
        return images * self.scale + self.offset

    def compute_output_shape(self, input_shape):
        return input_shape


def preprocess(images, value_range=UINT8_RANGE, target_range=PRESET_INPUT_RANGE):
    """``images`` (a numpy array or nested list) mapped from ``value_range`` to
    ``target_range`` as a float32 numpy array: ``ImageConverter`` without Keras."""
    scale, offset = _scale_offset(_value_range("value_range", value_range), _value_range("target_range", target_range))
    return (np.asarray(images, dtype=np.float32) * np.float32(scale) + np.float32(offset)).astype(np.float32)
