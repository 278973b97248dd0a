"""ACM-ViT: a ViT whose MLPs are Adaptive Computation Modules (Wojcik et al., ``acm.txt``).

Every block's MLP is an ``ACMMLP`` (N learners = slices of the dense MLP's
hidden units) with its own ``ACMGate`` choosing, per token, how many learners
``k`` in ``0..N`` run (Sec. 3). Attention runs densely. The weight paths of
the attention, norms and MLP are the dense ViT's, so ``transfer_weights`` /
``init_from`` start an ACM-ViT from any dense ViT (the zoo's ``vit_digits``, a
converted AugReg / timm / keras-hub checkpoint); only the gates are new, and
at ``k = N`` for every token the model computes exactly the dense ViT.

Execution: ``"exact"`` (training and the reference: every token gets the
count its gate picked, learners masked; the task loss reaches the gates
through straight-through Gumbel-softmax) or ``"grouped"`` (inference: static
per-count quotas from ``beta``, learner n runs only on the tokens that reach
it; see ``keras_mone.routing.acm_quotas``).

The forward record (``return_intermediates=True``) holds ``"acm_choices"``
(per block, the one-hot choices ``(batch, tokens, N + 1)``), ``"acm_probs"``
(the gates' softmax) and ``"blocks"`` (per block ``assignment`` = the count
run, ``compute`` = its share ``k / N`` of the MLP's learners), which the
end-to-end loss terms (``keras_mone.training.acm_losses``) read.
"""

from keras import ops

from keras_mone.layers.acm import ACMMLP
from keras_mone.layers.acm_gate import ACMGate
from keras_mone.layers.arguments import integer
from keras_mone.layers.config import register
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.routing.acm_quotas import check_beta

EXECUTIONS = ("exact", "grouped")


@register
class ACMViTBackbone(ViTBackbone):
    """ViT with an ACM in place of every block's MLP.

    Args (beyond ``ViTBackbone``'s):
        num_learners: ``N`` learners per MLP (4 in the paper); ``mlp_dim`` must divide by it.
        execution: ``"exact"`` or ``"grouped"`` (applies at inference; training is exact).
        beta: the compute budget in ``(0, 1]`` that grouped execution's quotas
            follow (the ``beta_target`` the model was trained for).
        gate_temperature: Gumbel-softmax temperature (0.8).
        gate_seed: seed of the Gumbel noise.
    """

    default_name = "acm_vit_backbone"

    def __init__(
        self, num_learners=4, execution="exact", beta=0.5, gate_temperature=0.8, gate_seed=None, **kwargs
    ):
        if execution not in EXECUTIONS:
            raise ValueError(f"`execution` must be one of {EXECUTIONS}, got {execution!r}.")
        # read by the MLP factory while ViTBackbone builds the blocks
        self.__dict__.update(num_learners=integer("num_learners", num_learners), beta=check_beta(beta))
        super().__init__(**kwargs)
        self.execution = execution
        self.gate_temperature = gate_temperature
        self.gate_seed = gate_seed
        self.acm_gates = [
            ACMGate(
                self.num_learners + 1, temperature=gate_temperature,
                seed=None if gate_seed is None else gate_seed + index, dtype=self.dtype_policy,
                name=f"acm_gate_{index}",
            )
            for index in range(self.depth)
        ]

    def _block_options(self):
        return {"mlp_factory": self._make_mlp}

    def _make_mlp(self, hidden_dim, mlp_dim, dropout_rate, gelu_approximate, dtype):
        return ACMMLP(
            hidden_dim, mlp_dim, num_learners=self.num_learners, beta=self.beta, dropout_rate=dropout_rate,
            gelu_approximate=gelu_approximate, dtype=dtype, name="mlp",
        )

    def set_execution(self, execution):
        """Switches between ``"exact"`` and ``"grouped"`` inference (same weights)."""
        if execution not in EXECUTIONS:
            raise ValueError(f"`execution` must be one of {EXECUTIONS}, got {execution!r}.")
        self.execution = execution

    teacher_stream = False
    """Phase 2 (gate training): in training calls the residual stream runs every
    learner (the converted dense model) while the gates see its inputs and the
    record holds every ``h(z, k)``; evaluation and inference run the gated ACM
    (so a run's accuracy and GMACs describe one computation). Set by the
    ``gates`` training mode, not saved."""

    def routing_key(self):
        return ("acm", self.execution, self.teacher_stream)

    def _build_extra(self, token_shape):
        for gate in self.acm_gates:
            gate.build(token_shape)

    def encode(self, tokens, training=None, return_intermediates=False):
        """Dense attention, then per token the gate's count of MLP learners (Sec. 3)."""
        mode = "exact" if training else self.execution
        choices, probs, blocks, teacher = [], [], [], []
        for block, gate in zip(self.blocks, self.acm_gates):
            attended = block.attention([block.norm1(tokens)], training=training)[0]
            tokens = tokens + block.drop_path(attended, training=training)
            z = block.norm2(tokens)
            choice, prob = gate(z, training=training)
            confidence = ops.max(prob, axis=-1)
            if self.teacher_stream and training:  # phase 2: the stream is the dense model; gates learn tau labels
                outputs = ops.stop_gradient(block.mlp.all_outputs(z))
                update = outputs[..., -1, :]
                if return_intermediates:
                    teacher.append(outputs)
            else:
                update = block.mlp(z, ops.cast(choice, z.dtype), confidence=confidence, mode=mode, training=training)
            tokens = tokens + block.drop_path(update, training=training)
            if return_intermediates:
                counts = block.mlp.final_counts(choice, confidence, mode=mode)
                choices.append(choice)
                probs.append(prob)
                blocks.append({
                    "assignment": counts,
                    "compute": ops.cast(counts, "float32") / self.num_learners,
                })
        record = {}
        if return_intermediates:
            record = {"acm_choices": choices, "acm_probs": probs, "blocks": blocks}
            if teacher:
                record["acm_outputs"] = teacher  # per block (batch, tokens, N + 1, D): h(z, 0..N)
        return self.norm(tokens), record

