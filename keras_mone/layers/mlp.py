"""NestedMLP: the ViT MLP with nested in/out projections (App. A.1 Eq. 6)."""

import functools
import re

import keras
from keras import ops

from keras_mone.layers.activations import gelu
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.layers.nested_dense import NestedDense, pad_features, slice_point
from keras_mone.layers.platform_forms import accelerator, mlp_form


@register
class NestedMLP(ConfigMixin, keras.layers.Layer):
    """``gelu(x[:, :d] @ W_in[:d]) @ W_out[:, :d]``, padded back to ``D`` (Eq. 6).

    The hidden width stays at the full ``mlp_dim`` (4D in ViT) for every nested
    width ``d``, as in Sec. 3.1; only the in- and out-projections are sliced.

    Args:
        hidden_dim: model dimension ``D``.
        mlp_dim: hidden width of the MLP.
        dropout_rate: dropout after the activation and after the out-projection.
        kernel_initializer: initialiser of both projections.
        gelu_approximate: the tanh approximation of GELU (flax's ``nn.gelu``
            default: AugReg, big_vision) instead of the exact erf form (timm).
    """

    def __init__(
        self, hidden_dim, mlp_dim, dropout_rate=0.0, kernel_initializer="glorot_uniform",
        gelu_approximate=False, **kwargs
    ):
        super().__init__(**kwargs)
        self.hidden_dim = hidden_dim
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate
        self.gelu_approximate = bool(gelu_approximate)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.fc1 = NestedDense(
            mlp_dim, kernel_initializer=kernel_initializer, bias_initializer=_small_normal(),
            dtype=self.dtype_policy, name="fc1",
        )
        self.fc2 = NestedDense(
            hidden_dim, kernel_initializer=kernel_initializer, bias_initializer=_small_normal(),
            dtype=self.dtype_policy, name="fc2",
        )
        self.dropout = keras.layers.Dropout(dropout_rate, dtype=self.dtype_policy)

    def build(self, input_shape):
        self.fc1.build((None, None, self.hidden_dim))
        self.fc2.build((None, None, self.mlp_dim))

    def call(self, inputs, width=None, pad_output=True, training=None):
        nested = width is not None and width < self.hidden_dim
        leading = ops.shape(inputs)[:-1]
        # token rows (tokens, D): a 2-D matmul, whose bias and GELU tensorflow fuses into it (``add_bias``)
        inputs = ops.reshape(inputs, (-1, inputs.shape[-1]))
        # the Pallas kernels (jax); torch's Triton kernel runs in its packed blocks (``layers.packed_block``)
        if nested and not (training and self.dropout_rate) and mlp_form() != "plain" and _jax():
            outputs = self._fused(inputs, width, pad_output)
            if outputs is not None:
                return ops.reshape(outputs, tuple(leading) + (outputs.shape[-1],))
        pre_activation = self.fc1(inputs, in_width=width)
        hidden = gelu(pre_activation, approximate=self.gelu_approximate, training=bool(training), nested=nested)
        hidden = self.dropout(hidden, training=training)
        # on jax fc2's weight slice is cut after the pre-activation: cut after the GELU (its input),
        # XLA would compute the GELU in two passes over the hidden activations (issue 27)
        tie = slice_point(early=inputs, late=pre_activation)
        outputs = self.fc2(hidden, out_width=width, pad_output=pad_output, slice_after=tie)
        outputs = ops.reshape(outputs, tuple(leading) + (outputs.shape[-1],))
        return self.dropout(outputs, training=training)

    def _fused(self, rows, width, pad_output):
        """The nested MLP of token ``rows`` as one Pallas kernel (``kernels.fused_nested_mlp``),
        or ``None`` where the compiled kernel does not take this width."""
        from keras_mone.kernels import fused_nested_mlp as kernel

        interpret = accelerator() != "gpu"
        tiles = self.kernel_tiles(width, interpret)
        if tiles is None:
            return None
        activation = _kernel_gelu(self.gelu_approximate)
        outputs = kernel.fused_nested_mlp(rows, *self._kernel_weights(), width, activation, interpret=interpret,
                                          **tiles)
        return pad_features(outputs, self.hidden_dim) if pad_output else outputs

    def fused_residual(self, z, norm, width, scale=None):
        """``z + Pad(scale * self(norm(z), width))`` as one Pallas kernel
        (``kernels.fused_residual_mlp``: a block's MLP half), or ``None`` where it does
        not apply: a width that is not nested, a LayerNorm other than Keras' default
        over the last axis, or a width that keeps the plain path (``kernel_tiles``).
        ``z``: ``(batch, k, D)``; ``scale``: ``(batch, k)`` or ``None``."""
        from keras_mone.kernels import fused_residual_mlp as kernel

        interpret = accelerator() != "gpu"
        plain_norm = norm.center and norm.scale and not getattr(norm, "rms_scaling", False)
        plain_norm = plain_norm and norm.axis in (-1, [-1], 2, [2])
        tiles = self.kernel_tiles(width, interpret, full=self.hidden_dim, kernel="residual")
        if width >= self.hidden_dim or not plain_norm or tiles is None:
            return None
        # the LayerNorm's own weights stay in their (float32) dtype: it normalises in float32, as Keras' does
        weights = [ops.convert_to_tensor(w) for w in (norm.gamma, norm.beta)] + self._kernel_weights()
        rows = ops.reshape(z, (-1, self.hidden_dim))
        scale = None if scale is None else ops.reshape(ops.cast(scale, self.compute_dtype), (-1,))
        outputs = kernel.fused_residual_mlp(rows, *weights, scale, width, _kernel_gelu(self.gelu_approximate),
                                            epsilon=norm.epsilon, interpret=interpret, **tiles)
        return ops.reshape(outputs, ops.shape(z))

    def kernel_tiles(self, width, interpret, full=None, fits=None, kernel="mlp"):
        """The tile arguments of ``kernel`` (``kernels.tiles.KERNELS``) for ``width`` (``{}``: its
        defaults), or ``None`` where the plain path runs: a width the kernel does not take
        (``fits(width, mlp_dim)``; default the Pallas kernels' ``kernels.tiles.kernel_fits``),
        one that ``$KERAS_MONE_MLP_TILES`` names ``plain``, or one where the kernel does not
        pay by default (``kernels.tiles.kernel_pays``) and which that variable does not name."""
        from keras_mone.kernels import tiles as rules

        fits = fits or functools.partial(rules.kernel_fits, interpret=interpret, full=full)
        if not fits(width, self.mlp_dim):
            return None
        tiles = _tiles(width)
        itemsize = int(re.search(r"\d+", keras.backend.standardize_dtype(self.compute_dtype)).group()) // 8
        if tiles == {} and not rules.kernel_pays(width, self.mlp_dim, itemsize, kernel):
            return None
        return tiles

    def _kernel_weights(self):
        """fc1's and fc2's kernels and biases (zeros where there is none) in the compute dtype."""
        weights = []
        for layer in (self.fc1, self.fc2):
            bias = layer.bias if layer.bias is not None else ops.zeros((layer.units,))
            weights += [ops.convert_to_tensor(ops.cast(w, self.compute_dtype)) for w in (layer.kernel, bias)]
        return weights

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.hidden_dim,)

    def compute_output_spec(self, inputs, width=None, pad_output=True, training=None):
        last = self.hidden_dim if (pad_output or width is None) else width
        return keras.KerasTensor(tuple(inputs.shape[:-1]) + (last,), dtype=self.compute_dtype)


def _jax():
    return keras.backend.backend() == "jax"


def _tiles(width):
    """The kernels' tile arguments for ``width`` from ``$KERAS_MONE_MLP_TILES`` (``{}``: their
    defaults), or ``None`` where it names the width ``plain`` (XLA's path, no kernel)."""
    from keras_mone.kernels.tiles import PLAIN, tile_override

    tiles = tile_override(width)
    if tiles == PLAIN:
        return None
    names = ("block_rows", "block_hidden", "num_warps", "num_stages")
    return {} if tiles is None else dict(zip(names, tiles))


@functools.lru_cache(maxsize=None)
def _kernel_gelu(approximate):
    """The GELU of a fused nested MLP: the elementwise form (``rational_erf``: plain
    arithmetic, which every kernel backend lowers). One function per form, so
    compiled kernels are reused."""
    return functools.partial(gelu, approximate=approximate, nested=True)


def _small_normal():
    # ViT's MLP biases start at N(0, 1e-6) (big_vision, timm); kept for parity.
    return keras.initializers.RandomNormal(stddev=1e-6)
