"""ACM's phase-3 budget loss and gate gradient as the paper writes them (issue 42 items 1, 4, 5).

References are float64 numpy, written from ``acm.txt`` Sec. 3.3:

    L_b = | 1/|B| sum_i  (sum_j sum_l k_ij^l p^l) / (sum_j sum_l N p^l)  - beta_target |

with ``p^l`` "the computational cost of a single learner from layer l",
counted here from the configuration alone (an MLP learner ``D -> M/N -> D``,
a projection learner ``D -> r -> D`` with the official rank rule), not read
from the library.
"""

import keras
import numpy as np
import pytest
from conftest import TINY, gradients, images, randomize_weights, to_numpy

from keras_mone import models
from keras_mone.layers import ACMGate
from keras_mone.methods.acm import method as acm_method
from keras_mone.methods.acm import losses as acm_losses

N = 4


def _paper_costs(config, projections):
    """``p^l`` per module in the record's order: the MLPs, then each block's Q, K, V, O."""
    d, m, depth = config["hidden_dim"], config["mlp_dim"], config["depth"]
    costs = [2 * d * (m // N)] * depth
    if projections:
        rank = max(1, round((d * d + d) / (N * (2 * d + 1))))
        costs += [2 * d * rank] * (4 * depth)
    return costs


def _paper_budget(choices, costs, beta):
    """L_b from one-hot choices over counts ``k = 0..N`` (a projection's start at ``k = 1``)."""
    used, available = 0.0, 0.0
    for one_hot, cost in zip(choices, costs):
        one_hot = np.asarray(one_hot, dtype=np.float64)
        if one_hot.shape[-1] == N:  # counts 1..N
            one_hot = np.concatenate([np.zeros(one_hot.shape[:-1] + (1,)), one_hot], -1)
        k = one_hot @ np.arange(N + 1)
        used = used + cost * k.sum(1)
        available += cost * N * k.shape[1]
    return abs((used / available).mean() - beta)


def _acm_classifier(projections):
    backbone = models.ACMViTBackbone(**TINY, num_learners=N, acm_projections=projections, gate_seed=5)
    model = models.ImageClassifier(backbone, num_classes=10)
    model.build()
    randomize_weights(model, seed=2, scale=0.5)
    return model


@pytest.mark.parametrize("projections", [True, False])
def test_the_trained_budget_term_is_the_papers_with_each_modules_learner_cost(projections):
    # Rules out: p^l = 1 for every module (the loss trained before: 0.1068
    # against the paper's 0.0833 on a tiny model with projections), costs in
    # another order than the record's modules, and a term that differs from
    # the MLP-only loss when every module costs the same.
    model = _acm_classifier(projections)
    costs = _paper_costs(TINY, projections)
    assert model.backbone.acm_learner_costs() == costs
    recipe = dict(beta_target=0.5, acm_loss_weights=[0.1, 0.05, -0.05])
    terms = {t.name: t for t in acm_method.END_TO_END.loss_terms(recipe, model)}
    _, record = model.backbone(images(batch=4), training=True, return_intermediates=True)
    choices = [to_numpy(c) for c in record["acm_choices"]]
    assert len(choices) == len(costs)
    trained = float(to_numpy(terms["acm_budget"].fn(record, None, None)))
    expected = _paper_budget(choices, costs, 0.5)
    assert trained == pytest.approx(expected, rel=1e-5, abs=1e-7)
    unweighted = _paper_budget(choices, [1.0] * len(costs), 0.5)
    if projections:  # the costs differ (4x here), so must the losses
        assert abs(expected - unweighted) > 1e-3
    else:
        assert expected == pytest.approx(unweighted, rel=1e-12)


def test_the_budget_is_the_distance_of_the_mean_share_not_the_mean_distance():
    # Rules out: mean_i |b_i - beta| in place of |mean_i b_i - beta|: images on
    # both sides of the target (shares 0.25 and 0.75 at beta 0.5) give 0, not 0.25.
    tokens = 8
    counts = np.array([[1] * tokens, [3] * tokens])  # b = 1/4 and 3/4 of N = 4 learners
    choices = np.eye(N + 1, dtype="float32")[counts]
    loss = float(to_numpy(acm_losses.budget_loss([choices], 0.5)))
    assert loss == pytest.approx(_paper_budget([choices], [1.0], 0.5), abs=1e-7)
    assert loss == pytest.approx(0.0, abs=1e-7)
    uneven = np.eye(N + 1, dtype="float32")[np.array([[1] * tokens, [4] * tokens])]  # 0.25 and 1.0: mean 0.625
    assert float(to_numpy(acm_losses.budget_loss([uneven], 0.5))) == pytest.approx(0.125, abs=1e-6)


class _Task(keras.layers.Layer):
    """``x -> gate(x)``: the straight-through choice, or (``soft``) the Gumbel-softmax
    sample under the same noise, drawn from a second generator of the gate's seed."""

    def __init__(self, gate, soft=False, **kwargs):
        super().__init__(**kwargs)
        self.gate, self.soft = gate, soft
        self.noise = keras.random.SeedGenerator(gate.seed)

    def call(self, x, training=None):
        if not self.soft:
            return self.gate(x, training=True)[0]
        logits = self.gate.logits(x)
        uniform = keras.random.uniform(keras.ops.shape(logits), seed=self.noise, dtype="float32")
        uniform = keras.ops.clip(uniform, 1e-7, 1.0 - 1e-7)
        gumbel = -keras.ops.log(-keras.ops.log(uniform))
        return keras.ops.softmax((logits + gumbel) / self.gate.temperature, axis=-1)


def test_the_gate_gradient_is_the_soft_samples_in_value_and_sign():
    # Rules out: the straight-through term with its sign flipped
    # (hard + stop_gradient(soft) - soft trains the gates the wrong way and
    # still passes a "gradients are non-zero" check), and a gradient that is
    # not the Gumbel-softmax sample's (Jang et al.'s straight-through estimator).
    z = np.random.default_rng(0).standard_normal((2, 6, 8)).astype("float32")
    weights = np.random.default_rng(1).standard_normal((2, 6, N + 1)).astype("float32")
    loss = lambda out: keras.ops.sum(keras.ops.multiply(out, weights))  # noqa: E731
    grads = {}
    for soft in (False, True):
        gate = ACMGate(N + 1, seed=7)
        gate.build((None, 6, 8))
        randomize_weights(gate, seed=3, scale=0.5)
        task = _Task(gate, soft=soft)
        task(z)
        grads[soft] = gradients(task, loss, z, gate.trainable_variables)
    for straight_through, soft in zip(grads[False], grads[True]):
        assert np.abs(soft).max() > 1e-4
        np.testing.assert_allclose(straight_through, soft, rtol=1e-4, atol=1e-6)
