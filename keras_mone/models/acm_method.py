"""ACM's registry entry and training modes (Wojcik et al., ``acm.txt``, Sec. 3.3 phase 3).

``end_to_end`` trains the converted model with
``CE + 0.1 L_budget + 0.05 L_entropy - 0.05 L_diversity`` (the paper's
weights), each term read from the forward record's gate choices and logged
by name (``acm_budget``, ``acm_entropy``, ``acm_diversity``); ``fixed`` trains
with the task loss alone. Phases 1 (learner distillation) and 2 (gate
training on tau labels) are not recipe modes yet: learners start as slices of
the dense MLP (exact at k = N), and the losses of phases 1 and 2 are in
``keras_mone.training.acm_losses``.
"""

from keras_mone.models.acm_vit_backbone import ACMViTBackbone
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.loss_terms import LossTerm
from keras_mone.training import acm_losses
from keras_mone.training.modes import FIXED, TrainingMode

BUDGET_WEIGHT, ENTROPY_WEIGHT, DIVERSITY_WEIGHT = 0.1, 0.05, -0.05


def end_to_end_terms(beta_target):
    """Phase 3's loss terms at ``beta_target`` (the diversity term enters with a negative weight)."""
    return (
        LossTerm("acm_budget", lambda record, y, logits: acm_losses.budget_loss(record["acm_choices"], beta_target),
                 BUDGET_WEIGHT),
        LossTerm("acm_entropy", lambda record, y, logits: acm_losses.entropy_loss(record["acm_choices"]),
                 ENTROPY_WEIGHT),
        LossTerm("acm_diversity", lambda record, y, logits: acm_losses.diversity_loss(record["acm_choices"]),
                 DIVERSITY_WEIGHT),
    )


END_TO_END = TrainingMode(
    "end_to_end", "ACM phase 3: CE + 0.1 budget + 0.05 entropy - 0.05 diversity at beta_target",
    loss_terms=lambda recipe: end_to_end_terms(recipe["beta_target"]),
)


def register(register_method, Method, Architecture):
    register_method(Method(
        "acm",
        image=Architecture("acm_vit", ACMViTBackbone, ImageClassifier, video=False),
        modes=(FIXED, END_TO_END),
        recipe_arguments=lambda recipe: dict(beta=recipe["beta_target"], gate_seed=recipe["seed"]),
    ))
