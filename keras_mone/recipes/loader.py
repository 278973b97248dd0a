"""Recipes as data: ``load(name_or_path, **overrides)`` -> everything ``model.fit`` needs.

Run directory (``output_dir``, default ``runs/<recipe>``)::

    recipe.toml          the resolved recipe (every key, overrides applied); a
                         resume with other keys is refused (run_directory)
    checkpoint/          model + optimizer state, saved every checkpoint_steps
                         and at epoch ends, the newest two kept, never a
                         non-finite one (resume: run the same command again)
    previous/<n>/        the files of runs moved aside by a restart
    history.csv          per-epoch metrics (appended across resumptions)
    model.keras          the trained model (written when training finishes)
    results.json         final evaluation metrics, MACs per image, steps

A recipe with ``phases`` runs several modes in one directory
(``keras_mone.recipes.phases``: ``load`` returns a ``PhasedSetup``). Every key
is checked, and the backbone constructed without weights (its argument
checks), before the run directory is touched. A mode's ``prepare`` gets the
recipe plus ``"load_teacher"``: ``() ->`` the model ``teacher_from`` (else
``init_from``) names, loaded (``None`` if neither is set); ACM's conversion
phases take their dense teacher from it.
"""

import dataclasses
import json
import os

import keras

from keras_mone.data import pipeline, video_pipeline
from keras_mone.recipes import schema
from keras_mone.recipes.builders import checkpoint_dir, make_callbacks, make_loss, make_optimizer, training_mode
from keras_mone.recipes.data_sources import (
    MissingExtra, check_source_labels, data_sources, digits_stream, in_memory_eval_data,
)
from keras_mone.recipes.files import resolve
from keras_mone.recipes.model import _saved_model, build_classifier, init_from_saved_model
from keras_mone.recipes.phases import PhasedSetup, preflight
from keras_mone.recipes.run_directory import claim, to_toml
from keras_mone.training import checkpoint as checkpoint_lib
from keras_mone.training.distribution import check_supported, distribution_scope, num_replicas
from keras_mone.training.distribution import resolve as resolve_distribution
from keras_mone.training.losses import FullWidthAccuracy


@dataclasses.dataclass
class TrainingSetup:
    """A recipe, built: pass the pieces to ``model.fit``, or call ``fit()``.

    ``model`` is compiled (``optimizer``, ``loss``, ``metrics``) and restored
    from ``output_dir/checkpoint`` if one exists (``initial_step`` > 0).
    ``train_data`` starts at ``initial_step``; ``fit_kwargs()`` gives the rest
    of the arguments of a plain ``model.fit(train_data, **fit_kwargs())``.
    """

    name: str
    recipe: dict
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    loss: keras.losses.Loss
    train_data: object
    eval_data: object
    callbacks: list
    epochs: int
    steps_per_epoch: int
    initial_step: int
    make_train_data: object  # start_step -> dataset
    distribution: str = "none"  # the recipe's, "auto" resolved
    num_devices: int = 1

    @property
    def output_dir(self):
        return self.recipe["output_dir"]

    @property
    def total_steps(self):
        return self.epochs * self.steps_per_epoch

    def fit_kwargs(self):
        return dict(
            epochs=self.epochs, steps_per_epoch=self.steps_per_epoch,
            initial_epoch=self.initial_step // self.steps_per_epoch,
            validation_data=self.eval_data, callbacks=self.callbacks,
            shuffle=False,  # the tf.data pipeline shuffles (and knows its position)
        )

    def fit(self, extra_callbacks=(), verbose="auto", save=True):
        """Trains to ``epochs``, resuming mid-epoch where a previous run stopped.

        Returns the final evaluation results (also written to ``results.json``).
        """
        callbacks = list(self.callbacks) + list(extra_callbacks)
        guard = next(c for c in callbacks if isinstance(c, checkpoint_lib.StepCheckpoint))
        step, spe = self.initial_step, self.steps_per_epoch
        data = self.train_data
        if step % spe:  # finish the interrupted epoch first
            self.model.fit(
                data, initial_epoch=step // spe, epochs=step // spe + 1, steps_per_epoch=spe - step % spe,
                validation_data=self.eval_data, callbacks=callbacks, verbose=verbose, shuffle=False,
            )
            self._check_divergence(guard)
            step = (step // spe + 1) * spe
            data = self.make_train_data(step)
        if step < self.total_steps:
            self.model.fit(
                data, initial_epoch=step // spe, epochs=self.epochs, steps_per_epoch=spe,
                validation_data=self.eval_data, callbacks=callbacks, verbose=verbose, shuffle=False,
            )
            self._check_divergence(guard)
        results = self.evaluate()
        if save:
            self.model.save(os.path.join(self.output_dir, "model.keras"))
            with open(os.path.join(self.output_dir, "results.json"), "w") as f:
                json.dump(results, f, indent=2)
        return results

    def _check_divergence(self, guard):
        if guard.diverged_step is None:
            return
        directory = guard.directory
        last = checkpoint_lib.saved_step(directory)
        where = f"the last good checkpoint is step {last} in {directory!r}" if last is not None else "no checkpoint was written"
        raise checkpoint_lib.TrainingDiverged(
            f"{self.name}: training diverged (non-finite loss or weights) at step {guard.diverged_step}; "
            f"nothing non-finite was saved, {where}, model.keras and results.json were not written."
        )

    def evaluate(self):
        from keras_mone.analysis import flops

        results = {
            "recipe": self.name,
            "backend": keras.backend.backend(),
            "steps": int(keras.ops.convert_to_numpy(self.optimizer.iterations)),
            "gmacs": flops(self.model).gmacs,
            "distribution": self.distribution,
            "devices": self.num_devices,
        }
        if self.eval_data is not None:
            metrics = self.model.evaluate(self.eval_data, verbose=0, return_dict=True)
            results.update({k: float(v) for k, v in metrics.items()})
        return results


def load(name_or_path, resume=True, **overrides):
    """Builds recipe ``name_or_path`` (a bundled name or a .toml path).

    Args:
        resume: restore ``output_dir/checkpoint`` if present.
        **overrides: recipe keys (``model_args`` as a dict), e.g.
            ``load("augreg_vit_b16_i1k", epochs=1, batch_size=8)``.

    Returns:
        A ``TrainingSetup`` (a ``PhasedSetup`` for a recipe with ``phases``).
    """
    recipe, name = resolve(name_or_path, **overrides)
    try:  # e.g. data_parallel on torch: refused before the run directory is touched
        check_supported(recipe["distribution"])
    except ValueError as error:
        raise schema.RecipeError(f"recipe {name!r}: key 'distribution': {error}") from error
    if recipe["phases"]:
        return PhasedSetup(recipe, name, resume, _load_resolved)
    preflight(recipe, name)
    return _load_resolved(recipe, name, resume)


def _load_resolved(recipe, name, resume):
    """``load`` of one resolved (validated) recipe."""
    keras.utils.set_random_seed(recipe["seed"])
    train_source, eval_source = _read_sources(recipe, name)
    claim(recipe, name, resume)  # refuses another recipe's checkpoints before anything is built
    stream = digits_stream(recipe) if train_source is None else None
    num_classes = recipe["num_classes"] or (stream or train_source).num_classes
    for source in (train_source, eval_source):  # labels known up front: refused before the model is built
        check_source_labels(source, num_classes, name)
    steps_per_epoch = _steps_per_epoch(recipe, stream, train_source)
    directory = recipe["output_dir"]

    distribution = resolve_distribution(recipe["distribution"])
    with distribution_scope(distribution, recipe["model_parallel_size"]):
        replicas = num_replicas(distribution)
        _check_batches_divide(recipe, name, replicas)
        model = _build_model(recipe, name, num_classes)
        epochs = _prepare_mode(recipe, name, model)
        optimizer, loss = _compile(recipe, model, epochs * steps_per_epoch, steps_per_epoch)
        initial_step = _restore(recipe, name, model, resume)

    with open(os.path.join(directory, "recipe.toml"), "w") as f:
        f.write(to_toml(recipe, name))

    make_train_data = _train_data_maker(recipe, stream, train_source, num_classes)
    full_batches = distribution != "none"  # every device an equal share; padding weighs 0
    eval_data = _eval_data(recipe, eval_source, num_classes, full_batches)
    return TrainingSetup(
        name=name, recipe=recipe, model=model, optimizer=optimizer, loss=loss,
        train_data=make_train_data(initial_step), eval_data=eval_data,
        callbacks=make_callbacks(recipe, model, eval_data), epochs=epochs, steps_per_epoch=steps_per_epoch,
        initial_step=initial_step, make_train_data=make_train_data,
        distribution=distribution, num_devices=replicas,
    )


def _read_sources(recipe, name):
    """The recipe's ``(train, eval)`` data sources; a missing optional extra raises ``MissingExtra``."""
    try:  # read before the run directory is claimed: a missing tensorflow writes nothing
        return data_sources(recipe)
    except ImportError as error:
        raise MissingExtra(f"recipe {name!r}: {error}") from error


def _steps_per_epoch(recipe, stream, train_source):
    """The recipe's ``steps_per_epoch``, else one pass over the stream or the training source."""
    return recipe["steps_per_epoch"] or (
        stream.steps_per_epoch if stream else max(1, train_source.num_examples // recipe["batch_size"])
    )


def _check_batches_divide(recipe, name, replicas):
    """Refuses a training or evaluation batch that the devices cannot share equally."""
    batch = recipe["batch_size"]
    for key, size in (("batch_size", batch), ("eval_batch_size", recipe["eval_batch_size"] or batch)):
        if size % replicas:
            raise schema.RecipeError(
                f"recipe {name!r}: key {key!r} ({size}) must be divisible by the {replicas} devices."
            )


def _build_model(recipe, name, num_classes):
    """The recipe's classifier, its weights taken from ``init_from`` if set."""
    model = build_classifier(recipe, num_classes)
    if recipe["init_from"]:
        try:
            init_from_saved_model(model, os.path.expanduser(recipe["init_from"]), prune=recipe["init_prune"])
        except ValueError as error:
            raise schema.RecipeError(f"recipe {name!r}: key 'init_from': {error}") from error
    return model


def _prepare_mode(recipe, name, model):
    """Lets the recipe's training mode prepare ``model`` and set its loss terms; returns the epochs to train."""
    mode = training_mode(recipe)
    epochs = mode.epochs(recipe, model.backbone, recipe["epochs"])
    try:
        mode.prepare({**recipe, "load_teacher": lambda: _teacher(recipe)}, model)
    except ValueError as error:
        raise schema.RecipeError(f"recipe {name!r}: {error}") from error
    terms = mode.loss_terms(recipe, model)
    if terms:  # the mode's own loss terms (else the model's defaults), logged by name
        model.set_loss_terms(terms)
    return epochs


def _compile(recipe, model, total_steps, steps_per_epoch):
    """Compiles ``model`` with the recipe's optimizer (built) and loss; returns both."""
    optimizer = make_optimizer(recipe, total_steps, steps_per_epoch)
    loss = make_loss(recipe)
    # weighted: padded evaluation batches (several devices) weigh their padding 0
    model.compile(optimizer=optimizer, loss=loss, weighted_metrics=[FullWidthAccuracy()])
    optimizer.build(model.trainable_variables)
    return optimizer, loss


def _restore(recipe, name, model, resume):
    """The step restored from the run's checkpoint (0 without ``resume``); an unreadable one is refused."""
    try:
        return checkpoint_lib.restore(model, checkpoint_dir(recipe)) if resume else 0
    except ValueError as error:  # no checkpoint could be restored: files named, none deleted
        raise schema.RecipeError(
            f"recipe {name!r}: {error}\nNothing was deleted. To keep these checkpoints and start over, "
            "pass --restart (keras-mone train / finetune) or resume=False: the run moves to previous/<n>/; "
            "or choose another output_dir."
        ) from error


def _train_data_maker(recipe, stream, train_source, num_classes):
    """``start_step -> training data``: the digits stream, or the video or image pipeline."""
    batch = recipe["batch_size"]
    video = recipe["dataset"] in schema.VIDEO_DATASETS

    def make_train_data(start_step):
        if stream is not None:
            return stream.iterate(start_step)
        if video:
            return video_pipeline.train_dataset(
                train_source, recipe["num_frames"], recipe["image_size"], batch, num_classes,
                frame_stride=recipe["frame_stride"], preprocessing=recipe["preprocessing"],
                scale_jitter=tuple(recipe["scale_jitter"]), flip=recipe["flip"],
                augmentation=recipe["augmentation"], shuffle_buffer=recipe["shuffle_buffer"],
                start_step=start_step, seed=recipe["seed"],
            )
        return pipeline.train_dataset(
            train_source, recipe["image_size"], batch, num_classes,
            preprocessing=recipe["preprocessing"], augmentation=recipe["augmentation"],
            shuffle_buffer=recipe["shuffle_buffer"], start_step=start_step, seed=recipe["seed"],
        )

    return make_train_data


def _eval_data(recipe, eval_source, num_classes, full_batches):
    """The evaluation data: the test split in memory, else the video or image pipeline (``None``: none)."""
    # In memory, always whole batches: one compiled evaluation shape per run (the
    # short last batch compiled a second test function, 1-2 s on 2 CPU cores).
    eval_data = in_memory_eval_data(recipe, num_classes, full_batches=True)
    if eval_data is not None or eval_source is None:
        return eval_data
    eval_batch = recipe["eval_batch_size"] or recipe["batch_size"]
    if recipe["dataset"] in schema.VIDEO_DATASETS:
        return video_pipeline.eval_dataset(
            eval_source, recipe["num_frames"], recipe["image_size"], eval_batch,
            num_classes, frame_stride=recipe["frame_stride"], preprocessing=recipe["preprocessing"],
            full_batches=full_batches,
        )
    return pipeline.eval_dataset(
        eval_source, recipe["image_size"], eval_batch, num_classes,
        preprocessing=recipe["preprocessing"], full_batches=full_batches,
    )


def _teacher(recipe):
    """The model ``teacher_from`` (else ``init_from``) names, or ``None``."""
    path = recipe["teacher_from"] or recipe["init_from"]
    return _saved_model(os.path.expanduser(path)) if path else None
