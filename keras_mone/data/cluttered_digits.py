"""Cluttered digits: a small, download-free image / video benchmark for token routing.

Source images are scikit-learn's bundled 8x8 handwritten digits (1797 images,
values 0-16). Each digit is upscaled bilinearly by ``digit_scale`` (2 -> 16 px,
3 -> 24 px), colour-tinted and pasted at a random place on a larger canvas,
together with ``clutter`` colour-tinted fragments cut from *other* digits of the
same split and light uniform noise. Most patch tokens are background, so a model
that routes digit tokens to its larger experts loses little accuracy.

The 1797 source digits are split 80/20 (stratified by class) by a fixed
permutation that does not depend on ``seed``, *before* augmentation: test images
show source digits (and clutter) never seen in training. Everything else is
drawn from a ``numpy.random.Generator`` seeded by ``(seed, split)``, so equal
arguments give identical arrays. Generated arrays are cached in memory; callers
get copies.
"""

import functools
import importlib.util
import os

import numpy as np

NUM_CLASSES = 10
SOURCE_SIZE = 8
NUM_SOURCE_DIGITS = 1797
TEST_FRACTION = 0.2

_SPLIT_SEED = 20240901
_SPLITS = ("train", "test")
_MASK_THRESHOLD = 0.25  # digit pixels: upscaled intensity above this (of 1)
_DIGIT_BRIGHTNESS = (0.75, 1.0)
_CLUTTER_BRIGHTNESS = (0.5, 1.0)
_FRAGMENT_FRACTION = 0.4  # fragment side / digit side
_CACHE_SIZE = 8


# ----------------------------------------------------------------------------
# Source digits and split
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _source_digits():
    """``(images (1797, 8, 8) float32 in [0, 1], labels (1797,) int64)``."""
    spec = importlib.util.find_spec("sklearn")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(
            spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz"
        )
    if path is not None and os.path.exists(path):
        # Same file and parsing as sklearn.datasets.load_digits, without
        # importing scikit-learn (which takes seconds).
        flat = np.loadtxt(path, delimiter=",")
        data, target = flat[:, :-1], flat[:, -1]
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError as e:  # pragma: no cover - sklearn is installed in dev
            raise ImportError(
                "keras_mone.data needs scikit-learn for its bundled 8x8 digits: "
                "pip install scikit-learn"
            ) from e
        digits = load_digits()
        data, target = digits.data, digits.target
    images = (data.reshape(-1, SOURCE_SIZE, SOURCE_SIZE) / 16.0).astype(np.float32)
    return images, target.astype(np.int64)


@functools.lru_cache(maxsize=None)
def _split_indices():
    """Fixed, class-stratified 80/20 split of the source digits."""
    _, labels = _source_digits()
    rng = np.random.default_rng(_SPLIT_SEED)
    train, test = [], []
    for c in range(NUM_CLASSES):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(TEST_FRACTION * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return {"train": np.sort(np.concatenate(train)), "test": np.sort(np.concatenate(test))}


def source_indices(split="train"):
    """Indices into ``sklearn.datasets.load_digits()`` of the source digits of ``split``.

    The split is fixed (independent of any ``seed``): 1438 train, 359 test.
    """
    _check_split(split)
    return _split_indices()[split].copy()


@functools.lru_cache(maxsize=4)
def _upscaled_digits(digit_scale):
    from scipy import ndimage

    images, _ = _source_digits()
    size = _digit_size(digit_scale)
    zoom = size / SOURCE_SIZE
    up = ndimage.zoom(images, (1.0, zoom, zoom), order=1)
    return np.clip(up, 0.0, 1.0).astype(np.float32)


# ----------------------------------------------------------------------------
# Rendering helpers (vectorised over the batch)
# ----------------------------------------------------------------------------


def _digit_size(digit_scale):
    if not digit_scale > 0:
        raise ValueError(f"digit_scale must be positive, got {digit_scale!r}.")
    return int(round(SOURCE_SIZE * digit_scale))


def _check_split(split):
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}.")


def _rng(seed, split, kind):
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}.")
    return np.random.default_rng([int(seed), _SPLITS.index(split), kind])


def _tints(rng, n, brightness):
    """Random RGB tints with max channel = brightness in ``[lo, hi]``, shape (n, 3)."""
    color = rng.uniform(0.2, 1.0, size=(n, 3)).astype(np.float32)
    color /= color.max(axis=1, keepdims=True)
    return color * rng.uniform(*brightness, size=(n, 1)).astype(np.float32)


def _grid(y, x, h, w):
    """Advanced-index triple selecting an (h, w) window at (y, x) per batch row."""
    n = np.arange(len(y))[:, None, None]
    rows = y[:, None, None] + np.arange(h)[None, :, None]
    cols = x[:, None, None] + np.arange(w)[None, None, :]
    return n, rows, cols


def _paste_max(canvas, patches, colors, y, x):
    """``canvas[n, y:y+h, x:x+w] = max(canvas, patch * color)``; canvas (N, H, W, 3)."""
    idx = _grid(y, x, patches.shape[1], patches.shape[2])
    layer = patches[..., None] * colors[:, None, None, :]
    canvas[idx] = np.maximum(canvas[idx], layer)


def _clutter_layer(rng, up, pool_pos, pool, image_size, clutter):
    """Canvas (N, H, W, 3) of ``clutter`` fragments from other digits of the pool."""
    n = len(pool_pos)
    d = up.shape[1]
    f = max(2, int(round(_FRAGMENT_FRACTION * d)))
    margin = d // 8
    canvas = np.zeros((n, image_size, image_size, 3), np.float32)
    sources = np.empty((n, clutter), np.int64)
    for k in range(clutter):
        # Another digit of the same split (never the image's own source digit).
        other = pool[(pool_pos + rng.integers(1, len(pool), size=n)) % len(pool)]
        sources[:, k] = other
        cy = rng.integers(margin, d - f - margin + 1, size=n)
        cx = rng.integers(margin, d - f - margin + 1, size=n)
        _, rows, cols = _grid(cy, cx, f, f)
        fragments = up[other[:, None, None], rows, cols]
        y = rng.integers(0, image_size - f + 1, size=n)
        x = rng.integers(0, image_size - f + 1, size=n)
        _paste_max(canvas, fragments, _tints(rng, n, _CLUTTER_BRIGHTNESS), y, x)
    return canvas, sources


def _check_common(image_size, digit_scale, samples_per_digit, clutter, noise, position_step=1):
    d = _digit_size(digit_scale)
    if not isinstance(position_step, (int, np.integer)) or position_step < 1:
        raise ValueError(f"position_step must be an int >= 1, got {position_step!r}.")
    if not isinstance(image_size, (int, np.integer)) or image_size < d:
        raise ValueError(
            f"image_size must be an int >= the digit size {d} "
            f"(8 * digit_scale), got {image_size!r}."
        )
    if not isinstance(samples_per_digit, (int, np.integer)) or samples_per_digit < 1:
        raise ValueError(f"samples_per_digit must be an int >= 1, got {samples_per_digit!r}.")
    if not isinstance(clutter, (int, np.integer)) or clutter < 0:
        raise ValueError(f"clutter must be an int >= 0, got {clutter!r}.")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise!r}.")
    return d


def _draw_sources(rng, split, samples_per_digit):
    """Shuffled source ids (each pool digit ``samples_per_digit`` times) and pool positions."""
    pool = _split_indices()[split]
    pool_pos = rng.permutation(np.repeat(np.arange(len(pool)), samples_per_digit))
    return pool, pool_pos


def _finish(rng, canvas, noise):
    if noise > 0:
        canvas += noise * rng.random(canvas.shape, dtype=np.float32)
    np.clip(canvas, 0.0, 1.0, out=canvas)
    return canvas


# ----------------------------------------------------------------------------
# Still images
# ----------------------------------------------------------------------------


def render_cluttered(src_positions, pool, rng, image_size, digit_scale, clutter, noise, position_step=1):
    """Renders one cluttered image per entry of ``src_positions`` (positions in ``pool``).

    Returns ``(images, labels, masks, info)`` as :func:`load_cluttered_digits`
    documents them; every random draw comes from ``rng``.
    """
    up = _upscaled_digits(digit_scale)
    _, source_labels = _source_digits()
    d = up.shape[1]
    src = pool[src_positions]
    n = len(src)

    canvas, clutter_sources = _clutter_layer(rng, up, src_positions, pool, image_size, clutter)
    slots = (image_size - d) // position_step + 1  # allowed offsets per axis
    y = rng.integers(0, slots, size=n) * position_step
    x = rng.integers(0, slots, size=n) * position_step
    _paste_max(canvas, up[src], _tints(rng, n, _DIGIT_BRIGHTNESS), y, x)
    masks = np.zeros((n, image_size, image_size), bool)
    masks[_grid(y, x, d, d)] = up[src] > _MASK_THRESHOLD
    images = _finish(rng, canvas, noise)

    info = {
        "boxes": np.stack([y, x, y + d, x + d], axis=1),
        "source_index": src,
        "clutter_source_index": clutter_sources,
    }
    return images, source_labels[src], masks, info


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _render_cluttered(image_size, digit_scale, samples_per_digit, clutter, noise, seed, split, position_step):
    rng = _rng(seed, split, kind=0)
    pool, pool_pos = _draw_sources(rng, split, samples_per_digit)
    return render_cluttered(pool_pos, pool, rng, image_size, digit_scale, clutter, noise, position_step)


def load_cluttered_digits(
    image_size=32,
    digit_scale=2,
    samples_per_digit=1,
    clutter=4,
    noise=0.1,
    seed=0,
    split="train",
    return_masks=False,
    return_info=False,
    position_step=1,
):
    """A fixed set of cluttered-digit images and labels (see the module docstring).

    For training, :class:`keras_mone.data.ClutteredDigitsStream` renders fresh
    images every epoch instead.

    Args:
        image_size: side of the square canvas in pixels.
        digit_scale: upscaling of the 8x8 digit (digit side ``round(8 * digit_scale)``).
        samples_per_digit: random renderings per source digit (1438 train /
            359 test source digits).
        clutter: number of digit fragments scattered over the canvas.
        noise: amplitude of additive uniform per-pixel, per-channel noise.
        seed: non-negative int; with ``split`` it determines every random draw.
        position_step: the digit's top-left corner lies on multiples of this
            many pixels; the patch size makes every digit cover whole patches,
            so its tokens look alike wherever it is (1 = any pixel).
        split: ``"train"`` or ``"test"`` (disjoint source digits, fixed split).
        return_masks: also return the (N, H, W) bool mask of digit pixels.
        return_info: also return a dict with ``"boxes"`` (N, 4) int
            ``[y0, x0, y1, x1]`` of the pasted digit, ``"source_index"`` (N,) and
            ``"clutter_source_index"`` (N, clutter) indices into ``load_digits()``.

    Returns:
        ``(images, labels[, masks][, info])``: images (N, H, W, 3) float32 in
        ``[0, 1]``, labels (N,) int64 in 0-9, N = ``samples_per_digit`` * pool
        size, in shuffled order.
    """
    _check_split(split)
    _check_common(image_size, digit_scale, samples_per_digit, clutter, noise, position_step)
    images, labels, masks, info = _render_cluttered(
        int(image_size), digit_scale, int(samples_per_digit), int(clutter),
        float(noise), int(seed), split, int(position_step),
    )
    return _outputs(images, labels, masks, info, return_masks, return_info)


# ----------------------------------------------------------------------------
# Utilities
# ----------------------------------------------------------------------------


def _outputs(images, labels, masks, info, return_masks, return_info):
    out = [images.copy(), labels.copy()]
    if return_masks:
        out.append(masks.copy())
    if return_info:
        out.append({k: v.copy() for k, v in info.items()})
    return tuple(out)


def patch_coverage(masks, patch_size):
    """Fraction of digit pixels in each non-overlapping patch, in token order.

    Args:
        masks: bool array (..., H, W), e.g. from ``return_masks=True``.
        patch_size: patch side; must divide H and W.

    Returns:
        float32 array (..., (H // p) * (W // p)) in row-major (ViT token) order.
    """
    masks = np.asarray(masks)
    *lead, h, w = masks.shape
    p = int(patch_size)
    if p < 1 or h % p or w % p:
        raise ValueError(f"patch_size {patch_size!r} must divide the mask size {(h, w)}.")
    blocks = masks.reshape(*lead, h // p, p, w // p, p).astype(np.float32)
    return blocks.mean(axis=(-3, -1)).reshape(*lead, (h // p) * (w // p))


def clear_cache():
    """Drop the in-memory cached images (``keras_mone.data.clear_cache`` also drops the videos)."""
    _render_cluttered.cache_clear()
    _upscaled_digits.cache_clear()
