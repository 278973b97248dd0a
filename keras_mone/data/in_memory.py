"""Evaluation batches from arrays in memory: no tf.data, so any backend alone can run them."""

import math

import keras


class ArrayBatches(keras.utils.PyDataset):
    """One pass over ``(inputs, targets)`` arrays in batches of ``batch_size``,
    in order (the last batch may be smaller). Works as ``validation_data``
    and with ``model.evaluate`` on every backend; ``iter()`` yields the batches.
    """

    def __init__(self, inputs, targets, batch_size):
        super().__init__()
        if len(inputs) != len(targets):
            raise ValueError(f"`inputs` ({len(inputs)}) and `targets` ({len(targets)}) differ in length.")
        if int(batch_size) < 1:
            raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
        self.inputs, self.targets, self.batch_size = inputs, targets, int(batch_size)

    def __len__(self):
        return math.ceil(len(self.inputs) / self.batch_size)

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(index)
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.inputs[part], self.targets[part]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def num_examples(self):
        return len(self.inputs)
