"""Tiny recipe overrides shared by the training tests (recipes, resume, distribution)."""

from conftest import TINY

TINY_MODEL = {k: v for k, v in TINY.items() if k != "image_size"}


def tiny_overrides(tmp_path, **extra):
    """The CPU cluttered-digits recipe shrunk to the TINY geometry, a few steps."""
    overrides = dict(
        image_size=TINY["image_size"],
        model_args=dict(TINY_MODEL),
        samples_per_digit=1,
        test_samples_per_digit=1,
        epochs=1,
        steps_per_epoch=4,
        batch_size=16,
        eval_batch_size=64,
        warmup_fraction=0.0,
        checkpoint_steps=0,
        output_dir=str(tmp_path),
    )
    overrides.update(extra)
    return overrides
