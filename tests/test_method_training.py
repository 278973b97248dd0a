"""The method-owned training hook: loss terms on the forward pass's record, modes owned by methods."""

import csv

import keras
import numpy as np
import pytest
from conftest import BATCH, TINY, images, randomize_weights, to_numpy

from keras_mone import models
from keras_mone.methods import registry as methods
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.loss_terms import LossTerm
from keras_mone.training.modes import TrainingMode

NUM_CLASSES = 3


def _full_expert_share(record, y_true, logits):
    """Share of router probability on the full expert, first router (a term that reads the record)."""
    return keras.ops.mean(record["router_probs"][0][..., -1])


def _tiny_mone():
    backbone = models.MoNEViTBackbone(**TINY, capacity=0.5)
    model = ImageClassifier(backbone, num_classes=NUM_CLASSES)
    model.build()
    randomize_weights(model, seed=3)
    return model


def test_loss_term_is_added_to_the_loss_and_logged_by_name():
    # Rules out: the term dropped from the loss, its weight ignored, its value
    # logged weighted, or the record taken from a forward pass other than fit's.
    model = _tiny_mone()
    model.set_loss_terms([LossTerm("full_share", _full_expert_share, weight=0.5)])
    x = images()
    y = keras.ops.one_hot(np.arange(BATCH) % NUM_CLASSES, NUM_CLASSES)
    loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0).history
    _, record = model.backbone(x, return_intermediates=True)
    term = float(np.mean(to_numpy(record["router_probs"][0])[..., -1]))
    task = float(to_numpy(loss(y, model(x))))
    assert history["full_share"][0] == pytest.approx(term, rel=1e-5)
    assert history["loss"][0] == pytest.approx(task + 0.5 * term, rel=1e-5)
    # Evaluation and inference are unchanged: logits, the task loss alone.
    assert model.predict(x, verbose=0).shape == (BATCH, NUM_CLASSES)
    evaluated = model.evaluate(x, y, verbose=0, return_dict=True)
    assert evaluated["loss"] == pytest.approx(task, rel=1e-5)
    assert "full_share" not in evaluated  # not computed in evaluation, so not reported as 0
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, validation_data=(x, y)).history
    assert "val_full_share" not in history and "full_share" in history


def test_no_terms_means_plain_logits_in_training():
    # Rules out: the hook changing what methods without terms return (MoNE, MatViT histories).
    model = _tiny_mone()
    out = model(images(), training=True)
    assert not isinstance(out, dict) and tuple(out.shape) == (BATCH, NUM_CLASSES)


def test_loss_terms_must_be_named_and_distinct():
    model = _tiny_mone()
    with pytest.raises(ValueError, match="distinct names"):
        model.set_loss_terms([LossTerm("a", _full_expert_share), LossTerm("a", _full_expert_share)])


def test_a_method_owns_its_modes_and_their_terms_reach_history_csv(monkeypatch, tmp_path):
    # A method registered at run time with a mode of its own: the recipe accepts
    # the mode for that architecture only, trains with the mode's term and
    # history.csv has a column of its name. Rules out a global mode table.
    from keras_mone import recipes
    from keras_mone.recipes.schema import RecipeError
    from recipe_helpers import tiny_overrides

    monkeypatch.setattr(methods, "METHODS", dict(methods.METHODS))
    regularised = TrainingMode(
        "share_regularised", "MoNE with a penalty on the full expert's share",
        loss_terms=lambda recipe, model: (LossTerm("full_share", _full_expert_share, weight=0.1),),
    )
    methods.register_method(methods.Method(
        "share_mone",
        image=methods.Architecture("share_mone_vit", models.MoNEViTBackbone, ImageClassifier, video=False),
        modes=("fixed", regularised),
        recipe_arguments=lambda recipe: dict(capacity=recipe["capacity"], router_seed=recipe["seed"]),
    ))
    assert methods.ARCHITECTURE_MODES["share_mone_vit"] == ("fixed", "share_regularised")
    with pytest.raises(RecipeError, match="mode"):
        recipes.load("cluttered_digits_mone", **tiny_overrides(tmp_path / "a", mode="share_regularised"))
    setup = recipes.load(
        "cluttered_digits_mone",
        **tiny_overrides(tmp_path / "b", architecture="share_mone_vit", mode="share_regularised"),
    )
    setup.fit(verbose=0)
    with open(tmp_path / "b" / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and "full_share" in rows[0] and 0.0 < float(rows[-1]["full_share"]) < 1.0


def test_matvit_modes_set_joint_training_from_the_mode():
    # Rules out: MatViT's fixed mode training every width (joint_training left at its default True).
    matvit = methods.method_of("matvit")
    assert matvit.mode("fixed").model_arguments({}) == {"joint_training": False}
    assert matvit.mode("joint").model_arguments({}) == {"joint_training": True}
    with pytest.raises(ValueError, match="no training mode 'adaptive'"):
        matvit.mode("adaptive")
