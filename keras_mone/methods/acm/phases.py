"""What ACM's conversion phases do to a model before training (Wojcik et al., ``acm.txt`` Sec. 3.2).

Phase 1 (``distill``): learners start as slices of the dense modules (exact at
``k = N``) or, as in the paper, from a random initialisation
(``reinitialise_learners``); the dense model is the frozen teacher
(``attach_teachers``); only the learners train (``train_learners_only``).
Phase 2 (``gates``) keeps the teacher as the target of the tau labels.
The functions take the built model; the training modes that call them live in
``keras_mone.methods.acm``.
"""

import keras
from keras import ops

from keras_mone.methods.acm import teacher as acm_teacher
from keras_mone.methods.acm.mlp import LearnerStack

PROJECTIONS = ("query", "key", "value", "out")


class KernelSlice:
    """``z -> z W[:, lo:hi] + b[lo:hi]``: one projection of a dense (fused QKV) layer, as a teacher."""

    def __init__(self, dense, lo, hi):
        self.dense, self.lo, self.hi = dense, lo, hi

    def __call__(self, inputs, training=None):
        kernel = ops.cast(self.dense.kernel, inputs.dtype)[:, self.lo:self.hi]
        outputs = ops.matmul(inputs, kernel)
        if getattr(self.dense, "bias", None) is not None:
            outputs = outputs + ops.cast(self.dense.bias, inputs.dtype)[self.lo:self.hi]
        return outputs


def acm_modules(backbone):
    """The ACM modules of ``backbone`` in the forward record's order: every
    block's MLP, then each block's query, key, value and out projections
    (``ACMViTBackbone.acm_module_names``)."""
    mlps = [block.mlp for block in backbone.blocks if isinstance(block.mlp, LearnerStack)]
    projections = []
    for block in backbone.blocks:
        parts = getattr(block.attention, "projections", None)
        if parts:
            projections += [parts[name] for name in PROJECTIONS]
    return mlps + projections


def _dense_mlp(dense_block, module):
    mlp = dense_block.mlp
    fc1 = getattr(mlp, "fc1", None)
    if isinstance(mlp, LearnerStack) or fc1 is None:
        return None
    if tuple(fc1.kernel.shape) != tuple(module.fc1.kernel.shape):
        raise ValueError(
            f"the teacher's MLP kernel {tuple(fc1.kernel.shape)} differs from the ACM's "
            f"{tuple(module.fc1.kernel.shape)}: the teacher must be the dense model of the same size."
        )
    return mlp


def teachers(backbone, dense):
    """``[(ACM module, dense teacher)]`` in record order, or ``None`` if ``dense`` is no dense ViT
    (e.g. an ACM model: its MLPs are learners too).

    An MLP's teacher is the dense block's MLP; a projection's is the slice of
    the dense attention's fused ``qkv`` kernel (or its ``out`` kernel)."""
    dense = getattr(dense, "backbone", dense)
    blocks = getattr(dense, "blocks", None)
    if blocks is None or len(blocks) != len(backbone.blocks):
        raise ValueError(
            f"the teacher ({type(dense).__name__}) must be a ViT with the ACM model's "
            f"{len(backbone.blocks)} blocks."
        )
    mlps, projections = [], []
    for block, dense_block in zip(backbone.blocks, blocks):
        if isinstance(block.mlp, LearnerStack):
            mlp = _dense_mlp(dense_block, block.mlp)
            if mlp is None:
                return None
            mlps.append((block.mlp, mlp))
        parts = getattr(block.attention, "projections", None)
        if parts:
            qkv, out = getattr(dense_block.attention, "qkv", None), getattr(dense_block.attention, "out", None)
            if qkv is None or out is None:
                return None
            d = backbone.hidden_dim
            projections += [(parts[name], KernelSlice(qkv, i * d, (i + 1) * d)) for i, name in enumerate(PROJECTIONS[:3])]
            projections.append((parts["out"], KernelSlice(out, 0, d)))
    return mlps + projections


def attach_teachers(backbone, dense, required=False):
    """Gives every ACM module of ``backbone`` its dense counterpart in ``dense`` as teacher
    (``acm.teacher``); returns whether it did.

    ``dense=None`` or a model that is no dense ViT attaches nothing (the
    modules' ``h(z, N)`` stands in for the dense output); with ``required``
    that is an error (phase 1 needs the dense outputs)."""
    pairs = None if dense is None else teachers(backbone, dense)
    if pairs is None:
        if required:
            what = "none was given" if dense is None else f"got a {type(getattr(dense, 'backbone', dense)).__name__} with ACM modules"
            raise ValueError(
                "learner distillation needs the dense model as teacher (recipe key 'teacher_from', "
                f"else 'init_from', naming a dense ViT of the same size); {what}."
            )
        return False
    for module, teacher in pairs:
        acm_teacher.attach(module, teacher)
    return True


def reinitialise_learners(backbone, seed=0):
    """The paper's initialisation: every learner drawn afresh (Glorot-uniform kernels,
    zero biases, seeded), whatever the model was loaded with."""
    for index, module in enumerate(acm_modules(backbone)):
        for part, dense in enumerate((module.fc1, module.fc2)):
            init = keras.initializers.GlorotUniform(seed=seed * 1000 + 2 * index + part)
            dense.kernel.assign(init(tuple(dense.kernel.shape), dtype=dense.kernel.dtype))
            if getattr(dense, "bias", None) is not None:
                dense.bias.assign(ops.zeros(tuple(dense.bias.shape), dense.bias.dtype))


def train_learners_only(model):
    """Freezes every trainable variable of ``model`` but the ACM learners' (phase 1)."""
    learners = {id(v) for module in acm_modules(model.backbone) for v in module.trainable_variables}
    for variable in model.trainable_variables:
        if id(variable) not in learners:
            variable.trainable = False
