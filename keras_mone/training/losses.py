"""Losses and metrics of the training recipes."""

import keras
from keras import ops

from keras_mone.layers.config import register


@register
class SigmoidCrossEntropy(keras.losses.Loss):
    """Sigmoid cross-entropy summed over classes (AugReg / big_vision ``sigmoid_xent``).

    Labels are one-hot, multi-hot or soft (MixUp) ``(batch, classes)``;
    per example the loss is ``sum_k BCE(y_k, sigmoid(logit_k))``. Keras'
    ``BinaryCrossentropy`` averages over classes instead, which scales the
    gradient by ``1 / classes`` and changes what a gradient-norm clip of 1 does.
    """

    def __init__(self, name="sigmoid_cross_entropy", **kwargs):
        super().__init__(name=name, **kwargs)

    def call(self, y_true, y_pred):
        logits = ops.cast(y_pred, "float32")
        labels = ops.cast(y_true, "float32")
        # max(x, 0) - x * y + log(1 + exp(-|x|)): stable for large |x|.
        per_class = ops.relu(logits) - logits * labels + ops.log1p(ops.exp(-ops.abs(logits)))
        return ops.sum(per_class, axis=-1)


@register
class SumOverWidths(keras.losses.Loss):
    """Equal-weight sum of ``loss`` over stacked nested-model logits (MatFormer / MatViT).

    ``y_pred`` of shape ``(batch, widths, classes)`` (``MatViTClassifier`` in
    training) gives ``sum_w loss(y_true, y_pred[:, w])``; a ``(batch, classes)``
    prediction (evaluation) gives ``loss`` itself.

    Args:
        loss: the per-width Keras loss (called unreduced, per example).
    """

    def __init__(self, loss, name="sum_over_widths", **kwargs):
        super().__init__(name=name, **kwargs)
        self.loss = keras.losses.get(loss)

    def call(self, y_true, y_pred):
        if len(y_pred.shape) == 2:
            return self.loss.call(y_true, y_pred)
        return sum(self.loss.call(y_true, y_pred[:, w]) for w in range(y_pred.shape[1]))

    def get_config(self):
        config = super().get_config()
        config["loss"] = keras.saving.serialize_keras_object(self.loss)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["loss"] = keras.saving.deserialize_keras_object(config["loss"])
        return cls(**config)


@register
class FullWidthAccuracy(keras.metrics.CategoricalAccuracy):
    """Categorical accuracy of the full-width logits: the last of stacked
    ``(batch, widths, classes)`` logits in MatViT joint training, or plain
    ``(batch, classes)`` logits."""

    def __init__(self, name="accuracy", dtype=None):
        super().__init__(name=name, dtype=dtype)

    def update_state(self, y_true, y_pred, sample_weight=None):
        if len(y_pred.shape) == 3:
            y_pred = y_pred[:, -1]
        return super().update_state(y_true, y_pred, sample_weight=sample_weight)
