"""``keras-mone finetune PRESET DATA_DIR [KEY=VALUE ...]``: a preset trained on your image folder.

The recipe it runs is ``keras_mone.recipes.finetune.plan``'s; the run
directory, resume (the same command again), ``--restart`` and the results
are those of ``keras-mone train``.
"""

import sys


def add_subcommand(commands):
    """Adds ``finetune`` to the ``keras-mone`` parser."""
    finetune = commands.add_parser(
        "finetune",
        help="fine-tune a preset (shipped, converted or a preset folder) on an image folder; resumes",
        description=(
            "Fine-tunes PRESET on DATA_DIR (DATA_DIR/train/<class>/*.png|jpg, with val/ or test/ beside it if "
            "you have one, or simply DATA_DIR/<class>/*): the preset's model and weights, a new head when the "
            "class count differs, the bundled CPU recipe of its architecture for the rest. KEY=VALUE sets any "
            "recipe key (epochs=5 learning_rate=1e-4 batch_size=32 output_dir=...)."
        ),
    )
    finetune.add_argument("preset", help="preset name (keras-mone presets list), preset folder or hub handle")
    finetune.add_argument("data_dir", help="the image folder")
    finetune.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe keys, e.g. epochs=5")
    finetune.add_argument(
        "--eval-fraction", type=float, default=0.2,
        help="share of the training images held out for evaluation when DATA_DIR has no val/ or test/ (default 0.2)",
    )
    finetune.add_argument(
        "--restart", action="store_true",
        help="start over: move the run directory's old run to previous/<n>/",
    )
    finetune.set_defaults(run=run)
    return finetune


def run(args):
    from keras_mone.recipes import RecipeError, parse_overrides
    from keras_mone.recipes import finetune

    try:
        setup, notes = finetune.load(
            args.preset, args.data_dir, args.eval_fraction, resume=not args.restart,
            **parse_overrides(args.overrides),
        )
    except (RecipeError, ValueError, FileNotFoundError, ImportError) as error:  # ImportError: tf.data absent
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"Fine-tuning {args.preset} on {args.data_dir}:")
    for note in notes:
        print(f"  {note}")
    return fit_and_report(setup)


def fit_and_report(setup):
    """Trains a built recipe (``keras-mone train`` and ``finetune``): where it resumes, its plan,
    then its results; 1 if training diverged (nothing non-finite saved), else 0."""
    from keras_mone.training.checkpoint import TrainingDiverged

    if setup.initial_step:
        print(f"Resuming {setup.name} at step {setup.initial_step} of {setup.total_steps}")
    print(f"Training {setup.name}: {setup.epochs} epochs x {setup.steps_per_epoch} steps -> {setup.output_dir}")
    try:
        results = setup.fit()
    except TrainingDiverged as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in results.items()))
    return 0
