"""The fused nested MLP kernel (issue 40 item 4): equal to the numpy reference of Eq. 6 and to
the plain path, forward and backward, through Pallas' interpreter (CI has no GPU), and chosen
only on request ($KERAS_MONE_MLP) with clear errors elsewhere."""

import numpy as np
import pytest
from conftest import BACKEND, TINY, assert_f32_close, images, randomize_weights, to_numpy

import numpy_reference as ref
from keras_mone.layers import platform_forms

jax_only = pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend")


def _weights(width_full=96, hidden=384, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(width_full, hidden)).astype("float32") * 0.1,
        rng.normal(size=(hidden,)).astype("float32") * 0.1,
        rng.normal(size=(hidden, width_full)).astype("float32") * 0.1,
        rng.normal(size=(width_full,)).astype("float32") * 0.1,
    )


def _exact_gelu(x):
    import jax

    return jax.nn.gelu(x, approximate=False)


@jax_only
@pytest.mark.parametrize("width", [12, 24, 48, 96])
@pytest.mark.parametrize("rows", [200, 256])  # 200: a partial last row tile (padded, then cut)
def test_kernel_equals_the_numpy_reference_of_eq6(width, rows):
    from keras_mone.kernels.fused_nested_mlp import fused_nested_mlp

    x = np.random.default_rng(1).normal(size=(rows, 96)).astype("float32")
    w1, b1, w2, b2 = _weights()
    out = np.asarray(fused_nested_mlp(x, w1, b1, w2, b2, width, _exact_gelu, interpret=True))
    expected = ref.mlp(x[None].astype("float64"), [width] * rows, w1, b1, w2, b2)[0][:, :width]
    assert out.shape == (rows, width)
    assert_f32_close(out, expected)


@jax_only
@pytest.mark.parametrize("blocks", [(None, None), (16, 32), (64, 128)])
def test_gradients_equal_the_plain_paths(blocks):
    """The backward pass recomputes the plain path; with a loss that feeds the kernel's outputs
    back in, every input's gradient matches autodiff of the plain path."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.fused_nested_mlp import fused_nested_mlp, plain_nested_mlp

    x = np.random.default_rng(2).normal(size=(72, 96)).astype("float32")
    arguments = (x,) + _weights()
    cotangent = np.random.default_rng(3).normal(size=(72, 24)).astype("float32")

    def loss(fn, **kw):  # squared: the backward pass sees the kernel's own outputs
        return lambda *a: jnp.sum(jnp.square(fn(*a, 24, _exact_gelu, **kw) - cotangent))

    fused = jax.grad(loss(fused_nested_mlp, block_rows=blocks[0], block_hidden=blocks[1], interpret=True),
                     argnums=range(5))(*arguments)
    plain = jax.grad(loss(plain_nested_mlp), argnums=range(5))(*arguments)
    for got, want in zip(fused, plain):
        assert got.shape == want.shape
        assert_f32_close(np.asarray(got), np.asarray(want))
    assert not np.any(np.asarray(fused[0])[:, 24:])  # columns past the width are not read


@jax_only
def test_tile_choices_and_bad_arguments():
    from keras_mone.kernels import tiles as kernel
    from keras_mone.kernels.fused_nested_mlp import fused_nested_mlp

    assert kernel.feature_chunk(96) == 32 and kernel.feature_chunk(768) == 256 and kernel.feature_chunk(1024) == 256
    assert kernel.kernel_fits(96, 3072) and not kernel.kernel_fits(4, 64) and kernel.kernel_fits(4, 64, interpret=True)
    # the block kernel sums its LayerNorm statistics over D in power-of-2 chunks: D = 770 has chunks of 2
    assert kernel.kernel_fits(64, 256, full=768) and not kernel.kernel_fits(64, 256, full=770)
    assert kernel.kernel_fits(64, 256, interpret=True, full=770) and not kernel.kernel_fits(64, 24, full=768)
    # ViT-B/16's nested groups (the full width keeps XLA's GEMMs): the tiles compiled for sm_90
    # without spills or copies of the GELU (float32 at d = 384 halves its hidden block for shared memory)
    tiles = {(width, itemsize): kernel.default_blocks(width, 3072, itemsize)
             for width in (96, 192, 384) for itemsize in (2, 4)}
    assert tiles == {(96, 2): (128, 32), (96, 4): (128, 32), (192, 2): (128, 16), (192, 4): (128, 16),
                     (384, 2): (32, 64), (384, 4): (32, 32)}
    # d = 384's 32-row tiles load 2 x 384 x 2 / 32 = 48 weight bytes per hidden element, against the
    # 8 XLA's path moves: that width keeps the plain path unless a card's screen names its tiles
    assert [kernel.kernel_pays(width, 3072, itemsize) for width in (96, 192, 384) for itemsize in (2, 4)] == [
        True, True, True, True, False, False]
    # every program loads both weight slices whole: 2 d itemsize / block_rows bytes per hidden element,
    # against the 4 itemsize XLA's path moves through memory for it
    assert kernel.weight_bytes_per_hidden_element(192, 32) == 24
    assert kernel.weight_bytes_per_hidden_element(192, 128) == 6
    assert kernel.weight_bytes_per_hidden_element(96, 128, itemsize=4) == 6
    for (width, itemsize), (rows, block_hidden) in tiles.items():
        assert width * block_hidden * itemsize <= 48 * 1024 and 3072 % block_hidden == 0
    x = np.zeros((8, 96), "float32")
    with pytest.raises(ValueError, match=r"`width` must lie in \[1, 96\]"):
        fused_nested_mlp(x, *_weights(), 97, _exact_gelu, interpret=True)
    with pytest.raises(ValueError, match="`block_hidden`=256 must divide the MLP's hidden width 384"):
        fused_nested_mlp(x, *_weights(), 24, _exact_gelu, block_hidden=256, interpret=True)
    message = r"`block_rows` must be a power of 2 of at least 16 \(Triton's tiles\), got 48"
    with pytest.raises(ValueError, match=message):
        fused_nested_mlp(x, *_weights(), 24, _exact_gelu, block_rows=48, interpret=True)
    with pytest.raises(ValueError, match="`block_hidden` must be a power of 2 of at least 16"):
        fused_nested_mlp(x, *_weights(), 24, _exact_gelu, block_hidden=8, interpret=True)
    with pytest.raises(ValueError, match="must share a dtype"):
        fused_nested_mlp(x.astype("bfloat16"), *_weights(), 24, _exact_gelu, interpret=True)
    assert not kernel.kernel_fits(4, 24, interpret=True)  # no hidden block of 16: the plain path


def test_the_form_is_opt_in_and_named_when_wrong(monkeypatch):
    monkeypatch.delenv(platform_forms.MLP_ENV, raising=False)
    assert platform_forms.mlp_form() == "plain"
    monkeypatch.setenv(platform_forms.MLP_ENV, "flash")
    with pytest.raises(ValueError, match=r"\$KERAS_MONE_MLP must be one of \['plain', 'fused', 'mlp_kernel'\]"):
        platform_forms.mlp_form()
    for form in ("fused", "mlp_kernel"):
        monkeypatch.setenv(platform_forms.MLP_ENV, form)
        if BACKEND == "jax" or (BACKEND == "torch" and _triton_installed()):
            assert platform_forms.mlp_form() == form
        elif BACKEND == "torch":
            with pytest.raises(ValueError, match=f"'{form}' on torch is a Triton kernel and needs Triton"):
                platform_forms.mlp_form()
        else:
            with pytest.raises(ValueError, match=f"'{form}' is a Pallas kernel \\(jax\\) or a Triton kernel "
                                                 f"\\(torch\\); the {BACKEND} backend takes 'plain'"):
                platform_forms.mlp_form()


def _triton_installed():
    from keras_mone.kernels.triton_nested_mlp import available

    return available()


def _forward(monkeypatch, form, model, inputs, **kw):
    monkeypatch.setenv(platform_forms.MLP_ENV, form)
    return to_numpy(model(inputs, **kw))


@jax_only
def test_nested_mlp_layer_takes_the_kernel_and_agrees(monkeypatch):
    from keras_mone.layers import NestedMLP

    from keras_mone.kernels import fused_nested_mlp as kernel

    widths = []
    original = kernel.fused_nested_mlp
    monkeypatch.setattr(kernel, "fused_nested_mlp", lambda x, *a, **kw: widths.append(a[4]) or original(x, *a, **kw))
    layer = NestedMLP(32, 64)
    layer.build((None, None, 32))
    randomize_weights(layer, seed=4)
    x = np.random.default_rng(5).normal(size=(2, 9, 32)).astype("float32")
    for width, pad in ((4, True), (16, False), (32, True)):  # 32: full width, plain GEMMs either way
        fused = _forward(monkeypatch, "fused", layer, x, width=width, pad_output=pad)
        plain = _forward(monkeypatch, "plain", layer, x, width=width, pad_output=pad)
        assert fused.shape == plain.shape == (2, 9, 32 if pad else width)
        assert_f32_close(fused, plain)
    assert widths == [4, 16]  # the nested widths took the kernel, the full width did not


def _assert_training_gradients_agree(monkeypatch, model, x, form):
    """The gradients of ``sum(logits^2)`` in training mode, under ``$KERAS_MONE_MLP=form``,
    equal the plain path's within 256 float32 ulps."""
    import jax

    trainable = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]

    def loss(values):
        logits, _ = model.stateless_call(values, others, x, training=True)
        return jax.numpy.sum(logits ** 2)

    grads = {}
    for chosen in (form, "plain"):
        monkeypatch.setenv(platform_forms.MLP_ENV, chosen)
        grads[chosen] = jax.grad(loss)(trainable)
    for got, want in zip(grads[form], grads["plain"]):
        assert_f32_close(np.asarray(got), np.asarray(want), ulps=256)


@jax_only
def test_mone_model_outputs_and_gradients_agree_with_the_plain_path(monkeypatch):
    """A MoNE-ViT at e_c 0.5 (every nested group's MLP half through the block kernel,
    ``fused_residual_mlp``) gives the plain path's logits, and its training gradients match."""

    from keras_mone import models

    from keras_mone.kernels import fused_residual_mlp as kernel

    widths = []
    original = kernel.fused_residual_mlp
    monkeypatch.setattr(kernel, "fused_residual_mlp", lambda z, *a, **kw: widths.append(a[7]) or original(z, *a, **kw))
    model = models.ImageClassifier(models.MoNEViTBackbone(**TINY, capacity=0.5), num_classes=5)
    model(images()[:1])  # built: every weight exists to be randomised
    randomize_weights(model, seed=6)
    x = images()
    assert_f32_close(_forward(monkeypatch, "fused", model, x), _forward(monkeypatch, "plain", model, x))
    assert widths and set(widths) <= {4, 8, 16}  # the nested groups of both blocks took the kernel
    assert _forward(monkeypatch, "fused", model, x, training=True).shape == (2, 5)  # no dropout: fused too
    _assert_training_gradients_agree(monkeypatch, model, x, "fused")


@jax_only
def test_the_mlp_kernel_form_runs_each_nested_group_through_the_mlp_kernel_alone(monkeypatch):
    """``$KERAS_MONE_MLP=mlp_kernel``: a MoNE-ViT's nested groups take ``fused_nested_mlp`` (the
    LayerNorm and residual stay XLA's), never the block kernel, and the logits and training
    gradients are the plain path's."""

    from keras_mone import models

    from keras_mone.kernels import fused_nested_mlp as mlp_kernel
    from keras_mone.kernels import fused_residual_mlp as block_kernel

    widths, blocks = [], []
    original = mlp_kernel.fused_nested_mlp
    monkeypatch.setattr(mlp_kernel, "fused_nested_mlp",
                        lambda x, *a, **kw: widths.append(a[4]) or original(x, *a, **kw))
    monkeypatch.setattr(block_kernel, "fused_residual_mlp", lambda *a, **kw: blocks.append(a) or 1 / 0)
    model = models.ImageClassifier(models.MoNEViTBackbone(**TINY, capacity=0.5), num_classes=5)
    model(images()[:1])  # built: every weight exists to be randomised
    randomize_weights(model, seed=6)
    x = images()
    assert_f32_close(_forward(monkeypatch, "mlp_kernel", model, x), _forward(monkeypatch, "plain", model, x))
    assert widths and set(widths) <= {4, 8, 16} and not blocks
    _assert_training_gradients_agree(monkeypatch, model, x, "mlp_kernel")


@jax_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_lowers_to_triton_for_a_cuda_gpu(dtype):
    """Without a GPU: ViT-B/16's nested groups (d = 96, 192, 384) lower through Pallas' Triton
    lowering for CUDA (``jax.export``), whose checks (power-of-2 loads and stores, supported ops)
    the interpreter does not make. What the card's Triton compiler does with it waits for one."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
    from keras_mone.kernels.fused_nested_mlp import fused_nested_mlp
    from keras_mone.layers.mlp import _kernel_gelu

    spec = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
            for shape in ((256 * 84, 768), (768, 3072), (3072,), (3072, 768), (768,))]
    for width in (96, 192, 384):
        def mlp(*arguments, width=width):
            return fused_nested_mlp(*arguments, width, _kernel_gelu(False))

        assert lower_for_cuda(mlp, *spec).count(TRITON_CALL) == 1


@jax_only
def test_a_mone_vit_on_a_gpu_runs_each_nested_group_through_the_compiled_kernel(monkeypatch):
    """The layer's choice as on a GPU (``accelerator`` patched): a one-block MoNE-ViT-S/16
    exported for CUDA calls the Triton kernel once per nested group (widths 48, 96, 192;
    the full-width group keeps XLA's GEMMs), and not at all with the plain form."""
    from keras_mone import models
    from keras_mone.kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
    from keras_mone.layers import mlp as mlp_module

    monkeypatch.setattr(mlp_module, "accelerator", lambda: "gpu")
    backbone = models.MoNEViTBackbone(image_size=64, patch_size=16, hidden_dim=384, depth=1, num_heads=6,
                                      mlp_dim=1536, capacity=0.5)
    model = models.ImageClassifier(backbone, num_classes=10)
    monkeypatch.setenv(platform_forms.MLP_ENV, "plain")
    model(images(size=64))  # built on the CPU, where a compiled GPU kernel cannot run
    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])

    def kernels(form):
        monkeypatch.setenv(platform_forms.MLP_ENV, form)
        def forward(trainable, others, x):
            return model.stateless_call(trainable, others, x)[0]

        return lower_for_cuda(forward, *state, images(size=64)).count(TRITON_CALL)

    assert kernels("fused") == 3 and kernels("mlp_kernel") == 3 and kernels("plain") == 0


@jax_only
def test_mixed_bfloat16_logits_agree_with_the_plain_path(monkeypatch):
    """Under mixed_bfloat16 the kernels compute as the plain path does (bf16 operands, float32
    accumulation and LayerNorm): logits agree to bfloat16 rounding of a 2-block model."""
    import keras

    from keras_mone import models

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = models.ImageClassifier(models.MoNEViTBackbone(**TINY, capacity=0.5), num_classes=5)
        x = images()
        model(x)
        randomize_weights(model, seed=7)
        fused, plain = (_forward(monkeypatch, form, model, x).astype("float32") for form in ("fused", "plain"))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    scale = np.abs(plain).max()
    assert np.abs(fused - plain).max() <= 4 * 2.0 ** -8 * scale  # 2-4 bf16 ulps of the largest logit (measured: 1)
