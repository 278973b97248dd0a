"""Moving digits: the bundled video task, a cluttered digit moving in a straight line.

Each clip shows one source digit (rendered as in
:mod:`keras_mone.data.cluttered_digits`: tinted, over static clutter, with fresh
noise every frame) moving ``speed`` pixels per frame in one of
:data:`DIRECTIONS`. The label combines what the digit is and where it goes
(:data:`MOVING_TARGETS`), so a model needs both space and time. Source digits
are split train / test exactly as for the still images.

``position_step`` and ``speed_step`` put the motion on the tubelet grid: with
4-pixel patches, 2-frame tubelets, ``position_step=4`` and ``speed_step=2``, the
digit covers whole patches in the first frame of every tubelet, so its tokens
look alike wherever it is (the still images' ``position_step`` did the same).
"""

import functools
import math

import numpy as np

from keras_mone.data import cluttered_digits as base

#: Moving-digit directions; a direction's index is its label component.
DIRECTIONS = ("right", "left", "down", "up")
#: ``(dy, dx)`` unit steps of :data:`DIRECTIONS` (rows grow downwards).
DIRECTION_STEPS = ((0, 1), (0, -1), (1, 0), (-1, 0))
#: Label spaces of :func:`load_moving_digits`: name -> number of classes.
MOVING_TARGETS = {"digit_direction": 40, "parity_direction": 8, "direction": 4, "digit": 10}


def allowed_speeds(num_frames, image_size, digit_scale, max_speed=None, speed_step=1, position_step=1):
    """Speeds (pixels per frame) a clip may have: multiples of ``speed_step`` up
    to ``max_speed`` (``None``: the fastest that keeps the digit on the canvas).

    Raises ``ValueError`` naming the argument when no speed fits.
    """
    d = base._digit_size(digit_scale)
    if not isinstance(num_frames, (int, np.integer)) or num_frames < 2:
        raise ValueError(f"num_frames must be an int >= 2, got {num_frames!r}.")
    if not isinstance(speed_step, (int, np.integer)) or speed_step < 1:
        raise ValueError(f"speed_step must be an int >= 1, got {speed_step!r}.")
    room = image_size - d
    # Fastest speed whose whole path, started on the position grid, stays on the canvas.
    fit = 0
    for speed in range(1, room // (num_frames - 1) + 1):
        travel = speed * (num_frames - 1)
        if math.ceil(travel / position_step) * position_step <= room:
            fit = speed
    if max_speed is None:
        max_speed = fit
    if not isinstance(max_speed, (int, np.integer)) or not 1 <= max_speed <= fit:
        raise ValueError(
            f"max_speed must be an int in [1, {fit}] so that a {d}px digit stays on a "
            f"{image_size}px canvas for {num_frames} frames (starting on multiples of "
            f"position_step={position_step}), got {max_speed!r}"
            + (" (use a larger image_size or fewer frames)." if fit < 1 else ".")
        )
    speeds = np.arange(speed_step, max_speed + 1, speed_step)
    if len(speeds) == 0:
        raise ValueError(f"speed_step must be <= max_speed ({max_speed}), got {speed_step!r}.")
    return speeds


def _starts(rng, lo, hi, step):
    """Uniform draws of multiples of ``step`` in ``[lo, hi]`` (arrays of bounds)."""
    first = -(-lo // step) * step
    count = (hi - first) // step + 1
    return first + (rng.random(len(lo)) * count).astype(np.int64) * step


def render_moving(
    src_positions, pool, rng, num_frames, image_size, digit_scale, clutter, noise, speeds,
    position_step=1, target="digit_direction",
):
    """Renders one clip per entry of ``src_positions`` (positions in ``pool``).

    Returns ``(videos, labels, masks, info)`` as :func:`load_moving_digits`
    documents them; every random draw comes from ``rng``.
    """
    up = base._upscaled_digits(digit_scale)
    _, source_labels = base._source_digits()
    d = up.shape[1]
    room = image_size - d
    src = pool[src_positions]
    n, t_max = len(src), num_frames - 1

    background, clutter_sources = base._clutter_layer(rng, up, src_positions, pool, image_size, clutter)
    direction = rng.permutation(np.arange(n) % len(DIRECTIONS))  # balanced
    speed = np.asarray(speeds)[rng.integers(0, len(speeds), size=n)]
    steps = np.asarray(DIRECTION_STEPS)[direction]  # (n, 2) as (dy, dx)
    travel = speed * t_max
    start = np.empty((n, 2), np.int64)
    for axis in range(2):
        step = steps[:, axis]
        free = rng.integers(0, room // position_step + 1, size=n) * position_step  # axis without motion
        lo = np.where(step < 0, travel, 0)
        hi = np.where(step > 0, room - travel, room)
        start[:, axis] = np.where(step == 0, free, _starts(rng, lo, hi, position_step))

    colors = base._tints(rng, n, base._DIGIT_BRIGHTNESS)
    digit_mask = up[src] > base._MASK_THRESHOLD
    videos = np.repeat(background[:, None], num_frames, axis=1)
    masks = np.zeros((n, num_frames, image_size, image_size), bool)
    positions = start[:, None, :] + steps[:, None, :] * speed[:, None, None] * np.arange(
        num_frames
    )[None, :, None]  # (n, T, 2)
    for t in range(num_frames):
        y, x = positions[:, t, 0], positions[:, t, 1]
        base._paste_max(videos[:, t], up[src], colors, y, x)
        masks[:, t][base._grid(y, x, d, d)] = digit_mask
    videos = base._finish(rng, videos, noise)

    digit = source_labels[src]
    labels = {
        "digit_direction": digit * 4 + direction,
        "parity_direction": (digit % 2) * 4 + direction,
        "direction": direction,
        "digit": digit,
    }[target].astype(np.int64)
    info = {
        "boxes": np.concatenate([positions, positions + d], axis=-1),  # (n, T, 4)
        "digit": digit,
        "direction": direction,
        "speed": speed,
        "source_index": src,
        "clutter_source_index": clutter_sources,
    }
    return videos, labels, masks, info


@functools.lru_cache(maxsize=2)  # videos are large (1438 x 8 x 32 x 32 x 3 = 141 MB)
def _render_moving(
    num_frames, image_size, digit_scale, samples_per_digit, clutter, noise, speeds, target, seed, split,
    position_step,
):
    rng = base._rng(seed, split, kind=1)
    pool, pool_pos = base._draw_sources(rng, split, samples_per_digit)
    return render_moving(
        pool_pos, pool, rng, num_frames, image_size, digit_scale, clutter, noise, speeds, position_step, target
    )


def check_moving(num_frames, image_size, digit_scale, samples_per_digit, clutter, noise, max_speed,
                 speed_step, position_step, target):
    """Validates :func:`load_moving_digits` arguments; returns the allowed speeds as a tuple."""
    base._check_common(image_size, digit_scale, samples_per_digit, clutter, noise, position_step)
    if target not in MOVING_TARGETS:
        raise ValueError(f"target must be one of {tuple(MOVING_TARGETS)}, got {target!r}.")
    speeds = allowed_speeds(num_frames, image_size, digit_scale, max_speed, speed_step, position_step)
    return tuple(int(s) for s in speeds)


def load_moving_digits(
    num_frames=8,
    image_size=32,
    digit_scale=2,
    samples_per_digit=1,
    clutter=4,
    noise=0.1,
    max_speed=None,
    target="digit_direction",
    seed=0,
    split="train",
    return_masks=False,
    return_info=False,
    position_step=1,
    speed_step=1,
):
    """A fixed set of moving-digit clips and labels (see the module docstring).

    For training, :class:`keras_mone.data.MovingDigitsStream` renders fresh
    clips every epoch instead. Speeds are balanced only in distribution;
    directions are balanced exactly within a split.

    Args:
        num_frames: frames per clip (>= 2).
        max_speed: fastest speed in pixels per frame; ``None`` uses the largest
            that keeps the digit on the canvas.
        speed_step: speeds are the multiples of this in ``[speed_step, max_speed]``.
        position_step: the digit's start lies on multiples of this many pixels
            (with ``speed_step``, puts the digit on the patch grid every few frames).
        target: label space, one of :data:`MOVING_TARGETS`:
            ``"digit_direction"`` (``digit * 4 + direction``, 40 classes),
            ``"parity_direction"`` (``(digit % 2) * 4 + direction``, 8),
            ``"direction"`` (4) or ``"digit"`` (10).
        return_masks: also return the (N, T, H, W) bool digit masks.
        return_info: also return a dict with ``"boxes"`` (N, T, 4), ``"digit"``,
            ``"direction"``, ``"speed"``, ``"source_index"`` and
            ``"clutter_source_index"``.
        Other arguments: as in :func:`keras_mone.data.load_cluttered_digits`.

    Returns:
        ``(videos, labels[, masks][, info])``: videos (N, T, H, W, 3) float32
        in ``[0, 1]``, labels (N,) int64.
    """
    base._check_split(split)
    speeds = check_moving(
        num_frames, image_size, digit_scale, samples_per_digit, clutter, noise, max_speed, speed_step,
        position_step, target,
    )
    videos, labels, masks, info = _render_moving(
        int(num_frames), int(image_size), digit_scale, int(samples_per_digit), int(clutter),
        float(noise), speeds, target, int(seed), split, int(position_step),
    )
    return base._outputs(videos, labels, masks, info, return_masks, return_info)


def clear_cache():
    """Drop all in-memory cached datasets (images and videos)."""
    base.clear_cache()
    _render_moving.cache_clear()
