"""ACM's registry entry and training modes (Wojcik et al., ``acm.txt``, Sec. 3.2-3.3).

The conversion of a dense model, one mode per phase (a recipe's ``phases``
runs them in order in one run directory, ``keras_mone.recipes.phases``):

* ``distill`` (phase 1): only the learners train, on ``acm_distill`` =
  ``acm_losses.distillation_loss``: mean over tokens, modules and ``n = 1..N``
  of ``||h(z, n) - o||^2``, ``z`` and ``o`` each module's input and output in
  the frozen dense teacher (recipe key ``teacher_from``, else ``init_from``;
  the stream is the teacher's, ``acm.teacher``); gates unused. Learners
  start as slices of the dense MLP (``acm_init = "slices"``: exact at
  ``k = N`` from the first step) or random (``"random"``: the paper's).
* ``gates`` (phase 2): learners, attention and head frozen, the stream is the
  dense teacher (else ``h(z, N)``), the gates learn the tau labels
  (``acm_losses.gate_labels``, targets ``o``), logged as ``acm_gate_ce``.
* ``end_to_end`` (phase 3): ``CE + 0.1 L_budget + 0.05 L_entropy - 0.05
  L_diversity`` (alpha_b, alpha_e as the paper's text; the diversity sign as
  its intent and the official code, ``end_to_end_terms``), L_budget weighted by
  each module's learner cost ``p^l``, each term read from the forward
  record's gate choices and logged by name (``acm_budget``, ``acm_entropy``,
  ``acm_diversity``).

``fixed`` trains with the task loss alone. Every loss term reads the record's
per-module lists (``acm_outputs``, ``acm_targets``, ``acm_choices``,
``acm_probs``), so every ACM module there (MLPs and, with
``acm_projections``, the Q/K/V/O projections) is distilled and gated alike.
The modes' ``prepare`` gets the teacher from ``recipe["load_teacher"]()``
(set by ``keras_mone.recipes.loader``).

ACM's recipe keys (``beta_target``, ``gate_tau``, ``acm_loss_weights``,
``acm_init``, ``teacher_from``) and their checks are declared here; an ACM
model is scored in both executions (``set_execution``: ``exact``, each
token its gate's learner count; ``grouped``, the quotas at ``beta``).
"""

import math

from keras_mone.methods.registry import Architecture, Method, RecipeKey, Scoring, register_method
from keras_mone.methods.acm.backbone import ACMViTBackbone
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.loss_terms import LossTerm
from keras_mone.methods.acm import losses as acm_losses, phases as acm_phases
from keras_mone.training.modes import FIXED, TrainingMode

BUDGET_WEIGHT, ENTROPY_WEIGHT, DIVERSITY_WEIGHT = 0.1, 0.05, -0.05


def end_to_end_terms(beta_target, weights=(BUDGET_WEIGHT, ENTROPY_WEIGHT, DIVERSITY_WEIGHT), learner_costs=None):
    """Phase 3's loss terms at ``beta_target``.

    ``weights``: of budget, entropy and diversity; the default (0.1, 0.05, -0.05)
    is the paper's alpha_b, alpha_e and its stated intent for alpha_d (its text
    writes ``+ 0.05 L_d``, which would penalise diversity; the official code
    subtracts it, see docs/methods.md). ``learner_costs``: L_budget's ``p^l``
    per module in the record's order (``ACMViTBackbone.acm_learner_costs()``,
    what the phase-3 mode passes); ``None`` weighs every module alike, which
    equals the paper's loss only when every module's learner costs the same
    (ACM on the MLPs alone)."""
    budget, entropy, diversity = (float(w) for w in weights)
    costs = None if learner_costs is None else tuple(learner_costs)
    return (
        LossTerm("acm_budget",
                 lambda record, y, logits: acm_losses.budget_loss(record["acm_choices"], beta_target, costs),
                 budget),
        LossTerm("acm_entropy", lambda record, y, logits: acm_losses.entropy_loss(record["acm_choices"]),
                 entropy),
        LossTerm("acm_diversity", lambda record, y, logits: acm_losses.diversity_loss(record["acm_choices"]),
                 diversity),
    )


def gate_terms(tau):
    """Phase 2's loss term: the gates' cross-entropy on the tau labels of every ACM module
    (``acm_losses.gate_labels``, targets ``o``: the dense module's output)."""

    def gate_cross_entropy(record, y, logits):
        labels = [
            acm_losses.gate_labels(outputs, target, tau)
            for outputs, target in zip(record["acm_outputs"], record["acm_targets"], strict=True)
        ]
        return acm_losses.gate_cross_entropy(record["acm_probs"], labels)

    return (LossTerm("acm_gate_ce", gate_cross_entropy, 1.0),)


def distill_terms():
    """Phase 1's loss term: ``acm_losses.distillation_loss`` over every ACM module of the record."""
    return (LossTerm(
        "acm_distill",
        lambda record, y, logits: acm_losses.distillation_loss(record["acm_outputs"], record["acm_targets"]),
        1.0,
    ),)


def _teacher(recipe):
    load = recipe.get("load_teacher")
    return load() if load is not None else None


def train_learners_only(recipe, model):
    """Phase 1: the stream is the frozen dense teacher, only the learners train (from
    slices of the dense model, or redrawn at random with ``acm_init = "random"``)."""
    backbone = model.backbone
    try:
        acm_phases.attach_teachers(backbone, _teacher(recipe), required=True)
    except ValueError as error:
        raise ValueError(f"mode 'distill': {error}") from error
    if recipe["acm_init"] == "random":
        acm_phases.reinitialise_learners(backbone, seed=recipe["seed"])
    backbone.teacher_stream = True
    acm_phases.train_learners_only(model)


def train_gates_only(recipe, model):
    """Phase 2: the stream is the dense teacher (else every learner), only the gates train."""
    backbone = model.backbone
    acm_phases.attach_teachers(backbone, _teacher(recipe))
    backbone.teacher_stream = True
    frozen = [*backbone.blocks, backbone.patch_embedding, backbone.norm]
    frozen += [layer for layer in model.layers if layer is not backbone]  # head, pre-logits
    for layer in frozen:
        layer.trainable = False


DISTILL = TrainingMode(
    "distill", "ACM phase 1: learners distilled from the frozen dense teacher's modules (gates unused)",
    loss_terms=lambda recipe, model: distill_terms(),
    prepare=train_learners_only,
)

GATES = TrainingMode(
    "gates", "ACM phase 2: learners frozen (the stream runs them all), gates trained on the tau labels",
    loss_terms=lambda recipe, model: gate_terms(recipe["gate_tau"]),
    prepare=train_gates_only,
)

END_TO_END = TrainingMode(
    "end_to_end", "ACM phase 3: CE + 0.1 budget + 0.05 entropy - 0.05 diversity at beta_target (acm_loss_weights)",
    loss_terms=lambda recipe, model: end_to_end_terms(
        recipe["beta_target"], recipe["acm_loss_weights"], model.backbone.acm_learner_costs()
    ),
)


#: The executions an ACM model's accuracy is recorded at (publish, model cards).
SCORED_EXECUTIONS = ("exact", "grouped")

RECIPE_KEYS = {
    "beta_target": RecipeKey(
        0.5, (int, float),
        "ACM: the share of learner compute the budget loss aims at, and the budget of grouped inference",
        above=0.0, high=1.0,
    ),
    "gate_tau": RecipeKey(
        0.833, (int, float),
        "ACM phase 2 (mode 'gates'): label = smallest n >= 2 with d(n) >= tau d(n-1) "
        "(the official code's factor 1.2 is tau 1/1.2)",
        above=0.0,
    ),
    "acm_loss_weights": RecipeKey(
        [0.1, 0.05, -0.05], list,
        "ACM phase 3 (mode 'end_to_end'): weights of L_budget, L_entropy and L_diversity (0.1, 0.05: the "
        "paper's; -0.05: its text writes +0.05, its intent and the official code subtract L_diversity, "
        "docs/methods.md; [0.1, 0, 0] is Fig. 8's budget loss alone)",
    ),
    "acm_init": RecipeKey(
        "slices", str,
        "ACM mode 'distill': learners start as slices of the dense MLP (exact at k = N) or 'random' "
        "(the paper's: drawn afresh, then distilled)",
        ("slices", "random"),
    ),
    "teacher_from": RecipeKey(
        "", str,
        "ACM modes 'distill' / 'gates': the dense model (.keras file or 'preset:<name>') whose modules' "
        "outputs are the targets; '' = init_from",
        model_source=True,
    ),
}


def check_recipe(recipe, fail):
    """The loss weights are three numbers; random learners are distilled first; distillation has a teacher."""
    weights = recipe["acm_loss_weights"]
    numbers = all(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) for v in weights)
    if len(weights) != 3 or not numbers:
        fail(
            "key 'acm_loss_weights' must hold 3 finite numbers (weights of L_budget, L_entropy, L_diversity), "
            f"got {weights!r}."
        )
    modes = recipe["phases"] or [recipe["mode"]]
    if recipe["acm_init"] == "random" and modes[0] != "distill":
        fail(
            "key 'acm_init' = 'random' needs learner distillation first (mode 'distill', or 'distill' as the "
            f"first of 'phases'), got {modes!r}."
        )
    if "distill" in modes and not (recipe["teacher_from"] or recipe["init_from"]):
        fail("mode 'distill' needs the dense teacher: set key 'teacher_from' or 'init_from' (a dense ViT).")


def later_phase(recipe):
    """A phase after the first starts from the one before (not from slices); its teacher stays the dense model."""
    return {"teacher_from": recipe["teacher_from"] or recipe["init_from"],
            "acm_init": RECIPE_KEYS["acm_init"].default}


def untrained_gates(backbone):
    return ["the ACM gates (each token's learner count) and the learners' partial sums"]


def untrained_advice(backbone, parts, command):
    return (
        "With every gate choosing all learners it equals the dense checkpoint; its gates choose at random "
        "until trained. Train them with the ACM recipe's end_to_end mode (keras-mone train "
        "cluttered_digits_acm_from_dense shows the keys: architecture=acm_vit mode=end_to_end beta_target=... "
        "init_from=...)."
    )


ACM = register_method(Method(
    "acm",
    image=Architecture("acm_vit", ACMViTBackbone, ImageClassifier, video=False),
    modes=(FIXED, DISTILL, GATES, END_TO_END),
    recipe_arguments=lambda recipe: dict(beta=recipe["beta_target"], gate_seed=recipe["seed"]),
    recipe_keys=RECIPE_KEYS,
    check_recipe=check_recipe,
    later_phase=later_phase,
    scored_at=lambda backbone: Scoring("execution", SCORED_EXECUTIONS, backbone.execution),
    untrained=untrained_gates,
    untrained_advice=untrained_advice,
))
