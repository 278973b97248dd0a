"""Tests of the bundled cluttered-digits datasets (numpy only, backend-independent)."""

import numpy as np
import pytest

from keras_mone.data import (
    DIRECTIONS,
    MOVING_TARGETS,
    clear_cache,
    load_cluttered_digits,
    load_moving_digits,
    patch_coverage,
    source_indices,
)
from keras_mone.data.moving_digits import DIRECTION_STEPS
from keras_mone.data.digit_stream import ClutteredDigitsStream, MovingDigitsStream

# Small clips keep the video tests fast.
VIDEO = dict(num_frames=4, image_size=32, split="test")


@pytest.fixture(scope="module")
def train():
    return load_cluttered_digits(split="train", return_masks=True, return_info=True)


@pytest.fixture(scope="module")
def video():
    return load_moving_digits(**VIDEO, return_masks=True, return_info=True)


# ----------------------------------------------------------------------------
# Still images
# ----------------------------------------------------------------------------


def test_determinism():
    a, la = load_cluttered_digits(seed=3, split="test")
    clear_cache()  # regenerate rather than hit the cache
    b, lb = load_cluttered_digits(seed=3, split="test")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(la, lb)
    c, _ = load_cluttered_digits(seed=4, split="test")
    assert not np.array_equal(a, c)


def test_returns_copies_of_cache():
    a, la = load_cluttered_digits(split="test")
    a[:] = -1.0
    la[:] = -1
    b, lb = load_cluttered_digits(split="test")
    assert b.min() >= 0.0 and lb.min() >= 0


@pytest.mark.parametrize("image_size,digit_scale", [(32, 2), (48, 3)])
def test_shapes_dtypes_range(image_size, digit_scale):
    x, y, m = load_cluttered_digits(
        image_size=image_size, digit_scale=digit_scale, split="test", return_masks=True
    )
    n = len(source_indices("test"))
    assert x.shape == (n, image_size, image_size, 3) and x.dtype == np.float32
    assert y.shape == (n,) and np.issubdtype(y.dtype, np.integer)
    assert m.shape == (n, image_size, image_size) and m.dtype == bool
    assert 0.0 <= x.min() and x.max() <= 1.0
    # Digits occupy a minority of the canvas: most tokens are background.
    assert 0.03 < m.mean() < 0.3


def test_samples_per_digit_and_channels():
    x, y, info = load_cluttered_digits(samples_per_digit=3, split="test", return_info=True)
    src = source_indices("test")
    assert len(x) == 3 * len(src)
    np.testing.assert_array_equal(np.bincount(info["source_index"])[src], 3)
    # Random tints: colour channels are not all equal.
    assert np.abs(x[..., 0] - x[..., 1]).mean() > 0.01


def test_labels_range_and_balance(train):
    _, y, _, _ = train
    assert y.min() == 0 and y.max() == 9
    counts = np.bincount(y, minlength=10)
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()


def test_labels_match_source_digits(train):
    from keras_mone.data.cluttered_digits import _source_digits

    _, y, _, info = train
    np.testing.assert_array_equal(y, _source_digits()[1][info["source_index"]])


def test_split_is_fixed_and_disjoint():
    tr, te = source_indices("train"), source_indices("test")
    assert len(np.intersect1d(tr, te)) == 0
    assert len(tr) + len(te) == 1797
    assert 0.18 < len(te) / 1797 < 0.22
    for seed in (0, 1):
        for split, pool in (("train", tr), ("test", te)):
            _, _, info = load_cluttered_digits(seed=seed, split=split, return_info=True)
            # Neither the digit nor any clutter fragment comes from the other split.
            assert np.isin(info["source_index"], pool).all()
            assert np.isin(info["clutter_source_index"], pool).all()
            assert (info["clutter_source_index"] != info["source_index"][:, None]).all()


def test_masks_align_with_digit(train):
    x, _, m, info = train
    brightness = x.max(axis=-1)
    inside = brightness[m].mean()
    outside = brightness[~m].mean()
    assert inside > 0.5 and outside < 0.25 and inside > outside + 0.3
    # Every mask is non-empty and inside its box.
    assert m.any(axis=(1, 2)).all()
    ys, xs = np.nonzero(m[0])
    y0, x0, y1, x1 = info["boxes"][0]
    assert ys.min() >= y0 and ys.max() < y1 and xs.min() >= x0 and xs.max() < x1
    boxes = info["boxes"]
    box_area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    assert (m.sum(axis=(1, 2)) <= box_area).all()


def test_patch_coverage(train):
    _, _, m, _ = train
    cov = patch_coverage(m, 4)
    assert cov.shape == (len(m), 64) and cov.dtype == np.float32
    assert 0.0 <= cov.min() and cov.max() <= 1.0
    np.testing.assert_allclose(cov.sum(axis=1) * 16, m.sum(axis=(1, 2)), rtol=1e-5)
    # Row-major token order: the top-left patch is the first token.
    np.testing.assert_allclose(cov[:, 0], m[:, :4, :4].mean(axis=(1, 2)), rtol=1e-6)
    assert (cov == 0).mean() > 0.5  # most tokens are pure background
    with pytest.raises(ValueError):
        patch_coverage(m, 5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(split="val"),
        dict(image_size=12),
        dict(digit_scale=0),
        dict(samples_per_digit=0),
        dict(clutter=-1),
        dict(seed=-1),
        dict(noise=2.0),
    ],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        load_cluttered_digits(**kwargs)


# ----------------------------------------------------------------------------
# Moving digits
# ----------------------------------------------------------------------------


def test_video_shapes_and_labels(video):
    v, y, m, info = video
    n, t = len(source_indices("test")), VIDEO["num_frames"]
    assert v.shape == (n, t, 32, 32, 3) and v.dtype == np.float32
    assert m.shape == (n, t, 32, 32) and m.dtype == bool
    assert 0.0 <= v.min() and v.max() <= 1.0
    assert y.min() >= 0 and y.max() < MOVING_TARGETS["digit_direction"]
    np.testing.assert_array_equal(y // 4, info["digit"])
    np.testing.assert_array_equal(y % 4, info["direction"])
    counts = np.bincount(info["direction"], minlength=len(DIRECTIONS))
    assert counts.max() - counts.min() <= 1  # balanced directions


def test_video_determinism_and_split():
    a, la, ia = load_moving_digits(**VIDEO, seed=5, return_info=True)
    clear_cache()
    b, lb = load_moving_digits(**VIDEO, seed=5)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(la, lb)
    c, _ = load_moving_digits(**VIDEO, seed=6)
    assert not np.array_equal(a, c)
    assert np.isin(ia["source_index"], source_indices("test")).all()
    assert np.isin(ia["clutter_source_index"], source_indices("test")).all()


def test_video_moves_in_labelled_direction(video):
    v, _, m, info = video
    grid_y, grid_x = np.mgrid[:32, :32]
    area = m.sum(axis=(2, 3))
    assert (area > 0).all()
    cy = (m * grid_y).sum(axis=(2, 3)) / area
    cx = (m * grid_x).sum(axis=(2, 3)) / area
    dy, dx = cy[:, -1] - cy[:, 0], cx[:, -1] - cx[:, 0]
    steps = np.asarray(DIRECTION_STEPS)[info["direction"]]
    travel = info["speed"] * (VIDEO["num_frames"] - 1)
    np.testing.assert_allclose(dy, steps[:, 0] * travel, atol=1e-4)
    np.testing.assert_allclose(dx, steps[:, 1] * travel, atol=1e-4)
    # Pixels follow the mask: the digit is brighter where the mask is.
    b = v.max(axis=-1)
    assert b[m].mean() > b[~m].mean() + 0.3
    # Static clutter: outside the digit's path consecutive frames differ only by noise.
    still = ~(m.any(axis=1, keepdims=True))
    diff = np.abs(np.diff(v.max(axis=-1), axis=1))
    assert diff[np.broadcast_to(still[:, :1], diff.shape)].mean() < 0.1


@pytest.mark.parametrize("target", sorted(MOVING_TARGETS))
def test_video_targets(target):
    _, y, info = load_moving_digits(**VIDEO, target=target, clutter=0, return_info=True)
    assert y.min() == 0 and y.max() == MOVING_TARGETS[target] - 1
    expected = {
        "digit_direction": info["digit"] * 4 + info["direction"],
        "parity_direction": (info["digit"] % 2) * 4 + info["direction"],
        "direction": info["direction"],
        "digit": info["digit"],
    }[target]
    np.testing.assert_array_equal(y, expected)


def test_video_invalid_arguments():
    with pytest.raises(ValueError):
        load_moving_digits(num_frames=1)
    with pytest.raises(ValueError):
        load_moving_digits(num_frames=20, image_size=32)  # the digit cannot move 19 steps
    with pytest.raises(ValueError):
        load_moving_digits(max_speed=5)
    with pytest.raises(ValueError):
        load_moving_digits(target="colour")


# ----------------------------------------------------------------------------
# Fresh renderings every epoch (ClutteredDigitsStream) and aligned positions
# ----------------------------------------------------------------------------

STREAM = dict(batch_size=64, samples_per_digit=2, image_size=32, digit_scale=2, position_step=4)
VIDEO_STREAM = dict(
    batch_size=16, samples_per_digit=1, num_frames=4, image_size=32, digit_scale=1.0, position_step=4,
    speed_step=2,
)
STREAMS = {
    "images": lambda **kw: ClutteredDigitsStream(**{**STREAM, **kw}),
    "videos": lambda **kw: MovingDigitsStream(**{**VIDEO_STREAM, **kw}),
}


@pytest.mark.parametrize("kind", sorted(STREAMS))
def test_stream_is_deterministic_per_seed_epoch_and_batch(kind):
    stream = STREAMS[kind](seed=5)
    again = STREAMS[kind](seed=5)
    last = 2 * stream.steps_per_epoch + 3
    # Any batch on its own equals the same batch reached by iterating (exact resume).
    from_start = [b for _, b in zip(range(last + 1), stream.iterate(0))]
    np.testing.assert_array_equal(again.batch(last)[0], from_start[last][0])
    np.testing.assert_array_equal(again.batch(last)[1], from_start[last][1])
    resumed = next(again.iterate(last))
    np.testing.assert_array_equal(resumed[0], from_start[last][0])
    # Every epoch renders new images; another seed renders others.
    first, second = stream.batch(0)[0], stream.batch(stream.steps_per_epoch)[0]
    assert not np.array_equal(first, second)
    assert not np.array_equal(first, STREAMS[kind](seed=6).batch(0)[0])


@pytest.mark.parametrize("kind", sorted(STREAMS))
def test_stream_epoch_shows_every_training_digit_equally_often(kind):
    stream = STREAMS[kind](seed=0)
    epoch = stream.epoch_order(1)
    counts = np.bincount(epoch, minlength=len(stream.pool))
    assert (counts == stream.samples_per_digit).all()
    sources = np.concatenate([stream.render(stream.steps_per_epoch + i)[3]["source_index"]
                              for i in range(stream.steps_per_epoch)])
    assert len(sources) == stream.steps_per_epoch * stream.batch_size
    assert not set(sources) & set(source_indices("test"))  # never a test digit


def test_stream_batches_are_model_ready():
    stream = ClutteredDigitsStream(seed=0, num_classes=12, **STREAM)
    images, labels = stream.batch(3)
    assert images.shape == (64, 32, 32, 3) and images.dtype == np.float32
    assert -1.0 <= images.min() and images.max() <= 1.0
    assert labels.shape == (64, 12) and (labels.sum(axis=1) == 1).all() and labels[:, 10:].sum() == 0


@pytest.mark.parametrize("step", [1, 4, 8])
def test_position_step_aligns_digits_with_patches(step):
    _, _, masks, info = load_cluttered_digits(split="test", position_step=step, return_masks=True, return_info=True)
    assert (info["boxes"][:, :2] % step == 0).all()
    if step == 4:  # a 16 px digit then covers exactly 4 x 4 whole patches
        covered = (patch_coverage(masks, 4) > 0).sum(axis=1)
        assert covered.max() <= 16


@pytest.mark.parametrize(
    "kwargs",
    [dict(batch_size=0), dict(batch_size=10**7), dict(seed=-1), dict(position_step=0), dict(num_classes=3)],
)
def test_stream_invalid_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ClutteredDigitsStream(**{"batch_size": 8, **kwargs})


def test_video_stream_batches_are_model_ready():
    stream = MovingDigitsStream(seed=0, **VIDEO_STREAM)
    clips, labels = stream.batch(2)
    assert clips.shape == (16, 4, 32, 32, 3) and clips.dtype == np.float32
    assert -1.0 <= clips.min() and clips.max() <= 1.0
    assert labels.shape == (16, 40) and (labels.sum(axis=1) == 1).all()


def test_video_motion_on_the_tubelet_grid():
    """position_step 4 + speed_step 2: the digit is on the 4 px grid every other frame."""
    videos, _, masks, info = load_moving_digits(
        num_frames=8, digit_scale=1.0, position_step=4, speed_step=2, split="test",
        return_masks=True, return_info=True,
    )
    assert (info["speed"] == 2).all()  # the only multiple of 2 that fits 7 steps of an 8 px digit on 32 px
    assert (info["boxes"][:, ::2, :2] % 4 == 0).all()
    assert (info["boxes"][:, 1::2, :2] % 4 != 0).any(axis=-1).all()  # moved half a patch in between
    covered = (patch_coverage(masks[:, ::2], 4) > 0).sum(axis=-1)
    assert covered.max() <= 4  # an 8 px digit on the grid covers at most 2 x 2 patches


def test_video_stream_frame_stride_keeps_every_strideth_frame():
    stream = MovingDigitsStream(seed=1, frame_stride=2, **{**VIDEO_STREAM, "speed_step": 1, "max_speed": 1})
    clips, _, _, info = stream.render(0)
    assert clips.shape[1] == 4 and info["boxes"].shape[1] == 7  # 7 frames rendered, 4 kept
    moved = np.abs(np.diff(info["boxes"][:, ::2, :2], axis=1)).sum(axis=-1)
    assert (moved == 2).all()  # 1 px per rendered frame, 2 between kept frames


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(speed_step=0), "speed_step"), (dict(speed_step=9), "speed_step"), (dict(frame_stride=0), "frame_stride"),
     (dict(num_frames=1), "num_frames"), (dict(num_classes=39), "num_classes"), (dict(target="colour"), "target"),
     (dict(max_speed=9), "max_speed")],
)
def test_video_stream_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MovingDigitsStream(**{**VIDEO_STREAM, **kwargs})
