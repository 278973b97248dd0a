"""The dense module an ACM replaces, as the target of conversion phases 1 and 2 (``acm.txt`` Sec. 3.2).

Phases 1 (learner distillation) and 2 (gate training) forward the *original*
model: every replaced module's input ``z`` and output ``o`` come from the
dense network, and each ACM learns from ``(z, o)``. ``attach`` gives an ACM
module (any ``acm.mlp.LearnerStack``: ``ACMMLP``, ``ACMLinear``) the dense
layer it replaces, frozen and untracked (not saved, not in the checkpoints,
not trained: Keras' saving walks every attribute that is a layer, so the
teacher sits inside a plain ``_Attached`` holder that saving skips). A backbone running its *teacher stream* calls ``stream`` for
each module: the residual stream takes ``o`` (so the next module sees the
dense model's input), and the forward record keeps the module's stack of
``h(z, 0..N)`` (``record["acm_outputs"]``) beside ``o``
(``record["acm_targets"]``), one entry per module, for the losses in
``keras_mone.methods.acm.losses``. A module with no teacher attached uses
``h(z, N)`` as ``o`` (exact for slice-initialised learners before any
training).
"""

from keras import ops

_TEACHER = "_acm_teacher"


class _Attached:
    """Holds a teacher where neither Keras' saving (which walks every attribute
    that is a layer or a variable) nor torch's module registry can see it."""

    __slots__ = ("teacher",)

    def __init__(self, teacher):
        self.teacher = teacher


def attach(module, teacher):
    """Makes ``teacher`` (a callable ``z -> o``, e.g. the dense ViT's MLP) the target of ``module``.

    The teacher is frozen (``trainable = False``) and kept outside Keras'
    tracking, so the ACM model's weights, checkpoints and ``.keras`` file are
    unchanged. ``teacher=None`` detaches it."""
    if teacher is None:
        module.__dict__.pop(_TEACHER, None)
        return
    if hasattr(teacher, "trainable"):
        teacher.trainable = False
    module.__dict__[_TEACHER] = _Attached(teacher)


def teacher_of(module):
    """The teacher attached to ``module``, or ``None``."""
    attached = module.__dict__.get(_TEACHER)
    return None if attached is None else attached.teacher


def stream(module, inputs):
    """``(o, outputs)`` of ``module`` in the teacher stream.

    ``outputs``: ``module.all_outputs(inputs)``, ``(..., N + 1, D)``, with
    gradients (phase 1 trains the learners through it); ``o``: the teacher's
    output (inference call), else ``h(z, N)``, without gradients."""
    outputs = module.all_outputs(inputs)
    teacher = teacher_of(module)
    target = outputs[..., -1, :] if teacher is None else teacher(inputs, training=False)
    return ops.stop_gradient(ops.cast(target, outputs.dtype)), outputs
