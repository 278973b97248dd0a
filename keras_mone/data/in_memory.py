"""Evaluation batches from arrays in memory: no tf.data, so any backend alone can run them."""

import math

import keras
import numpy as np


class ArrayBatches(keras.utils.PyDataset):
    """One pass over ``(inputs, targets)`` arrays in batches of ``batch_size``,
    in order (the last batch may be smaller). Works as ``validation_data``
    and with ``model.evaluate`` on every backend; ``iter()`` yields the batches.

    ``full_batches=True`` (several devices, each needing an equal share) yields
    ``(inputs, targets, sample_weight)`` instead, the last batch filled up with
    repeats of the first examples at weight 0; real examples weigh
    ``pipeline.padding_weight`` so that the loss and every metric are the means
    over the real examples, each counted once.
    """

    def __init__(self, inputs, targets, batch_size, full_batches=False):
        super().__init__()
        if len(inputs) != len(targets):
            raise ValueError(f"`inputs` ({len(inputs)}) and `targets` ({len(targets)}) differ in length.")
        if int(batch_size) < 1:
            raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
        if not len(inputs):
            raise ValueError("`inputs` holds no examples.")
        self.inputs, self.targets, self.batch_size = inputs, targets, int(batch_size)
        self.full_batches = bool(full_batches)

    def __len__(self):
        return math.ceil(len(self.inputs) / self.batch_size)

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(index)
        start, count = index * self.batch_size, len(self.inputs)
        if not self.full_batches:
            part = slice(start, start + self.batch_size)
            return self.inputs[part], self.targets[part]
        from keras_mone.data.pipeline import padding_weight

        weight = padding_weight(count, self.batch_size)[1]
        rows = np.arange(start, start + self.batch_size)
        weights = np.where(rows < count, np.float32(weight), np.float32(0.0))
        rows = rows % count
        return self.inputs[rows], self.targets[rows], weights

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def num_examples(self):
        return len(self.inputs)
