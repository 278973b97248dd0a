"""ACM's registry entry and training modes (Wojcik et al., ``acm.txt``, Sec. 3.3 phase 3).

``gates`` (phase 2) trains only the gates, with a cross-entropy on the tau
labels (``acm_losses.gate_labels``; targets: the converted dense MLP's output,
``h(z, N)`` of slice-initialised learners), while the residual stream runs
every learner; ``end_to_end`` (phase 3) trains the converted model with
``CE + 0.1 L_budget + 0.05 L_entropy - 0.05 L_diversity`` (the paper's
weights), each term read from the forward record's gate choices and logged
by name (``acm_budget``, ``acm_entropy``, ``acm_diversity``); ``fixed`` trains
with the task loss alone. Phase 1 (learner distillation) is not a recipe mode:
learners start as slices of the dense MLP (exact at k = N); its loss is
``acm_losses.distillation_loss``. Phases run as separate commands, each
starting from the previous run's ``model.keras`` (``init_from``).
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


def gate_terms(tau):
    """Phase 2's loss term: the gates' cross-entropy on the tau labels of every block
    (``acm_losses.gate_labels``, targets ``o = h(z, N)``: the converted dense MLP)."""

    def gate_cross_entropy(record, y, logits):
        labels = [
            acm_losses.gate_labels(outputs, outputs[..., -1, :], tau) for outputs in record["acm_outputs"]
        ]
        return acm_losses.gate_cross_entropy(record["acm_probs"], labels)

    return (LossTerm("acm_gate_ce", gate_cross_entropy, 1.0),)


def train_gates_only(recipe, model):
    """Phase 2: the stream is the converted dense model (every learner), only the gates train."""
    backbone = model.backbone
    backbone.teacher_stream = True
    frozen = [*backbone.blocks, backbone.patch_embedding, backbone.norm]
    frozen += [layer for layer in model.layers if layer is not backbone]  # head, pre-logits
    for layer in frozen:
        layer.trainable = False


GATES = TrainingMode(
    "gates", "ACM phase 2: learners frozen (the stream runs them all), gates trained on the tau labels",
    loss_terms=lambda recipe: gate_terms(recipe["gate_tau"]),
    prepare=train_gates_only,
)

END_TO_END = TrainingMode(
    "end_to_end", "ACM phase 3: CE + 0.1 budget + 0.05 entropy - 0.05 diversity at beta_target",
    loss_terms=lambda recipe: end_to_end_terms(recipe["beta_target"]),
)


def register(register_method, Method, Architecture):
    register_method(Method(
        "acm",
        image=Architecture("acm_vit", ACMViTBackbone, ImageClassifier, video=False),
        modes=(FIXED, GATES, END_TO_END),
        recipe_arguments=lambda recipe: dict(beta=recipe["beta_target"], gate_seed=recipe["seed"]),
    ))
