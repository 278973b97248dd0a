"""torch: a packed block takes the groups cut from one token-major tensor back whole (issue 40 item 3).

A packed block's outputs, and the router's single gather, are ``(batch, k_j, D)`` views of
one token-major tensor (``routing.token_major.cut_groups``); the next packed block needs
that tensor again. Eager torch found it from the views' storage, but ``torch.compile``
cannot read storage, so each block's input was one concatenation: a copy of the block's
rows wherever inductor cannot fuse it into the reader (the Triton projections). These
tests check the tags that replace the storage test: the tensor back exactly when the
groups are its first views in order, ``None`` otherwise, and no concatenation of a packed
block's input, eager, under ``torch.inference_mode`` and under ``torch.compile``. Skipped
on jax and tensorflow (the packed blocks' layout is torch's).
"""

import numpy as np
import pytest
from conftest import BACKEND, TINY, images, randomize_weights

from keras_mone.routing.token_major import cut_groups, tagged_whole

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="the packed blocks' token-major layout is torch's")

if BACKEND == "torch":
    import torch


def _whole(rows=10, batch=3, dim=4):
    return torch.arange(rows * batch * dim, dtype=torch.float32).reshape(rows, batch, dim)


def test_cut_groups_are_tagged_views_of_the_token_major_rows():
    whole = _whole()
    groups = cut_groups(whole, [2, 5, 3])
    expected = np.split(whole.numpy(), [2, 7], axis=0)
    for group, part in zip(groups, expected):
        assert group.shape == (3, part.shape[0], 4)
        np.testing.assert_array_equal(group.numpy(), part.transpose(1, 0, 2))
        assert group.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # a view, no copy
    assert tagged_whole(groups) is whole
    assert tagged_whole(groups[:1]) is not None and tagged_whole(groups[:1]).shape == (2, 3, 4)


def test_fewer_groups_give_the_first_rows_without_a_copy():
    """The router's gather when tokens are dropped: the groups are its first rows, the rest pass."""
    whole = _whole()
    first = tagged_whole(cut_groups(whole, [2, 5])[:2])
    assert first.shape == (7, 3, 4) and first.data_ptr() == whole.data_ptr()
    np.testing.assert_array_equal(first.numpy(), whole.numpy()[:7])


@pytest.mark.parametrize("case", ["reordered", "without_the_first", "a_copy", "two_wholes", "two_cuts",
                                  "reshaped_in_place", "untagged", "none"])
def test_groups_that_are_not_the_first_views_in_order_have_no_whole(case):
    whole = _whole()
    groups = cut_groups(whole, [2, 5, 3])
    others = cut_groups(_whole(), [2, 5, 3])
    chosen = {
        "reordered": [groups[1], groups[0], groups[2]],
        "without_the_first": groups[1:],
        "a_copy": [groups[0].clone(), groups[1], groups[2]],
        "two_wholes": [groups[0], others[1], groups[2]],
        "two_cuts": [cut_groups(whole, [1, 2])[0], cut_groups(whole, [2, 2])[1]],  # rows 0 and 2-3, not 0-2
        "reshaped_in_place": [groups[0].transpose_(0, 1), groups[1], groups[2]],
        "untagged": [g.transpose(0, 1).transpose(0, 1) for g in groups],
        "none": [],
    }[case]
    assert tagged_whole(chosen) is None


def _mone(depth=4):
    from keras_mone.models import MoNEViTBackbone

    model = MoNEViTBackbone(**{**TINY, "depth": depth}, capacity=0.3)
    model.build()
    randomize_weights(model, seed=5)
    return model


def _concatenated_block_inputs(monkeypatch):
    """The packed blocks' concatenations of token groups (3-D parts; the gates' joins are 2-D)."""
    from keras_mone.layers import packed_block

    joined, stack = [], packed_block._stack
    monkeypatch.setattr(packed_block, "_stack", lambda parts: joined.append(parts[0].dim()) or stack(parts))
    return joined


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "training", "compiled"])
def test_no_packed_block_concatenates_its_input(monkeypatch, mode):
    """MoNE, four packed blocks: every block's input is the router's gather or the block
    before's output, taken back whole, in every mode; the compiled forward equals the eager
    one (inductor's own fusions: float32 rounding)."""
    model = _mone()
    x = torch.as_tensor(images())
    with torch.no_grad():
        eager = model(x).numpy()
    joined = _concatenated_block_inputs(monkeypatch)
    if mode == "compiled":
        torch._dynamo.reset()
        with torch.no_grad():
            outputs = torch.compile(lambda t: model(t))(x)
    elif mode == "training":
        outputs = model(x, training=True)
        outputs.sum().backward()
    else:
        with getattr(torch, mode)():
            outputs = model(x)
    assert 3 not in joined, f"{joined.count(3)} concatenated block inputs"
    np.testing.assert_allclose(outputs.detach().numpy(), eager, rtol=1e-5, atol=1e-5)
