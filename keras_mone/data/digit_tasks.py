"""The bundled digit tasks' loader arguments from a recipe's keys (the recipes, publishing and the quickstart share them)."""


def cluttered_digits_arguments(recipe, split):
    """Arguments of ``load_cluttered_digits`` (and ``pipeline.cluttered_digits_source``)
    for ``split`` ("train" or "test") of a digits recipe, also the part the video
    task shares; the test split is rendered from ``test_seed``, the fixed
    training set from ``seed``."""
    train = split == "train"
    return dict(
        split=split, image_size=recipe["image_size"], digit_scale=recipe["digit_scale"],
        clutter=recipe["clutter"], position_step=recipe["position_step"],
        samples_per_digit=recipe["samples_per_digit"] if train else recipe["test_samples_per_digit"],
        seed=recipe["seed"] if train else recipe["test_seed"],
    )


def moving_digits_arguments(recipe, split):
    """Arguments of ``video_pipeline.moving_digits_source`` for ``split`` of a
    moving-digits recipe: clips just long enough for ``num_frames`` frames
    ``frame_stride`` apart."""
    return dict(
        cluttered_digits_arguments(recipe, split),
        num_frames=(recipe["num_frames"] - 1) * recipe["frame_stride"] + 1,
        target=recipe["digits_target"], speed_step=recipe["speed_step"],
    )
