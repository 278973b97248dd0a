"""The fused kernels' default tiles (``keras_mone/kernels/tiles.py``, framework-free): a card's
fastest tiles where it screened a kernel, the rule derived from the compiled code elsewhere."""

import pytest

from keras_mone.kernels import tiles


def test_screened_kernels_default_to_the_tiles_the_card_timed_fastest():
    # the block kernel at ViT-B/16's nested widths (H200, 2026-11-28): one warpgroup, 64 rows
    assert tiles.default_tiles(96, 3072, 2, "residual") == (64, 64, 4, 2)
    assert tiles.default_tiles(192, 3072, 2, "residual") == (64, 32, 4, 2)
    assert tiles.default_tiles(48, 1536, 2, "residual") == (64, 64, 4, 2)  # ViT-S's narrowest group
    # the Triton kernel: every width of its sweep, the last entry for anything wider
    assert [tiles.default_tiles(w, 3072, 2, "triton") for w in (96, 192, 384, 512)] == [
        (64, 64, 4, 2), (128, 32, 8, 3), (64, 16, 4, 2), (64, 16, 4, 2)]


def test_float32_keeps_the_derived_rule():
    # the screen was in bf16: float32's Triton tile at d = 192 (128 x 32, 3 stages) would need
    # 240 KB of shared memory on sm_90, past the card's 227; the rule's 128 x 16 takes 168
    for kernel in ("residual", "triton"):
        for width in (96, 192, 384):
            stages = 3 if kernel == "triton" else 2
            assert tiles.default_tiles(width, 3072, 4, kernel) == tiles.default_blocks(width, 3072, 4) + (8, stages)


def test_unscreened_kernels_and_widths_keep_the_derived_rule():
    # the Pallas MLP kernel was not screened on a card; the block kernel's d = 384 lost to XLA at every tile
    for width in (96, 192, 384):
        assert tiles.default_tiles(width, 3072, 2, "mlp") == tiles.default_blocks(width, 3072, 2) + (8, 2)
    assert tiles.default_tiles(384, 3072, 2, "residual") == (32, 64, 8, 2)


def test_the_hidden_block_fits_the_hidden_width_and_shared_memory():
    # a hidden width of 96 has power-of-2 blocks of 32 at most
    assert tiles.default_tiles(96, 96, 2, "residual") == (64, 32, 4, 2)
    # float32: halved until one weight tile (d x block x 4 bytes) is at most 48 KB
    assert tiles.fitted_hidden_block(64, 192, 3072, 4) == 64
    assert tiles.fitted_hidden_block(64, 384, 3072, 4) == 32
    assert tiles.fitted_hidden_block(64, 768, 3072, 4) == 16
    assert tiles.fitted_hidden_block(64, 1536, 3072, 4) == 16  # never below the smallest block


def test_a_kernel_runs_by_default_where_it_paid():
    # the block kernel in bf16: the card's verdict (1.50x and 1.03x XLA's path at d = 96 and 192, slower at 384)
    assert [tiles.kernel_pays(w, 3072, 2, "residual") for w in (96, 192, 384)] == [True, True, False]
    # elsewhere the weight-bytes rule: 2 d itemsize / block_rows against the 4 itemsize XLA's path moves
    assert [tiles.kernel_pays(w, 3072, 4, "residual") for w in (96, 192, 384)] == [True, True, False]
    assert [tiles.kernel_pays(w, 3072, 2, "triton") for w in (96, 192, 384)] == [True, True, False]
    assert [tiles.kernel_pays(w, 3072, 2, "mlp") for w in (96, 192, 384)] == [True, True, False]


def test_given_tiles_are_kept_and_missing_ones_filled():
    assert tiles.resolved_tiles(96, 3072, 2, None, None, None, None, "residual") == (64, 64, 4, 2)
    assert tiles.resolved_tiles(96, 3072, 2, 128, None, 8, None, "residual") == (128, 64, 8, 2)
    assert tiles.resolved_tiles(96, 3072, 2, None, None, None, 3, "triton") == (64, 64, 4, 3)


@pytest.mark.parametrize("arguments, message", [
    ((96, 3072, 2, 48, None, None, None), "`block_rows` must be a power of 2"),
    ((96, 3072, 2, None, 8, None, None), "`block_hidden` must be a power of 2 of at least 16"),
    ((96, 96, 2, None, 64, None, None), "`block_hidden`=64 must divide the MLP's hidden width 96"),
    ((96, 3072, 2, None, None, 0, None), "`num_warps` must be a positive integer, got 0"),
    ((96, 3072, 2, None, None, None, 0), "`num_stages` must be a positive integer, got 0"),
])
def test_bad_tiles_name_the_argument(arguments, message):
    with pytest.raises(ValueError, match=message):
        tiles.resolved_tiles(*arguments)


def test_an_unknown_kernel_is_named():
    with pytest.raises(ValueError, match=r"`kernel` must be one of \['mlp', 'residual', 'triton'\], got 'pallas'"):
        tiles.default_tiles(96, 3072, 2, "pallas")


def test_launchable_is_every_kernels_tile_check():
    from keras_mone.kernels.tiles import launchable

    assert launchable((64, 64, 4, 2), blocks=2) and launchable((128, 128, 64, 8, 3), blocks=3)
    assert not launchable((64, 64, 4, 2), blocks=3)  # a field short
    assert not launchable((64, 8, 4, 2), blocks=2)  # a block under Triton's smallest dot
    assert not launchable((64, 48, 4, 2), blocks=2)  # a block not a power of 2
    assert not launchable((64, 64, 6, 2), blocks=2)  # warps not a power of 2
    assert not launchable((64, 64, 4, 0), blocks=2)  # no stage
    assert not launchable((64, 64.0, 4, 2), blocks=2) and not launchable([64, 64, 4, 2], blocks=2)
