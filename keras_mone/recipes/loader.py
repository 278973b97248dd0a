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
"""

import dataclasses
import importlib.resources
import json
import os
import tomllib

import keras

from keras_mone.data import pipeline, video_pipeline
from keras_mone.data.cluttered_digits import NUM_CLASSES
from keras_mone.recipes import schema
from keras_mone.recipes.model import build_classifier, init_from_saved_model
from keras_mone.recipes.run_directory import claim, to_toml
from keras_mone.training import checkpoint as checkpoint_lib
from keras_mone.training.adaptive_capacity import AdaptiveCapacity
from keras_mone.training.distribution import distribution_scope, num_replicas
from keras_mone.training.losses import FullWidthAccuracy, SigmoidCrossEntropy, SumOverWidths
from keras_mone.training.modes import ADAPTIVE_MODES, ISOFLOPS_MODES, isoflops_epochs
from keras_mone.training.optimizers import adamw_kernels_only, sgd_kernels_only
from keras_mone.training.router_monitor import RouterMonitor

RECIPE_PACKAGE = "keras_mone.recipe_files"
ROUTER_PROBE_SIZE = 256  # evaluation images on which RouterMonitor measures router entropy


def list_recipes():
    """``{name: description}`` of the bundled recipes (bases excluded), sorted."""
    recipes = {}
    for entry in importlib.resources.files(RECIPE_PACKAGE).iterdir():
        if entry.name.endswith(".toml") and not entry.name.startswith("_"):
            name = entry.name[: -len(".toml")]
            recipes[name] = _read(name)[0].get("description", "")
    return dict(sorted(recipes.items()))


def _read(name_or_path, seen=()):
    """Raw keys of a recipe (bases merged in) and its name."""
    if name_or_path.endswith(".toml") or os.sep in name_or_path:
        if not os.path.exists(name_or_path):
            raise schema.RecipeError(f"Recipe file {name_or_path!r} does not exist.")
        with open(name_or_path, "rb") as f:
            raw = tomllib.load(f)
        name, folder = os.path.basename(name_or_path)[: -len(".toml")], os.path.dirname(name_or_path)
    else:
        entry = importlib.resources.files(RECIPE_PACKAGE).joinpath(f"{name_or_path}.toml")
        if not entry.is_file():
            raise schema.RecipeError(
                f"Unknown recipe {name_or_path!r}. Bundled recipes: {', '.join(list_recipes())}; "
                "or pass the path of a .toml file."
            )
        raw, name, folder = tomllib.loads(entry.read_text()), name_or_path, None
    base = raw.get("base")
    if base:
        if base in seen:
            raise schema.RecipeError(f"Recipe {name!r}: circular `base` chain {seen + (base,)}.")
        local = os.path.join(folder, f"{base}.toml") if folder else None
        parent, _ = _read(local if local and os.path.exists(local) else base, seen + (name,))
        raw = {**parent, **raw, "model_args": {**parent.get("model_args", {}), **raw.get("model_args", {})}}
    return raw, name


def parse_overrides(items):
    """``["epochs=3", "model_args.depth=2", "dataset=image_folder"]`` -> dict.

    Values are read as TOML (numbers, booleans, lists, quoted strings); anything
    else is a string.
    """
    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise schema.RecipeError(f"Override {item!r} must look like key=value.")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        table, dot, sub = key.partition(".")
        if dot:
            overrides.setdefault(table, {})[sub] = value
        else:
            overrides[key] = value
    return overrides


def resolve(name_or_path, **overrides):
    """The validated recipe (all keys) and its name; raises ``RecipeError``."""
    raw, name = _read(name_or_path)
    for source in (raw, overrides):
        if not isinstance(source.get("model_args", {}), dict):
            raise schema.RecipeError(
                f"recipe {name!r}: key 'model_args' must be a table of backbone / classifier arguments "
                f"(e.g. {{ depth = 4 }}), got {source['model_args']!r}."
            )
    model_args = {**raw.get("model_args", {}), **overrides.pop("model_args", {})}
    raw = {**raw, **overrides, "model_args": model_args}
    raw.pop("base", None)
    recipe = schema.validate(raw, recipe_name=f"recipe {name!r}")
    if not recipe["output_dir"]:
        recipe["output_dir"] = os.path.join("runs", name)
    return recipe, name


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
        A ``TrainingSetup``.
    """
    recipe, name = resolve(name_or_path, **overrides)
    claim(recipe, name, resume)  # refuses another recipe's checkpoints before anything is built
    keras.utils.set_random_seed(recipe["seed"])
    train_source, eval_source = _sources(recipe)
    stream = digits_stream(recipe) if train_source is None else None
    num_classes = recipe["num_classes"] or (stream or train_source).num_classes
    batch = recipe["batch_size"]
    steps_per_epoch = recipe["steps_per_epoch"] or (
        stream.steps_per_epoch if stream else max(1, train_source.num_examples // batch)
    )
    directory = recipe["output_dir"]

    with distribution_scope(recipe["distribution"], recipe["model_parallel_size"]):
        replicas = num_replicas(recipe["distribution"])
        if batch % replicas:
            raise schema.RecipeError(
                f"recipe {name!r}: key 'batch_size' ({batch}) must be divisible by the {replicas} devices."
            )
        model = build_classifier(recipe, num_classes)
        if recipe["init_from"]:
            try:
                init_from_saved_model(model, os.path.expanduser(recipe["init_from"]))
            except ValueError as error:
                raise schema.RecipeError(f"recipe {name!r}: key 'init_from': {error}") from error
        epochs = recipe["epochs"]
        if recipe["mode"] in ISOFLOPS_MODES:
            adaptive = recipe["adaptive_capacities"] if recipe["mode"] in ADAPTIVE_MODES else None
            epochs = isoflops_epochs(epochs, model.backbone, adaptive)
        optimizer = make_optimizer(recipe, epochs * steps_per_epoch, steps_per_epoch)
        loss = make_loss(recipe)
        model.compile(optimizer=optimizer, loss=loss, metrics=[FullWidthAccuracy()])
        optimizer.build(model.trainable_variables)
        try:
            initial_step = checkpoint_lib.restore(model, _checkpoint_dir(recipe)) if resume else 0
        except ValueError as error:  # no checkpoint could be restored: files named, none deleted
            raise schema.RecipeError(f"recipe {name!r}: {error}") from error

    with open(os.path.join(directory, "recipe.toml"), "w") as f:
        f.write(to_toml(recipe, name))

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

    eval_data = None
    if eval_source is not None and video:
        eval_data = video_pipeline.eval_dataset(
            eval_source, recipe["num_frames"], recipe["image_size"], recipe["eval_batch_size"] or batch,
            num_classes, frame_stride=recipe["frame_stride"], preprocessing=recipe["preprocessing"],
            drop_remainder=recipe["distribution"] != "none",
        )
    elif eval_source is not None:
        eval_data = pipeline.eval_dataset(
            eval_source, recipe["image_size"], recipe["eval_batch_size"] or batch, num_classes,
            preprocessing=recipe["preprocessing"], drop_remainder=recipe["distribution"] != "none",
        )
    return TrainingSetup(
        name=name, recipe=recipe, model=model, optimizer=optimizer, loss=loss,
        train_data=make_train_data(initial_step), eval_data=eval_data,
        callbacks=_callbacks(recipe, model, eval_data), epochs=epochs, steps_per_epoch=steps_per_epoch,
        initial_step=initial_step, make_train_data=make_train_data,
    )


def make_optimizer(recipe, total_steps, steps_per_epoch):
    """The recipe's optimizer (AdamW or SGD, kernels-only decay, warm-up + cosine
    over ``total_steps``, global norm clip); the warm-up comes from
    ``warmup_steps``, else ``warmup_epochs``, else ``warmup_fraction``."""
    warmup = (
        recipe["warmup_steps"] or round(recipe["warmup_epochs"] * steps_per_epoch)
        or int(recipe["warmup_fraction"] * total_steps)
    )
    warmup = min(warmup, total_steps)
    common = dict(
        weight_decay=recipe["weight_decay"], clipnorm=recipe["grad_clip"] or None,
        end_learning_rate=recipe["end_learning_rate"],
    )
    if recipe["optimizer"] == "sgd":
        return sgd_kernels_only(recipe["learning_rate"], total_steps, warmup, momentum=recipe["momentum"], **common)
    return adamw_kernels_only(recipe["learning_rate"], total_steps, warmup, beta_2=recipe["beta_2"], **common)


def make_loss(recipe):
    """The recipe's loss on one-hot labels: sigmoid or softmax cross-entropy
    (with ``label_smoothing``), summed over the widths in MatViT joint training."""
    if recipe["loss"] == "sigmoid":
        loss = SigmoidCrossEntropy()
    else:
        loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=recipe["label_smoothing"])
    return SumOverWidths(loss) if recipe["mode"] == "joint" else loss


def _checkpoint_dir(recipe):
    return os.path.join(recipe["output_dir"], "checkpoint")


def _callbacks(recipe, model, eval_data):
    callbacks = []
    if getattr(model.backbone, "router_type", None) == "learned" and eval_data is not None:
        # alpha and router entropy per epoch, into history.csv (CSVLogger comes after it)
        probe = keras.ops.convert_to_numpy(next(iter(eval_data))[0])[:ROUTER_PROBE_SIZE]
        callbacks.append(RouterMonitor(probe))
    callbacks += [
        checkpoint_lib.StepCheckpoint(_checkpoint_dir(recipe), recipe["checkpoint_steps"]),
        keras.callbacks.CSVLogger(os.path.join(recipe["output_dir"], "history.csv"), append=True),
    ]
    if recipe["mode"] in ADAPTIVE_MODES:
        callbacks.append(
            AdaptiveCapacity(recipe["adaptive_capacities"], eval_capacity=recipe["capacity"], seed=recipe["seed"])
        )
    return callbacks


def _video_sources(recipe):
    splits = [recipe["train_split"]] + ([recipe["eval_split"]] if recipe["eval_split"] else [])
    if recipe["dataset"] == "video_folder":
        root = recipe["data_dir"]
        train = video_pipeline.video_folder_source(root, splits[0])
        classes = sorted(d for d in os.listdir(os.path.join(root, splits[0])) if os.path.isdir(os.path.join(root, splits[0], d)))
        test = video_pipeline.video_folder_source(root, splits[1], classes) if len(splits) > 1 else None
        return train, test
    train = None  # fresh renderings: the stream of ``digits_stream`` trains
    if not recipe["fresh_renderings"]:
        train = video_pipeline.moving_digits_source(**moving_digits_arguments(recipe, "train"))
    test = None
    if recipe["eval_split"]:
        test = video_pipeline.moving_digits_source(**moving_digits_arguments(recipe, "test"))
    return train, test


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


def digits_stream(recipe):
    """The recipe's stream of fresh training renderings (``fresh_renderings = true``)
    of cluttered digits or moving digits; one-hot labels ``num_classes`` wide
    (0 = the task's classes)."""
    from keras_mone.data.digit_stream import ClutteredDigitsStream, MovingDigitsStream

    arguments = cluttered_digits_arguments(recipe, "train")
    del arguments["split"]
    batch, num_classes = recipe["batch_size"], recipe["num_classes"] or None
    try:
        if recipe["dataset"] == "moving_digits":
            return MovingDigitsStream(
                batch, num_classes=num_classes, num_frames=recipe["num_frames"],
                frame_stride=recipe["frame_stride"], target=recipe["digits_target"],
                speed_step=recipe["speed_step"], **arguments,
            )
        return ClutteredDigitsStream(batch, num_classes=num_classes or NUM_CLASSES, **arguments)
    except ValueError as error:  # e.g. num_classes below the task's classes
        raise schema.RecipeError(f"{recipe['dataset']} recipe: {error}") from error


def _sources(recipe):
    dataset = recipe["dataset"]
    if dataset in schema.VIDEO_DATASETS:
        return _video_sources(recipe)
    if dataset == "cluttered_digits":
        train = None  # fresh renderings: the stream of ``digits_stream`` trains
        if not recipe["fresh_renderings"]:
            train = pipeline.cluttered_digits_source(**cluttered_digits_arguments(recipe, "train"))
        test = None
        if recipe["eval_split"]:
            test = pipeline.cluttered_digits_source(**cluttered_digits_arguments(recipe, "test"))
        return train, test
    if dataset == "image_folder":
        train = pipeline.image_folder_source(recipe["data_dir"], recipe["train_split"])
        classes = sorted(os.listdir(os.path.join(recipe["data_dir"], recipe["train_split"])))
        test = None
        if recipe["eval_split"]:
            test = pipeline.image_folder_source(recipe["data_dir"], recipe["eval_split"], classes)
        return train, test
    train = pipeline.tfds_source(recipe["tfds_name"], recipe["train_split"], recipe["data_dir"], recipe["seed"])
    test = None
    if recipe["eval_split"]:
        test = pipeline.tfds_source(recipe["tfds_name"], recipe["eval_split"], recipe["data_dir"], recipe["seed"])
    return train, test
