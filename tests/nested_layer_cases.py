"""Shared cases of the nested-layer tests: sizes of a D = 32 ViT block, random inputs, the
weights of built layers in the numpy reference's terms, and gradients of a bare function."""

import keras
import numpy as np
from conftest import gradients, randomize_weights, to_numpy


D, HEADS, MLP = 32, 4, 64
WIDTHS = [4, 8, 16, 32]  # the four nested experts of D = 32
SIZES = [5, 4, 4, 3]  # tokens per group in the mixed-width calls

# Float32 layers against the float64 reference: see conftest.F32_ULPS
# (measured <= 4 ulps of max|value| for single layers). ATOL is for float32 vs
# float32 of the same maths in another summation order (sliced input vs full
# input, permuted groups): outputs are O(1-10), observed differences <= 2e-6.
ATOL = 1e-5


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def weights_of(layer):
    return {v.path.split("/", 1)[1] if "/" in v.path else v.path: to_numpy(v) for v in layer.weights}


def built(layer, shape, seed=0):
    layer.build(shape)
    randomize_weights(layer, seed=seed)
    return layer


def attention_params(layer):
    w = {v.path: to_numpy(v) for v in layer.weights}
    get = lambda suffix: next(val for path, val in w.items() if path.endswith(suffix))  # noqa: E731
    return (get("qkv/kernel"), get("qkv/bias"), get("out/kernel"), get("out/bias"))


def block_params(block):
    w = {v.path: to_numpy(v) for v in block.weights}
    get = lambda suffix: next(val for path, val in w.items() if path.endswith(suffix))  # noqa: E731
    names = {
        "norm1_gamma": "norm1/gamma", "norm1_beta": "norm1/beta",
        "qkv_kernel": "qkv/kernel", "qkv_bias": "qkv/bias",
        "out_kernel": "out/kernel", "out_bias": "out/bias",
        "norm2_gamma": "norm2/gamma", "norm2_beta": "norm2/beta",
        "fc1_kernel": "fc1/kernel", "fc1_bias": "fc1/bias",
        "fc2_kernel": "fc2/kernel", "fc2_bias": "fc2/bias",
    }
    params = {k: get(v).astype(np.float64) for k, v in names.items()}
    params["num_heads"] = block.num_heads
    return params


def mixed_groups(seed=0):
    """Token groups (batch 2, k_j tokens, D) and the per-token widths of their concatenation."""
    groups = [rand(2, k, D, seed=seed + j) for j, k in enumerate(SIZES)]
    per_token = np.concatenate([np.full((2, k), w) for k, w in zip(SIZES, WIDTHS)], axis=1)
    return groups, per_token


class FunctionOfVariable(keras.layers.Layer):
    """``function(variable)``, the variable initialised to ``value`` (inputs unused): gradients
    of a bare function through ``conftest.gradients``."""

    def __init__(self, value, function, **kwargs):
        super().__init__(**kwargs)
        self.function = function
        self.value = self.add_weight(shape=value.shape, initializer=keras.initializers.Constant(value))

    def call(self, inputs, training=None):
        return self.function(self.value, training)


def gradient_of(function, value, loss):
    model = keras.Sequential([keras.Input((1,)), FunctionOfVariable(value, function)])
    (grad,) = gradients(model, loss, np.zeros((1, 1), "float32"), model.trainable_variables)
    return grad
