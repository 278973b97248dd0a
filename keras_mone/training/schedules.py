"""Learning-rate schedules of the ViT recipes (AugReg: linear warm-up, cosine decay)."""

import math

import keras
from keras import ops

from keras_mone.layers.config import ConfigMixin, register


@register
class WarmupCosineDecay(ConfigMixin, keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0 to ``peak_learning_rate`` over ``warmup_steps``,
    then cosine decay to ``end_learning_rate`` at ``total_steps``.

    Step ``s`` (0-based) gets ``peak * (s + 1) / warmup_steps`` during warm-up,
    as in big_vision, so the first update is not wasted on a zero rate.
    """

    def __init__(self, peak_learning_rate, total_steps, warmup_steps=0, end_learning_rate=0.0):
        if total_steps <= 0 or not 0 <= warmup_steps <= total_steps:
            raise ValueError(
                f"Need 0 <= `warmup_steps` ({warmup_steps}) <= `total_steps` ({total_steps}) "
                "and `total_steps` > 0."
            )
        self.peak_learning_rate = float(peak_learning_rate)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.end_learning_rate = float(end_learning_rate)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        peak, end = self.peak_learning_rate, self.end_learning_rate
        warm = peak * (step + 1.0) / max(self.warmup_steps, 1)
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = ops.clip((step - self.warmup_steps) / decay_steps, 0.0, 1.0)
        cosine = end + (peak - end) * 0.5 * (1.0 + ops.cos(math.pi * progress))
        return ops.where(step < self.warmup_steps, warm, cosine)

    def get_config(self):
        return {
            "peak_learning_rate": self.peak_learning_rate,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "end_learning_rate": self.end_learning_rate,
        }
