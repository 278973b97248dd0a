"""The nested MLP as one Triton kernel for torch (``keras_mone.kernels.triton_nested_mlp``):
equal to the plain torch path through Triton's interpreter (CI has no GPU), and compiled
for an H100's sm_90 without one."""

import numpy as np
import pytest
from conftest import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="a Triton kernel for the torch backend")


def _kernel_module():
    from keras_mone.kernels import triton_nested_mlp

    if not triton_nested_mlp.available():
        pytest.skip("Triton is not installed (the test extra installs it)")
    return triton_nested_mlp


def _weights(dim=96, hidden=128, dtype="float32", seed=0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    shapes = ((dim, hidden), (hidden,), (hidden, dim), (dim,))
    return [(torch.randn(shape, generator=generator) / 8).to(getattr(torch, dtype)) for shape in shapes]


@pytest.mark.parametrize("width, tiles", [(96, (32, 32)), (48, (16, 64)), (64, (64, 16)), (32, (32, 128))])
@pytest.mark.parametrize("approximate", [False, True])
def test_the_kernel_equals_the_plain_path_in_float32(width, tiles, approximate):
    """Widths cut into 3, 1 (a power of 2) and 2 chunks; rows not a multiple of the tile; both GELUs."""
    import torch

    kernel = _kernel_module()
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(1))
    weights = _weights()
    got = kernel.nested_mlp(x, *weights, width, approximate, block_rows=tiles[0], block_hidden=tiles[1])
    want = kernel.plain_nested_mlp(x.double(), *(w.double() for w in weights), width, approximate)
    assert got.shape == (70, width) and got.dtype == torch.float32
    # float32 sums of 96 + 128 products in another order: a few ulps of the largest output
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=2e-6 * float(want.abs().max()))


def test_bfloat16_agrees_with_torchs_bfloat16_path():
    """bf16 operands, float32 accumulation: within bf16 rounding of torch's own bf16 path (which
    rounds the pre-activation to bf16 before its GELU, where the kernel keeps it in float32)."""
    import torch

    kernel = _kernel_module()
    x = torch.randn(50, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    weights = _weights(dtype="bfloat16")
    got = kernel.nested_mlp(x, *weights, 96, block_rows=16, block_hidden=32).float()
    torch_path = kernel.plain_nested_mlp(x, *weights, 96).float()
    exact = kernel.plain_nested_mlp(x.double(), *(w.double() for w in weights), 96)
    scale = float(exact.abs().max())
    # two bf16 roundings (hidden activations, output), relative to the largest value; Triton
    # 3.5's interpreter casts to bf16 by truncation (a card rounds to nearest): up to 2^-7 each
    assert float((got.double() - exact).abs().max()) < 2 ** -6 * scale
    assert float((got - torch_path).abs().max()) < 2e-2 * scale


def test_writes_into_the_columns_of_a_wider_buffer_and_biases_may_be_absent():
    import torch

    kernel = _kernel_module()
    x = torch.randn(40, 96)
    w1, _, w2, _ = _weights()
    padded = torch.zeros(40, 96)
    with torch.no_grad():
        result = kernel.nested_mlp(x, w1, None, w2, None, 48, out=padded[:, :48], block_rows=16, block_hidden=32)
    assert result.data_ptr() == padded.data_ptr()
    want = kernel.plain_nested_mlp(x, w1, None, w2, None, 48)
    np.testing.assert_allclose(padded[:, :48].numpy(), want.numpy(), atol=2e-6 * float(want.abs().max()))
    assert not padded[:, 48:].any()  # the other columns are untouched
    assert kernel.nested_mlp(x[:0], w1, None, w2, None, 48).shape == (0, 48)  # no rows: no launch


def test_gradients_are_the_plain_paths():
    import torch

    kernel = _kernel_module()
    x = torch.randn(30, 96, requires_grad=True)
    weights = [w.requires_grad_() for w in _weights()]
    upstream = torch.randn(30, 96)
    grads = {}
    for name, function in (("kernel", kernel.nested_mlp), ("plain", kernel.plain_nested_mlp)):
        output = function(x, *weights, 96) if name == "plain" else function(x, *weights, 96, block_rows=16)
        grads[name] = torch.autograd.grad(output, [x, *weights], upstream)
    for got, want in zip(grads["kernel"], grads["plain"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))
    frozen = kernel.nested_mlp(x.detach(), weights[0], None, weights[2].detach(), None, 96, block_rows=16)
    (only_w1,) = torch.autograd.grad(frozen.sum(), [weights[0]])  # inputs without gradients get none
    assert only_w1.shape == weights[0].shape


def test_forward_mode_tangents_and_second_derivatives():
    """Forward-mode AD takes torch's ops (its tangent kept); second derivatives through the
    kernel's backward pass (``create_graph=True``) are the plain path's."""
    import torch
    from torch.autograd import forward_ad

    kernel = _kernel_module()
    x, direction = torch.randn(10, 96), torch.randn(10, 96)
    weights = _weights()
    with forward_ad.dual_level():
        dual = kernel.nested_mlp(forward_ad.make_dual(x, direction), *weights, 48, block_rows=16)
        tangent = forward_ad.unpack_dual(dual).tangent
    _, want = torch.func.jvp(lambda t: kernel.plain_nested_mlp(t, *weights, 48), (x,), (direction,))
    torch.testing.assert_close(tangent, want)
    second = {}
    for name, function in (("kernel", kernel.nested_mlp), ("plain", kernel.plain_nested_mlp)):
        leaf, w1 = x.clone().requires_grad_(), weights[0].clone().requires_grad_()
        (grad,) = torch.autograd.grad((function(leaf, w1, *weights[1:], 48) ** 2).sum(), [leaf], create_graph=True)
        second[name] = torch.autograd.grad(grad.pow(2).sum(), [leaf, w1])
    for got, want in zip(second["kernel"], second["plain"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_bad_arguments_are_named():
    import torch

    kernel = _kernel_module()
    x = torch.randn(8, 96)
    weights = _weights()
    with pytest.raises(ValueError, match=r"`width` must lie in \[1, 96\]"):
        kernel.nested_mlp(x, *weights, 97)
    with pytest.raises(ValueError, match="`width`=40 with hidden width 128 does not fit the kernel"):
        kernel.nested_mlp(x, *weights, 40)  # 5 chunks of 8
    with pytest.raises(ValueError, match="must share a dtype"):
        kernel.nested_mlp(x.half(), *weights, 96)
    with pytest.raises(ValueError, match="takes float16, bfloat16 or float32 rows"):
        kernel.nested_mlp(x.double(), *(w.double() for w in weights), 96)
    with pytest.raises(ValueError, match="`w1` must be contiguous in its last dimension"):
        kernel.nested_mlp(x, weights[0].t().contiguous().t(), *weights[1:], 96)
    with pytest.raises(ValueError, match=r"`out` must be a \(8, 96\) torch.float32 tensor"):
        kernel.nested_mlp(x, *weights, 96, out=torch.zeros(8, 48))
    with pytest.raises(ValueError, match="`block_rows` must be a power of 2 of at least 16"):
        kernel.nested_mlp(x, *weights, 96, block_rows=24)
    with pytest.raises(ValueError, match="`block_hidden`=256 must divide the MLP's hidden width 128"):
        kernel.nested_mlp(x, *weights, 96, block_hidden=256)
    with pytest.raises(ValueError, match="`out` takes no gradient"):
        kernel.nested_mlp(x.requires_grad_(), *weights, 96, out=torch.zeros(8, 96))
    assert kernel.kernel_fits(96, 3072) and kernel.kernel_fits(768, 3072) and not kernel.kernel_fits(40, 3072)


def test_compiles_for_an_h100_with_warpgroup_mma():
    """ViT-B/16's narrow groups in bf16 at the default tiles: Triton compiles the kernel for
    sm_90 (no GPU needed) and its dots become Hopper's ``wgmma``. In a fresh process: the
    interpreter of the tests above leaves ``triton.language`` patched."""
    from conftest import fresh_python_output

    _kernel_module()
    script = (
        "from keras_mone.kernels import triton_nested_mlp as kernel\n"
        "ptx = {width: kernel.compile_for_cuda(width, 3072, 'bf16').asm['ptx'] for width in (96, 192)}\n"
        "print(' '.join(f'{width}:{\"wgmma\" in text}' for width, text in ptx.items()))\n"
    )
    assert fresh_python_output(script) == "96:True 192:True"


def _mone_model(seed=6):
    from conftest import images, randomize_weights

    from keras_mone import models

    # nested widths 24 (chunks of 8: too small for tl.dot, torch's ops), 48 and 96 (three chunks of
    # 16 and 32: the kernel), and the full 192
    config = dict(image_size=32, patch_size=8, hidden_dim=192, depth=2, num_heads=4, mlp_dim=128)
    model = models.ImageClassifier(models.MoNEViTBackbone(**config, capacity=0.5), num_classes=5)
    model(images()[:1])  # built: every weight exists to be randomised
    randomize_weights(model, seed=seed)
    return model


def _counting_kernel(monkeypatch):
    from keras_mone.kernels import triton_nested_mlp

    widths = []
    original = triton_nested_mlp.nested_mlp
    monkeypatch.setattr(triton_nested_mlp, "nested_mlp", lambda *a, **k: widths.append(a[5]) or original(*a, **k))
    return widths


def test_a_mone_vit_on_eager_torch_takes_the_kernel_and_agrees(monkeypatch):
    """``$KERAS_MONE_MLP=fused`` on torch: the packed blocks run every nested group's MLP through
    the Triton kernel (interpreted here), written into the block's padded buffer, and the
    logits are the plain path's."""
    import torch
    from conftest import assert_f32_close, images

    from keras_mone.layers import platform_forms

    _kernel_module()
    model = _mone_model()
    widths = _counting_kernel(monkeypatch)
    x = images()
    logits = {}
    for form in ("fused", "plain"):
        monkeypatch.setenv(platform_forms.MLP_ENV, form)
        with torch.no_grad():
            logits[form] = model(x).cpu().numpy()
    assert set(widths) == {48, 96}  # in both blocks; 24 does not fit the kernel, 192 is not nested
    assert np.abs(logits["plain"]).max() > 0.1  # randomised weights: logits that can disagree
    assert_f32_close(logits["fused"], logits["plain"])


def test_training_gradients_through_the_kernel_are_the_plain_paths(monkeypatch):
    import torch
    from conftest import assert_f32_close, images

    from keras_mone.layers import platform_forms

    _kernel_module()
    model = _mone_model(seed=7)
    widths = _counting_kernel(monkeypatch)
    x = torch.as_tensor(images())
    grads = {}
    for form in ("fused", "plain"):
        monkeypatch.setenv(platform_forms.MLP_ENV, form)
        loss = (model(x, training=True) ** 2).sum()
        grads[form] = torch.autograd.grad(loss, [v.value for v in model.trainable_variables])
    assert set(widths) == {48, 96}
    assert sum(float(g.abs().max()) > 0 for g in grads["plain"]) > len(grads["plain"]) // 2
    for got, want in zip(grads["fused"], grads["plain"]):
        assert_f32_close(got.cpu().numpy(), want.cpu().numpy(), ulps=256)


def test_the_gpu_benchmark_script_runs_and_checks_every_setting(monkeypatch):
    """``bench/triton_mlp.py`` (in ``bench/gpu.sh``) at a tiny size, interpreted: a width too
    narrow for the kernel is named, the others checked against torch's ops and timed."""
    import pathlib

    _kernel_module()
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import triton_mlp

    text = triton_mlp.main(["--batch-size", "1", "--tokens", "24", "--dim", "192", "--hidden", "128",
                            "--repeats", "1"])
    assert "| 24 | 12 | does not fit the kernel" in text
    rows = [line for line in text.splitlines() if line.startswith("| 48 ") or line.startswith("| 96 ")]
    assert len(rows) == 2 and all("defaults" in row and "not timed" not in row for row in rows)
    assert [n for n, _ in triton_mlp.group_shapes(0.3, 196, 768)] == [84, 61, 37]  # ViT-B/16's nested groups
    # --budget: every width's defaults are timed; the sweep settings past the budget are named, not timed
    text = triton_mlp.main(["--batch-size", "1", "--tokens", "24", "--dim", "192", "--hidden", "128",
                            "--repeats", "1", "--sweep", "--budget", "0"])
    grid = len(triton_mlp.settings(48, 128, True)) - 1
    assert grid > 0 and f"Not timed (--budget 0 s spent): d = 48: {grid} of {grid} settings; d = 96: " in text
    rows = [line for line in text.splitlines() if line.startswith("| 48 ") or line.startswith("| 96 ")]
    assert len(rows) == 2 and all("defaults" in row for row in rows)
    for budget in ("-1", "nan"):  # refused before anything is timed
        with pytest.raises(SystemExit) as refused:
            triton_mlp.main(["--sweep", "--budget", budget])
        assert refused.value.code == 2


def test_paths_outside_the_packed_blocks_keep_torchs_ops(monkeypatch):
    """A ``NestedMLP`` called on its own and a block that is not packed (received attention
    asked for) run torch's ops under ``$KERAS_MONE_MLP=fused``: the Pallas kernels are jax's."""
    import torch
    from conftest import assert_f32_close, randomize_weights

    from keras_mone.layers import NestedMLP, platform_forms

    _kernel_module()
    widths = _counting_kernel(monkeypatch)
    layer = NestedMLP(96, 128)
    layer.build((None, None, 96))
    randomize_weights(layer, seed=3)
    x = torch.randn(2, 5, 96)
    outputs = {}
    for form in ("fused", "plain"):
        monkeypatch.setenv(platform_forms.MLP_ENV, form)
        outputs[form] = layer(x, width=48).detach().cpu().numpy()
    assert_f32_close(outputs["fused"], outputs["plain"])
    block = _mone_model().backbone.blocks[0]
    groups = [torch.randn(2, 3, 192), torch.randn(2, 4, 192)]
    monkeypatch.setenv(platform_forms.MLP_ENV, "fused")
    with torch.no_grad():
        outputs, received = block(groups, widths=[48, 96], return_received_attention=True)
    assert [tuple(o.shape) for o in outputs] == [(2, 3, 192), (2, 4, 192)] and received is not None
    assert widths == []
