"""Per-platform forms (issue 40 item 2): fused attention on accelerators, the CPU's measured form
on jax and tensorflow's CPU, both equal within float rounding on every backend."""

import keras
import numpy as np
import pytest
from conftest import BACKEND, TINY, TINY_VIDEO, assert_f32_close, gradients, images, randomize_weights, to_numpy, videos

from keras_mone import models
from keras_mone.layers import platform_forms
from keras_mone.layers.attention import multi_head_attention


def test_the_cpu_keeps_its_measured_form(monkeypatch):
    monkeypatch.delenv(platform_forms.ATTENTION_ENV, raising=False)
    assert platform_forms.accelerator() == "cpu"  # CI and this machine
    assert platform_forms.attention_form() == ("fused" if BACKEND == "torch" else "explicit")
    for form in platform_forms.ATTENTION_FORMS:
        monkeypatch.setenv(platform_forms.ATTENTION_ENV, form)
        if form == "flash" and BACKEND != "jax":  # a Pallas kernel: the variable names what the backend takes
            with pytest.raises(ValueError, match=rf"KERAS_MONE_ATTENTION='flash' is a Pallas kernel \(jax\); "
                                                 rf"the {BACKEND} backend takes 'fused' or 'explicit'"):
                platform_forms.attention_form()
            continue
        assert platform_forms.attention_form() == form


def test_a_bad_override_names_the_variable(monkeypatch):
    monkeypatch.setenv(platform_forms.ATTENTION_ENV, "cudnn")
    with pytest.raises(ValueError, match=r"\$KERAS_MONE_ATTENTION must be one of \['fused', 'explicit', 'flash'\]"):
        platform_forms.attention_form()


def _attention(monkeypatch, form, qkv):
    monkeypatch.setenv(platform_forms.ATTENTION_ENV, form)
    return to_numpy(multi_head_attention(qkv))


@pytest.mark.parametrize("groups", [1, 3])
def test_fused_and_explicit_attention_agree(monkeypatch, groups):
    rng = np.random.default_rng(0)
    sizes = [5, 7, 4][:groups]
    qkv = [rng.normal(size=(2, n, 3, 4, 8)).astype("float32") for n in sizes]
    qkv = qkv[0] if groups == 1 else qkv
    fused, explicit = _attention(monkeypatch, "fused", qkv), _attention(monkeypatch, "explicit", qkv)
    assert fused.shape == explicit.shape == (2, sum(sizes), 4, 8)
    # Both are softmax(q k^T / sqrt(8)) v in float32; they differ in the order of
    # the reductions only (a few ulps of values of order 1).
    assert_f32_close(fused, explicit, ulps=64)


def test_a_mone_model_gives_the_same_outputs_in_both_forms(monkeypatch):
    model = models.MoNEViTBackbone(**TINY, capacity=0.5)
    model.build((None, 32, 32, 3))
    randomize_weights(model, seed=3)
    x = images()
    monkeypatch.setenv(platform_forms.ATTENTION_ENV, "explicit")
    explicit = to_numpy(model(x))
    monkeypatch.setenv(platform_forms.ATTENTION_ENV, "fused")
    fused = to_numpy(model(x))
    assert_f32_close(fused, explicit)


def test_received_attention_keeps_the_explicit_form(monkeypatch):
    # A-MoD's score needs the attention weights, which a fused kernel does not return.
    qkv = np.random.default_rng(1).normal(size=(2, 6, 3, 4, 8)).astype("float32")
    monkeypatch.setenv(platform_forms.ATTENTION_ENV, "fused")
    attended, received = multi_head_attention(qkv, return_received_attention=True)
    np.testing.assert_allclose(to_numpy(received).sum(-1), 1.0, rtol=1e-5)  # each query row's weights sum to 1
    assert_f32_close(to_numpy(attended), _attention(monkeypatch, "explicit", qkv))


@pytest.mark.parametrize("heads_first", [False, True])
def test_fused_attention_in_either_layout_equals_the_explicit_form(monkeypatch, heads_first):
    # The torch form calls SDPA itself (heads first, as the packed block holds
    # q, k, v); every backend's fused_attention must equal softmax(q k^T / sqrt(d)) v.
    qkv = np.random.default_rng(2).normal(size=(2, 9, 3, 4, 8)).astype("float32")
    q, k, v = (qkv[:, :, i] for i in range(3))  # (B, N, H, d)
    if heads_first:
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    fused = to_numpy(platform_forms.fused_attention(q, k, v, heads_first=heads_first))
    if heads_first:
        fused = fused.transpose(0, 2, 1, 3)
    assert_f32_close(fused, _attention(monkeypatch, "explicit", qkv), ulps=64)


@pytest.mark.skipif(BACKEND != "jax", reason="compiling for a GPU elsewhere is jax's (bench.gpu_program)")
def test_half_precision_attention_compiled_for_a_gpu_elsewhere_is_still_attention(monkeypatch):
    # Under compiling_for("gpu") on a machine without one, bf16 attention asks for
    # cuDNN's kernel as Keras would on the card; here, where the CPU cannot lower it,
    # XLA's form runs, as Keras falls back: the same softmax(q k^T / sqrt(d)) v.
    import jax.numpy as jnp

    import jax

    asked = []
    library = jax.nn.dot_product_attention

    def recorded(*args, implementation=None, **kwargs):
        asked.append(implementation)
        return library(*args, implementation=implementation, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
    qkv = np.random.default_rng(3).normal(size=(2, 6, 3, 4, 8)).astype("float32")
    q, k, v = (jnp.asarray(qkv[:, :, i], jnp.bfloat16) for i in range(3))
    with platform_forms.compiling_for("gpu"), pytest.warns(UserWarning, match="cuDNN attention does not take"):
        attended = platform_forms.fused_attention(q, k, v)
    assert asked == ["cudnn", "xla"], asked  # the card's choice first, then Keras' fallback
    assert attended.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(attended, "float32"), _attention(monkeypatch, "explicit", qkv), atol=3e-2)


def _graphs_and_breaks(fn, *args):
    import torch

    explanation = torch._dynamo.explain(fn)(*args)
    return explanation.graph_count, explanation.graph_break_count


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile is torch's")
@pytest.mark.parametrize("name", ["ViTBackbone", "MoNEViTBackbone", "MoNEViViTBackbone"])
def test_torch_compile_traces_a_forward_as_one_graph(name):
    # Issue 40 item 3 (jit_compile=True runs torch.compile): Keras'
    # ops.dot_product_attention broke the graph at every attention call (a
    # C++ SDPAParams check) and EPR's token counts at every router (numpy
    # traced into tensors): 10 graphs dense, 15 MoNE for two blocks. Now one,
    # and the compiled (fullgraph) forward equals the eager one.
    import torch

    from conftest import TINY_VIDEO, videos

    video = "ViViT" in name
    cls = getattr(models, name)
    model = cls(**TINY_VIDEO, capacity=0.3) if "MoNE" in name and video else (
        cls(**TINY, capacity=0.3) if "MoNE" in name else cls(**TINY))
    x = torch.as_tensor(videos() if video else images())
    randomize_weights(model, seed=1) if model.built else None
    eager = to_numpy(model(x))
    with torch.no_grad():
        assert _graphs_and_breaks(lambda t: model(t), x) == (1, 0)
        compiled = torch.compile(lambda t: model(t), backend="eager", fullgraph=True)
        assert_f32_close(to_numpy(compiled(x)), eager)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile is torch's")
def test_a_mone_training_step_breaks_the_graph_only_where_the_dense_one_does():
    # Keras' torch train_step calls loss.backward(), which dynamo does not
    # trace: one break for any model. MoNE's routing adds none (it added 5
    # for two blocks; dense had 13 breaks, MoNE 18, before the two fixes).
    import keras
    import torch

    x, y = torch.as_tensor(images(batch=4)), torch.as_tensor(np.arange(4) % 5)
    counts = []
    for backbone in (models.ViTBackbone(**TINY), models.MoNEViTBackbone(**TINY, capacity=0.3)):
        model = models.ImageClassifier(backbone, num_classes=5)
        model.compile(optimizer="adamw", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.train_on_batch(x, y)
        counts.append(_graphs_and_breaks(lambda a, b: model.train_step((a, b)), x, y))
    assert counts[1] == counts[0] and counts[0][1] <= 2, counts


@pytest.mark.parametrize("variable, form, cpu_default, listed", [
    ("GELU_ENV", "gelu_form", "library", r"\['library', 'rational'\]"),
    ("PATCHES_ENV", "patches_form", "conv", r"\['conv', 'matmul'\]"),
    ("ORDER_ENV", "order_form", "tied", r"\['tied', 'free'\]"),
    ("NORMS_ENV", "norms_form", "grouped", r"\['grouped', 'joint'\]"),
    ("STATISTICS_ENV", "statistics_form", "keras", r"\['keras', 'one_pass', 'fused', 'kernel'\]"),
    ("RESIDUALS_ENV", "residuals_form", "block", r"\['fused', 'block', 'half_block'\]"),
    ("PROJECTIONS_ENV", "projections_form", "per_group", r"\['per_group', 'grouped_kernel', 'grouped_kernel_all'\]"),
])
def test_the_cpu_keeps_its_forms_and_a_bad_value_names_the_variable(monkeypatch, variable, form, cpu_default, listed):
    name = getattr(platform_forms, variable)
    monkeypatch.delenv(name, raising=False)
    assert getattr(platform_forms, form)() == cpu_default
    monkeypatch.setenv(name, "fastest")
    with pytest.raises(ValueError, match=rf"\${name} must be one of {listed} or unset, got 'fastest'"):
        getattr(platform_forms, form)()


def _outputs_and_gradients_by_form(monkeypatch, model, switch, training=True, forms=None):
    """``{form: (outputs, gradients)}`` of ``model`` (built here, random weights) on
    ``images()`` under each form of ``platform_forms.<switch>_ENV`` (or of ``forms``): the
    gradients of the mean squared output with respect to every trainable weight (of a call
    with ``training``)."""
    model.build((None, 32, 32, 3))
    randomize_weights(model, seed=4)
    x = images()
    results = {}
    for form in forms or getattr(platform_forms, f"{switch}_FORMS"):
        monkeypatch.setenv(getattr(platform_forms, f"{switch}_ENV"), form)
        grads = gradients(model, lambda out: keras.ops.mean(out * out), x, model.trainable_variables,
                          training=training)
        results[form] = to_numpy(model(x)), grads
    return results


def test_free_order_changes_no_value(monkeypatch):
    """The ties add an exact zero (``after``): without them a MoNE model's outputs and
    gradients are bit-identical."""
    results = _outputs_and_gradients_by_form(monkeypatch, models.MoNEViTBackbone(**TINY, capacity=0.5), "ORDER")
    assert np.array_equal(results["tied"][0], results["free"][0])
    for tied, free in zip(results["tied"][1], results["free"][1]):
        assert (tied is None and free is None) or np.array_equal(tied, free)


@pytest.mark.parametrize("name, kwargs", [
    ("MoNEViTBackbone", dict(capacity=0.3)),
    ("MoNEViTBackbone", dict(capacity=0.25, capacity_method="mod_greedy")),
    ("MoNEViTBackbone", dict(capacity=0.5, use_class_token=True, class_token_to_full_expert=True, router_positions=(0, 1))),
])
def test_joint_layer_norms_equal_the_grouped_ones(monkeypatch, name, kwargs):
    """``$KERAS_MONE_NORMS=joint``: one LayerNorm over a block's groups joined along the
    tokens gives each token the statistics of its own features, as one per group does
    (outputs and gradients within float32 rounding; the torch packed blocks are left
    out, so the generic path runs on every backend)."""
    from keras_mone.layers import block as block_module

    monkeypatch.setattr(block_module, "packable", lambda *args, **kwargs: False)
    results = _outputs_and_gradients_by_form(monkeypatch, getattr(models, name)(**TINY, **kwargs), "NORMS")
    _assert_forms_agree(results, "joint", "grouped")


@pytest.mark.skipif(BACKEND == "tensorflow", reason="no packed path on tensorflow (its own test below)")
@pytest.mark.parametrize("name, kwargs, groups", [
    ("ViTBackbone", {}, 1),
    ("MoNEViTBackbone", dict(capacity=0.3), 4),
    ("MoNEViTBackbone", dict(capacity=0.25, capacity_method="mod_greedy"), 1),
    ("MoNEViTBackbone", dict(capacity=0.5, use_class_token=True, class_token_to_full_expert=True,
                             router_positions=(0, 1)), 4),
])
def test_packed_token_groups_equal_the_grouped_ones(monkeypatch, name, kwargs, groups):
    """``$KERAS_MONE_LAYOUT=packed`` (``layers.packed_block``, torch's default, opt-in on
    jax): a block's groups as row ranges of one token-major tensor give each token the
    generic path's operations in its order (outputs and gradients within float32
    rounding). On jax the packed block takes ``keras.ops`` where torch takes its own, and
    only blocks of several groups pack (one group would gain nothing)."""
    from keras_mone.layers import packed_block

    calls = []
    monkeypatch.setattr(packed_block, "token_major", _counted(packed_block.token_major, calls))
    results = _outputs_and_gradients_by_form(monkeypatch, getattr(models, name)(**TINY, **kwargs), "LAYOUT")
    assert bool(calls) == (BACKEND == "torch" or groups > 1), len(calls)
    _assert_forms_agree(results, "packed", "grouped")


@pytest.mark.skipif(BACKEND == "tensorflow", reason="no packed path on tensorflow")
def test_packed_token_groups_in_mixed_bfloat16_with_a_gate_equal_the_grouped_ones(monkeypatch):
    # bf16 compute and MoNE's gate (alpha > 0): the same function up to bf16 rounding,
    # whose order differs; 4 bf16 steps (2^-8 each) of the largest output bound it.
    from keras_mone.bench.device import precision_policy

    with precision_policy("mixed_bfloat16"):
        model = models.MoNEViTBackbone(**TINY, capacity=0.3, alpha_init=0.5)
        model.build((None, 32, 32, 3))
    randomize_weights(model, seed=4)
    outputs = {}
    for form in platform_forms.LAYOUT_FORMS:
        monkeypatch.setenv(platform_forms.LAYOUT_ENV, form)
        outputs[form] = to_numpy(keras.ops.cast(model(images()), "float32"))
    largest = float(np.abs(outputs["grouped"]).max())
    np.testing.assert_allclose(outputs["packed"], outputs["grouped"], atol=4 * 2**-8 * largest)


@pytest.mark.parametrize("name, kwargs", [
    ("MoNEViTBackbone", dict(capacity=0.3)),
    ("MoNEViTBackbone", dict(capacity=0.5, use_class_token=True, class_token_to_full_expert=True, router_positions=(0, 1))),
    ("MoNEViViTBackbone", dict(capacity=0.4)),
])
def test_one_kernel_per_nested_projection_equals_one_gemm_per_group(monkeypatch, name, kwargs):
    """``$KERAS_MONE_PROJECTIONS=grouped_kernel`` (jax: ``layers.grouped_block``'s Pallas
    kernels; torch: ``layers.packed_kernels``' Triton kernel): outputs and the gradients of an
    inference call (``training=False``: the form's calls; the kernels' backward passes
    recompute the per-group path) within float32 rounding of the per-group form; tensorflow
    names what it takes."""
    if BACKEND == "tensorflow":
        monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, "grouped_kernel")
        with pytest.raises(ValueError, match=r"KERAS_MONE_PROJECTIONS='grouped_kernel' is a Pallas kernel \(jax\) "
                                             r"or a Triton kernel \(torch\); the tensorflow backend takes 'per_group'"):
            platform_forms.projections_form()
        return
    if BACKEND == "torch":
        pytest.importorskip("triton")
    model = getattr(models, name)(**(TINY_VIDEO if "ViViT" in name else TINY), **kwargs)
    if "ViViT" in name:
        model.build((None, *videos().shape[1:]))
        randomize_weights(model, seed=4)
        x = videos()
        results = {}
        for form in ("per_group", "grouped_kernel"):
            monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, form)
            results[form] = to_numpy(model(x)), gradients(model, lambda out: keras.ops.mean(out * out), x,
                                                          model.trainable_variables, training=False)
    else:
        results = _outputs_and_gradients_by_form(monkeypatch, model, "PROJECTIONS", training=False,
                                                 forms=("per_group", "grouped_kernel"))
    assert not np.array_equal(results["grouped_kernel"][0], results["per_group"][0])  # (the kernels ran)
    _assert_forms_agree(results, "grouped_kernel", "per_group")


@pytest.mark.skipif(BACKEND == "tensorflow", reason="a Pallas (jax) or Triton (torch) kernel: the test above")
@pytest.mark.parametrize("training", [False, True])
def test_a_dense_vit_takes_the_kernels_only_under_grouped_kernel_all(monkeypatch, training):
    """``$KERAS_MONE_PROJECTIONS=grouped_kernel_all``: a dense ViT's full-width blocks run
    through the grouped kernels (jax: ``layers.grouped_block``, whose training calls take the
    backward kernels; torch: ``layers.packed_kernels``), the dense model in MoNE's fused form,
    with outputs and gradients within float32 rounding of the blocks' own GEMMs;
    ``grouped_kernel`` leaves them to those GEMMs."""
    from keras_mone.layers import block as block_module
    from keras_mone.layers import packed_block

    if BACKEND == "torch":
        pytest.importorskip("triton")
    module, name = (packed_block, "kernel_halves") if BACKEND == "torch" else (block_module, "kernel_block")
    kernel, forms = getattr(module, name), []
    monkeypatch.setattr(module, name,
                        lambda *a, **k: forms.append(platform_forms.projections_form()) or kernel(*a, **k))
    results = _outputs_and_gradients_by_form(monkeypatch, models.ViTBackbone(**TINY, use_class_token=True),
                                             "PROJECTIONS", training=training)
    assert set(forms) == {"grouped_kernel_all"} and len(forms) >= 2 * TINY["depth"]  # each block, twice
    assert np.array_equal(results["grouped_kernel"][0], results["per_group"][0])
    _assert_forms_agree(results, "grouped_kernel_all", "per_group")


@pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend (the others: the form test above)")
@pytest.mark.parametrize("name, kwargs, projections", [
    ("MoNEViTBackbone", dict(capacity=0.3), "per_group"),
    ("MoNEViTBackbone", dict(capacity=0.5, use_class_token=True), "grouped_kernel"),
    ("MoNEViViTBackbone", dict(capacity=0.4), "grouped_kernel"),
    ("ViTBackbone", dict(use_class_token=True), "per_group"),
])
def test_flash_attention_equals_the_explicit_form_in_whole_models(monkeypatch, name, kwargs, projections):
    """``$KERAS_MONE_ATTENTION=flash`` (``kernels.flash_attention``, interpreted here): outputs
    and the gradients of an inference call within float32 rounding of the explicit form,
    with one GEMM per group and with the grouped projection kernels, whose q, k and v it
    reads as they write them; heads of 16 (the kernel's smallest)."""
    from keras_mone.kernels import flash_attention

    calls = []
    monkeypatch.setattr(flash_attention, "flash_attention", _counted(flash_attention.flash_attention, calls))
    monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, projections)
    video = "ViViT" in name
    model = getattr(models, name)(**{**(TINY_VIDEO if video else TINY), "num_heads": 2}, **kwargs)
    x = videos() if video else images()
    model.build((None, *x.shape[1:]))
    randomize_weights(model, seed=5)
    results = {}
    for form in ("explicit", "flash"):
        monkeypatch.setenv(platform_forms.ATTENTION_ENV, form)
        results[form] = to_numpy(model(x)), gradients(model, lambda out: keras.ops.mean(out * out), x,
                                                      model.trainable_variables, training=False)
    assert calls  # (the kernel ran)
    _assert_forms_agree(results, "flash", "explicit")


@pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend")
def test_flash_attention_leaves_heads_the_kernel_does_not_fit_to_the_library(monkeypatch):
    """Heads of 8 (not a power of 2 of at least 16): ``keras.ops.dot_product_attention``."""
    from keras_mone.kernels import flash_attention

    calls = []
    monkeypatch.setattr(flash_attention, "flash_attention", _counted(flash_attention.flash_attention, calls))
    rng = np.random.default_rng(0)
    qkv = rng.normal(size=(2, 9, 3, 4, 8)).astype("float32")
    flash, explicit = _attention(monkeypatch, "flash", qkv), _attention(monkeypatch, "explicit", qkv)
    assert_f32_close(flash, explicit, ulps=64)
    assert not calls


def _assert_forms_agree(results, form, reference):
    """``form``'s outputs within float32 rounding of ``reference``'s, and every gradient
    within 1e-5 of the largest of its reference (``_outputs_and_gradients_by_form``)."""
    assert_f32_close(results[form][0], results[reference][0])
    for got, expected in zip(results[form][1], results[reference][1]):
        assert (got is None) == (expected is None)
        if got is not None:
            np.testing.assert_allclose(got, expected, atol=1e-5 * max(1.0, float(np.abs(expected).max())))


def _counted(function, calls):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return wrapper


def test_the_layout_default_follows_the_backend_and_tensorflow_has_no_packed_path(monkeypatch):
    monkeypatch.delenv(platform_forms.LAYOUT_ENV, raising=False)
    assert platform_forms.layout_form() == ("packed" if BACKEND == "torch" else "grouped")
    monkeypatch.setenv(platform_forms.LAYOUT_ENV, "packed")
    if BACKEND == "tensorflow":
        with pytest.raises(ValueError, match=r"\$KERAS_MONE_LAYOUT='packed' runs on jax and torch"):
            platform_forms.layout_form()
    else:
        assert platform_forms.layout_form() == "packed"
    monkeypatch.setenv(platform_forms.LAYOUT_ENV, "rows")
    with pytest.raises(ValueError, match=r"\$KERAS_MONE_LAYOUT must be one of \['grouped', 'packed'\] or unset"):
        platform_forms.layout_form()


@pytest.mark.parametrize("video", [False, True])
def test_patches_by_matmul_equal_the_strided_convolution(monkeypatch, video):
    from keras_mone.layers.patch_embedding import PatchEmbedding
    from keras_mone.layers.tubelet_embedding import TubeletEmbedding

    layer = TubeletEmbedding(4, 16, 8, 12) if video else PatchEmbedding(16, 8, 12, use_class_token=True)
    shape = (2, 4, 16, 16, 3) if video else (2, 16, 16, 3)
    layer.build(shape)
    randomize_weights(layer, seed=5)
    x = np.random.default_rng(6).normal(size=shape).astype("float32")
    outputs = {}
    for form in platform_forms.PATCHES_FORMS:
        monkeypatch.setenv(platform_forms.PATCHES_ENV, form)
        outputs[form] = to_numpy(layer(x))
    # the same 192 (or 384) products per output, summed in another order
    assert_f32_close(outputs["matmul"], outputs["conv"], ulps=64)


def test_the_gpus_patch_matmul_is_an_inference_form(monkeypatch):
    """On jax's GPU the patches are one matmul at inference and the convolution in training
    (with the matmul XLA laid the dense ViT-B/16's training step out batch-minor: 78.2 GB
    moved against 59.2, BENCHMARKS.md); ``$KERAS_MONE_PATCHES`` wins either way."""
    monkeypatch.delenv(platform_forms.PATCHES_ENV, raising=False)
    with platform_forms.compiling_for("gpu"):
        assert platform_forms.patches_form() == ("matmul" if BACKEND == "jax" else "conv")
        assert platform_forms.patches_form(training=True) == "conv"
        monkeypatch.setenv(platform_forms.PATCHES_ENV, "matmul")
        assert platform_forms.patches_form(training=True) == "matmul"


def test_reports_name_the_training_steps_patch_form(monkeypatch):
    """A benchmark's report names the patch form its training steps took where it is not
    its forwards' (jax's GPU), and one form elsewhere."""
    from keras_mone.bench.report import patches_words

    monkeypatch.delenv(platform_forms.PATCHES_ENV, raising=False)
    with platform_forms.compiling_for("gpu"):
        gpu = platform_forms.current_forms()
    assert gpu["training_patches_form"] == "conv"
    assert patches_words(gpu) == ("matmul (training steps: conv)" if BACKEND == "jax" else "conv")
    assert patches_words(platform_forms.current_forms()) == "conv"
    assert patches_words({"patches_form": "matmul"}) == "matmul"  # a report from before the training form


@pytest.mark.parametrize("family", ["vit", "vivit"])
def test_a_models_training_flag_reaches_its_patch_embedding(monkeypatch, family):
    """``training`` reaches the patch (or tubelet) embedding, which picks its form with it,
    whether the model is called or run through ``stateless_call``."""
    from keras_mone.layers import patch_embedding

    seen = []
    monkeypatch.setattr(patch_embedding, "patches_form", lambda training=False: seen.append(training) or "conv")
    if family == "vit":
        model, x = models.MoNEViTBackbone(**TINY, capacity=0.5), images()
    else:
        model, x = models.MoNEViViTBackbone(**TINY_VIDEO, capacity=0.5), videos()
    model(x, training=True)
    model(x)
    # stateless_call (jax's trainer, the benchmarks) sets no call context: the backbone passes it on
    variables = [v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables]
    model.stateless_call(*variables, x, training=True)
    assert seen == [True, False, True]


def test_a_convolution_that_is_not_a_patch_projection_stays_a_convolution(monkeypatch):
    import keras

    from keras_mone.layers.patch_embedding import strided_projection

    conv = keras.layers.Conv2D(4, 2, strides=1)
    x = np.random.default_rng(7).normal(size=(1, 6, 6, 3)).astype("float32")
    monkeypatch.setenv(platform_forms.PATCHES_ENV, "matmul")
    assert strided_projection(conv, x).shape == (1, 5, 5, 4)


def test_the_rational_gelu_equals_the_library_gelu(monkeypatch):
    from keras_mone.layers.activations import gelu

    x = np.random.default_rng(8).normal(scale=3.0, size=(16, 64)).astype("float32")
    outputs = {}
    for form in platform_forms.GELU_FORMS:
        monkeypatch.setenv(platform_forms.GELU_ENV, form)
        outputs[form] = to_numpy(gelu(x))
    assert_f32_close(outputs["rational"], outputs["library"], ulps=8)


@pytest.mark.parametrize("nested", [False, True])
def test_the_rational_gelu_keeps_bfloat16_inputs_exact_to_bfloat16_rounding(monkeypatch, nested):
    """The erf polynomial runs in float32 whatever the input: in bf16 it gave gelu(-1e4) = -39."""
    from keras_mone.layers.activations import gelu

    monkeypatch.setenv(platform_forms.GELU_ENV, "rational")
    x = np.concatenate([np.linspace(-6, 6, 2001), [-1e4, -10, -3.9, 3.9, 10, 1e4]]).astype("float32")
    exact = x * 0.5 * (1 + np.vectorize(__import__("math").erf)(x.astype("float64") / np.sqrt(2)))
    got = to_numpy(keras.ops.cast(gelu(keras.ops.cast(x, "bfloat16"), nested=nested), "float32"))
    # two bf16 ulps: input and output rounding, and tensorflow's own GELU, which computes in bf16
    # (1.5 ulps at x = 1.2); the polynomial in bf16 was 2.5 ulps off at x = -10 and 2,500 at -1e4
    assert np.all(np.abs(got - exact) <= 2.0 ** -6 * np.maximum(1.0, np.abs(exact)))


def test_routed_groups_are_written_once_on_jaxs_gpu_only(monkeypatch):
    """``nested_dense.materialized``: on jax compiling for a GPU, the token groups a router
    gathers pass one optimization barrier (each written once; XLA's fusions otherwise re-read
    the gather in every consumer and keep the ungrouped tokens alive, issue 40); the values
    are untouched. Elsewhere, and under ``$KERAS_MONE_ORDER=free``, nothing changes."""
    from keras_mone.layers.nested_dense import materialized

    monkeypatch.delenv(platform_forms.ORDER_ENV, raising=False)
    groups = [keras.ops.ones((2, 3, 4)), keras.ops.zeros((2, 5, 4))]
    with platform_forms.compiling_for("cpu"):
        assert materialized(groups) is groups
    if BACKEND != "jax":
        with platform_forms.compiling_for("gpu"):
            assert materialized(groups) is groups
        return
    import jax

    def program(*tensors):
        return jax.jit(lambda *t: materialized(list(t))).lower(*tensors).as_text()

    with platform_forms.compiling_for("gpu"):
        assert program(*groups).count("optimization_barrier") == 1
        assert [to_numpy(g).tolist() for g in materialized(groups)] == [to_numpy(g).tolist() for g in groups]
        monkeypatch.setenv(platform_forms.ORDER_ENV, "free")
        assert "optimization_barrier" not in program(*groups)
    monkeypatch.delenv(platform_forms.ORDER_ENV)
    with platform_forms.compiling_for("cpu"):
        assert "optimization_barrier" not in program(*groups)
    # a MoNE model: one barrier after its one router and one after each block (its groups'
    # residuals); a dense model none
    model = models.MoNEViTBackbone(**TINY, capacity=0.5)
    model.build((None, 32, 32, 3))
    dense = models.ViTBackbone(**TINY)
    dense.build((None, 32, 32, 3))
    # ($KERAS_MONE_RESIDUALS=half_block: one more after each block's attention; fused: none)
    outputs = {}
    for residuals, per_block in (("fused", 0), ("block", 1), ("half_block", 2)):
        monkeypatch.setenv(platform_forms.RESIDUALS_ENV, residuals)
        for backbone, barriers in ((model, 1 + per_block * TINY["depth"]), (dense, 0)):
            variables = ([v.value for v in backbone.trainable_variables],
                         [v.value for v in backbone.non_trainable_variables])
            for machine, expected in (("gpu", barriers), ("cpu", 0)):
                forward = jax.jit(lambda t, n, x, b=backbone: b.stateless_call(t, n, x)[0])  # traced afresh
                with platform_forms.compiling_for(machine):
                    assert forward.lower(*variables, images()).as_text().count("optimization_barrier") == expected
                    if backbone is model:
                        outputs[residuals, machine] = to_numpy(forward(*variables, images()))
    monkeypatch.setenv(platform_forms.ORDER_ENV, "free")  # no barrier, no tie at all
    variables = [v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables]
    with platform_forms.compiling_for("gpu"):
        forward = jax.jit(lambda t, n, x: model.stateless_call(t, n, x)[0])
        assert "optimization_barrier" not in forward.lower(*variables, images()).as_text()
        unbarred = to_numpy(forward(*variables, images()))
    for residuals in ("fused", "block", "half_block"):  # the barriers change no value
        np.testing.assert_array_equal(outputs[residuals, "gpu"], unbarred, err_msg=residuals)


@pytest.mark.skipif(BACKEND != "jax", reason="reads the temporaries of the CPU program jax compiles")
def test_the_cpus_mone_forward_keeps_no_query_sized_broadcast_of_the_attention_scale(monkeypatch, tmp_path):
    """The queries are scaled per token group before they are joined: scaling the joined
    queries made XLA's CPU materialise ``1/sqrt(head_dim)`` at the queries' shape and keep it
    through every block (MoNE-ViT-B/16 at batch 8: 4.6 of 38.6 MiB; BENCHMARKS.md)."""
    import jax

    from keras_mone.bench import hlo_memory

    monkeypatch.delenv(platform_forms.ATTENTION_ENV, raising=False)
    model = models.MoNEViTBackbone(**{**TINY, "patch_size": 4}, capacity=0.3)
    model.build((None, 32, 32, 3))
    variables = [v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables]
    forward = jax.jit(lambda t, n, x: model.stateless_call(t, n, x)[0])
    with hlo_memory.compiled_afresh():
        forward.lower(*variables, images()).compile(compiler_options=hlo_memory.dump_options(str(tmp_path)))
    memory = hlo_memory.program_memory(str(tmp_path))
    heads, head_dim = TINY["num_heads"], TINY["hidden_dim"] // TINY["num_heads"]
    query_shape = f"f32[{images().shape[0]},{heads},{(32 // 4) ** 2},{head_dim}]"  # no class token
    query_sized = [(b.name, b.op_name) for b in memory.at_peak if b.shape.startswith(query_shape)]
    # the joined q, k and v (jax's concatenate), and nothing else of their size: the scale's
    # broadcast, live through every block, was such a buffer (from no jax op)
    assert query_sized and all(op.endswith("attention/concatenate") for _, op in query_sized), query_sized
