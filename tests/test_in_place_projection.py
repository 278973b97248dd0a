"""An inference out-projection writing into its residual's buffer, only its groups' column tiles (issue 40).

MoNE's out-projections (App. A.1 Eq. 7) write a token's first ``d_g`` features; past them the
block's residual stream is the residual unchanged. ``grouped_projection(..., in_place=True)``
aliases the output to the residual (and, with row sums, the sums to the residual's), and its
programs past a group's width read and store nothing. These tests check that the values are the
full write's, the sums the residual's where the tiles were left, that a differentiated call
and misfitting sums fall back to the full write, that a traced MoNE ViT runs its
out-projections in place and predicts what it predicts per group, and the roofline's count.
Through Pallas' interpreter; skipped on tensorflow and torch.
"""

import numpy as np
import pytest
from conftest import BACKEND, assert_f32_close, normal32

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend")

TILES = (16, 16, 16, 4, 1)  # four column tiles of 16 at N = 64
GROUPS = ((5, 16), (0, 32), (4, 40), (3, 64))  # an empty group, a width inside a tile, the full width


def _operands(seed=0, dtype="float32"):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    x, residual = normal32(rng, 2, 12, 64), normal32(rng, 2, 12, 64)
    w, b = 0.1 * normal32(rng, 64, 64), 0.1 * normal32(rng, 64)
    return jnp.asarray(x, dtype), jnp.asarray(w), jnp.asarray(b), jnp.asarray(residual, dtype)


def _launches(monkeypatch):
    from keras_mone.kernels import grouped_projection as kernels

    flags, original = [], kernels.pallas_projection
    monkeypatch.setattr(kernels, "pallas_projection",
                        lambda *a, **k: flags.append(k.get("in_place", False)) or original(*a, **k))
    return flags


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gated", [False, True])
def test_in_place_gives_the_full_writes_values_and_the_residuals_sums_past_the_groups(monkeypatch, dtype, gated):
    import jax.numpy as jnp

    from keras_mone.kernels.grouped_projection import grouped_projection
    from keras_mone.kernels.row_sums import plain_row_sums

    x, w, b, residual = _operands(1, dtype)
    scale = (jnp.asarray(np.random.default_rng(2).random((2, 12)), dtype), jnp.float32(0.5)) if gated else None
    sums = plain_row_sums(residual, 4, 1e-6)
    shifted = type(sums)(sums.sums + 1000.0, sums.squares + 1000.0, 64, 1e-6)  # marks the tiles left as they are
    full, full_sums = grouped_projection(x, w, b, GROUPS, "out", residual=residual, scale=scale,
                                         statistics_epsilon=1e-6, tiles=TILES, interpret=True)
    flags = _launches(monkeypatch)
    out, out_sums = grouped_projection(x, w, b, GROUPS, "out", residual=residual, scale=scale, statistics_epsilon=1e-6,
                                       tiles=TILES, interpret=True, in_place=True, residual_sums=shifted)
    assert flags == [True]
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(full, np.float32))  # bit for bit
    # each group's tiles up to its width are summed anew, the others are the residual's (here shifted)
    spans = np.concatenate([np.full(size, -(-width // 16)) for size, width in GROUPS])
    kept = np.arange(4)[:, None, None] >= spans[None, None, :]
    for got, fresh, given in ((out_sums.sums, full_sums.sums, shifted.sums),
                              (out_sums.squares, full_sums.squares, shifted.squares)):
        got, fresh, given = (np.asarray(t) for t in (got, fresh, given))
        np.testing.assert_array_equal(got[np.broadcast_to(kept, got.shape)], given[np.broadcast_to(kept, got.shape)])
        assert_f32_close(got[~np.broadcast_to(kept, got.shape)], fresh[~np.broadcast_to(kept, got.shape)], ulps=8)


def test_without_row_sums_and_under_jit_the_residual_stays_the_callers():
    """No statistics: only the output aliases the residual. Under ``jax.jit`` the residual given
    as an argument is still the caller's afterwards (XLA copies it; in a model's trace it is dead)."""
    import jax

    from keras_mone.kernels.grouped_projection import grouped_projection

    x, w, b, residual = _operands(3)
    before = np.asarray(residual).copy()
    call = jax.jit(lambda x, r: grouped_projection(x, w, b, GROUPS, "out", residual=r, tiles=TILES, interpret=True,
                                                   in_place=True))
    full = grouped_projection(x, w, b, GROUPS, "out", residual=residual, tiles=TILES, interpret=True)
    np.testing.assert_array_equal(np.asarray(call(x, residual)), np.asarray(full))
    np.testing.assert_array_equal(np.asarray(residual), before)


def test_a_differentiated_call_and_misfitting_sums_write_every_tile(monkeypatch):
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.grouped_projection import grouped_projection
    from keras_mone.kernels.row_sums import plain_row_sums

    x, w, b, residual = _operands(4)

    def loss(x, r, in_place):
        return jnp.sum(grouped_projection(x, w, b, GROUPS, "out", residual=r, tiles=TILES, interpret=True,
                                          in_place=in_place) ** 2)

    # (a gradient's forward pass is the custom VJP's, which writes every tile and keeps the residual)
    grads = [jax.grad(loss, argnums=(0, 1))(x, residual, in_place) for in_place in (True, False)]
    for got, expected in zip(*grads):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    from keras_mone.kernels import grouped_projection as kernels

    decided, decide = [], kernels._in_place  # (the launch is compiled once per form: what each call decides)
    monkeypatch.setattr(kernels, "_in_place", lambda *a: decided.append(decide(*a)[0]) or decide(*a))
    other_tiles = plain_row_sums(residual, 2, 1e-6)  # sums per two column tiles, not this kernel's four
    grouped_projection(x, w, b, GROUPS, "out", residual=residual, statistics_epsilon=1e-6, tiles=TILES,
                       interpret=True, in_place=True, residual_sums=other_tiles)
    grouped_projection(x, w, b, GROUPS, "out", residual=residual, statistics_epsilon=1e-6, tiles=TILES,
                       interpret=True, in_place=True)  # no sums given
    grouped_projection(x, w, b, GROUPS, "out", residual=residual.astype(jnp.bfloat16), tiles=TILES, interpret=True,
                       in_place=True)  # the residual in another dtype than x's
    assert decided == [False, False, False]
    with pytest.raises(ValueError, match=r"`in_place` belongs to side 'out' with a `residual`"):
        grouped_projection(x, w, b, GROUPS, "out", tiles=TILES, interpret=True, in_place=True)


def test_a_traced_mone_vit_projects_in_place_and_predicts_what_it_predicts_per_group(monkeypatch):
    """``predict`` (a trace): every out-projection in place but the attention's of the block
    after the router (its stream's sums are not a kernel's); eager calls write every tile."""
    from keras_mone.models import MoNEViTBackbone

    monkeypatch.setenv("KERAS_MONE_STATISTICS", "one_pass")
    model = MoNEViTBackbone(image_size=16, patch_size=4, hidden_dim=32, depth=4, num_heads=4,
                            mlp_dim=64, capacity=0.4, router_positions=(1,), alpha_init=0.5)
    images = np.random.default_rng(6).normal(size=(3, 16, 16, 3)).astype("float32")
    per_group = model.predict(images, verbose=0)
    from keras_mone.kernels import grouped_projection as kernels

    launched, original = [], kernels.grouped_projection
    monkeypatch.setattr(kernels, "grouped_projection", lambda *a, **k: launched.append(
        (a[4], k.get("in_place", False), k.get("residual_sums") is not None)) or original(*a, **k))
    monkeypatch.setenv("KERAS_MONE_PROJECTIONS", "grouped_kernel")
    model.make_predict_function(force=True)
    kernel = model.predict(images, verbose=0)
    assert_f32_close(kernel, per_group, ulps=256)
    outs = [flags for flags in launched if flags[0] == "out"]
    # blocks 1-3: the attention's out-projection (the first without its stream's sums), then fc2
    assert outs == [("out", True, False), ("out", True, True)] + [("out", True, True)] * 4
    launched.clear()
    assert_f32_close(np.asarray(model(images)), per_group, ulps=256)
    assert {flags[1] for flags in launched} == {False}


def test_the_roofline_counts_only_the_tiles_written_in_place():
    from keras_mone.kernels.grouped_projection import kernel_label, labelled_cost

    groups = ((84, 96), (61, 192), (37, 384), (14, 768))
    rows, batch = 256 * 196, 256
    full = labelled_cost(kernel_label("out", 3072, 768, batch, groups, residual=True, sums=6), 2)[1]
    name = kernel_label("out", 3072, 768, batch, groups, residual=True, sums=6, in_place=6)
    assert "_sums6_inplace6_k3072" in name
    touched = batch * (84 * 1 + 61 * 2 + 37 * 3 + 14 * 6)  # rows by the 128-column tiles each group's width spans
    saved = 2 * 2 * (rows * 768 - touched * 128) + 8 * (rows * 6 - touched)  # residual read and output, sums
    assert labelled_cost(name, 2)[1] == full - saved
