"""ACM-ViT: a ViT whose MLPs (and optionally projections) are Adaptive Computation Modules.

Wojcik et al., ``acm.txt``. Every block's MLP is an ``ACMMLP`` (N learners =
slices of the dense MLP's hidden units) with its own ``ACMGate`` choosing,
per token, how many learners ``k`` in ``0..N`` run (Sec. 3). Without
``acm_projections`` attention runs densely and the weight paths of the
attention, norms and MLP are the dense ViT's, so ``transfer_weights`` /
``init_from`` start an ACM-ViT from any dense ViT (the zoo's ``vit_digits``, a
converted AugReg / timm / keras-hub checkpoint); only the gates are new, and
at ``k = N`` for every token the model computes exactly the dense ViT.

With ``acm_projections=True`` (the paper's ViT setting, Sec. 4) the Q, K, V
and output projections are ``ACMLinear`` modules too (``ACMAttention``: ``N``
low-rank learners each, counts ``1..N``, one gate per projection, the
attention itself dense). Their weights have no dense counterpart by path:
``acm.transfer.acm_from_dense`` (and ``init_from``, through this
backbone's ``weight_conversion`` hook) copies the rest and sets the
projections by truncated SVD of the dense kernels.

Execution: ``"exact"`` (training and the reference: every token gets the
count its gate picked, learners masked; the task loss reaches the gates
through straight-through Gumbel-softmax) or ``"grouped"`` (inference: static
per-count quotas from ``beta``, learner n runs only on the tokens that reach
it; see ``keras_mone.methods.acm.quotas``).

The forward record (``return_intermediates=True``) holds one entry per ACM
module in ``"acm_choices"`` (one-hot choices ``(batch, tokens, N + 1)`` over
``k = 0..N``; straight-through in training), ``"acm_probs"`` (the gate's
softmax, same shape), ``"acm_counts"`` (int32 ``(batch, tokens)``: the count
run, after grouped quotas) and, in the teacher stream of phases 1-2,
``"acm_outputs"`` (``(batch, tokens, N + 1, D)``: ``h(z, k)`` for ``k = 0..N``,
zeros at ``k = 0``) and ``"acm_targets"`` (the dense module's output). Entries
are the blocks' MLPs in block order, then, with ``acm_projections``, each
block's query, key, value and out projections (``acm_module_names()`` names
them in this order, ``acm_learner_costs()`` gives each module's MACs per
learner and token: the ``p_l`` of the paper's L_budget, Eq. 7). A projection
never chooses ``k = 0``: its column 0 is 0 in choices and probs, and its
``h(z, 0)`` (zeros) is no valid output. Without ``acm_projections`` the lists
hold the MLPs only, as before. ``"blocks"`` holds per block the MLP's
``assignment`` (the count run) and ``compute`` (its share ``k / N``). The
loss terms (``keras_mone.methods.acm.losses``) read these lists.
"""

from keras import ops

from keras_mone.methods.acm import teacher as acm_teacher
from keras_mone.methods.acm.mlp import ACMMLP, with_zero_choice
from keras_mone.methods.acm.attention import PROJECTIONS, ACMAttention
from keras_mone.methods.acm.gate import ACMGate
from keras_mone.arguments import flag, integer
from keras_mone.layers.config import register
from keras_mone.methods.acm.transfer import dense_attention_conversion
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.methods.acm.quotas import check_beta

EXECUTIONS = ("exact", "grouped")


@register
class ACMViTBackbone(ViTBackbone):
    """ViT with an ACM in place of every block's MLP (and, optionally, of its Q, K, V, O projections).

    Args (beyond ``ViTBackbone``'s):
        num_learners: ``N`` learners per MLP (4 in the paper); ``mlp_dim`` must divide by it.
        execution: ``"exact"`` or ``"grouped"`` (applies at inference; training is exact).
        beta: the compute budget in ``(0, 1]`` that grouped execution's quotas
            follow (the ``beta_target`` the model was trained for).
        gate_temperature: Gumbel-softmax temperature (0.8).
        gate_seed: seed of the Gumbel noise.
        acm_projections: also make the Q, K, V and output projections ACMs
            (``ACMAttention``, the paper's ViT setting; needs ``beta > 1 / N``,
            since each projection runs at least one learner per token).
            ``False`` (default): dense attention, as the shipped ``acm_vit_digits``.
        projection_rank: rank ``r`` of a projection learner; ``None``: the
            paper's ``round((D^2 + D) / (N (2D + 1)))`` (``acm_linear.default_rank``).
    """

    default_name = "acm_vit_backbone"

    def __init__(
        self, num_learners=4, execution="exact", beta=0.5, gate_temperature=0.8, gate_seed=None,
        acm_projections=False, projection_rank=None, **kwargs
    ):
        if execution not in EXECUTIONS:
            raise ValueError(f"`execution` must be one of {EXECUTIONS}, got {execution!r}.")
        acm_projections = flag("acm_projections", acm_projections)
        num_learners, beta = integer("num_learners", num_learners), check_beta(beta)
        if acm_projections and beta * num_learners <= 1:
            raise ValueError(
                f"`beta` must exceed 1/{num_learners} with `acm_projections` (every token runs one "
                f"learner of each projection), got {beta!r}."
            )
        # read by the part factories while ViTBackbone builds the blocks
        self.__dict__.update(
            num_learners=num_learners, beta=beta, acm_projections=acm_projections,
            projection_rank=None if projection_rank is None else integer("projection_rank", projection_rank),
        )
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
        self.acm_projection_gates = [
            ACMGate(
                self.num_learners, temperature=gate_temperature,
                seed=None if gate_seed is None else gate_seed + self.depth * (1 + part) + index,
                dtype=self.dtype_policy, name=f"acm_gate_{index}_{name}",
            )
            for index in range(self.depth if self.acm_projections else 0)
            for part, name in enumerate(PROJECTIONS)
        ]

    def _block_options(self):
        options = {"mlp_factory": self._make_mlp}
        if self.acm_projections:
            options["attention_factory"] = self._make_attention
        return options

    def _make_attention(self, hidden_dim, num_heads, dropout_rate, dtype):
        return ACMAttention(
            hidden_dim, num_heads, num_learners=self.num_learners, rank=self.projection_rank, beta=self.beta,
            dropout_rate=dropout_rate, dtype=dtype, name="attention",
        )

    def weight_conversion(self, source, target, source_weights):
        """``copy_matching_weights``' hook: dense attention kernels -> ACM projections by SVD."""
        return dense_attention_conversion(self, source, target, source_weights)

    def acm_module_names(self):
        """Names of the ACM modules in the record's order: ``block_{i}/mlp`` for
        every block, then ``block_{i}/{query,key,value,out}`` (with ``acm_projections``)."""
        names = [f"block_{i}/mlp" for i in range(self.depth)]
        if self.acm_projections:
            names += [f"block_{i}/{name}" for i in range(self.depth) for name in PROJECTIONS]
        return names

    def acm_learner_costs(self):
        """MACs of one learner on one token per module, in the record's order
        (``2 D M / N`` for an MLP, ``2 D r`` for a projection): L_budget's ``p^l``,
        the same per-learner cost the FLOP counter's plan reads."""
        mlps = [block.mlp.learner_macs for block in self.blocks]
        if not self.acm_projections:
            return mlps
        return mlps + [block.attention.projections[name].learner_macs for block in self.blocks for name in PROJECTIONS]

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
    """Phases 1 and 2 (learner distillation, gate training): in training calls
    the residual stream runs the dense model (each module's teacher, attached
    by ``acm.teacher.attach``, else ``h(z, N)``) while the gates see its
    inputs and the record holds every ``h(z, k)`` (``"acm_outputs"``, with
    gradients) and the dense output (``"acm_targets"``); evaluation and
    inference run the gated ACM (so a run's accuracy and GMACs describe one
    computation). Set by the ``distill`` and ``gates`` modes, not saved."""

    def routing_key(self):
        return ("acm", self.execution, self.teacher_stream)

    def _build_extra(self, token_shape):
        for gate in self.acm_gates + self.acm_projection_gates:
            gate.build(token_shape)

    def encode(self, tokens, training=None, return_intermediates=False):
        """Attention (dense, or ACM projections), then per token the gate's count of MLP learners (Sec. 3)."""
        mode = "exact" if training else self.execution
        teacher_on = bool(self.teacher_stream and training)
        mlp_entries, projection_entries, blocks = ([], [], []) if return_intermediates else (None, None, None)
        gates = iter(self.acm_projection_gates)
        for block, gate in zip(self.blocks, self.acm_gates):
            x = block.norm1(tokens)
            if self.acm_projections:
                modules = [(p, next(gates)) for p in block.attention.projections.values()]
                q, k, v = (self._run_module(*m, x, mode, training, teacher_on, projection_entries) for m in modules[:3])
                attended = block.attention.attend(q, k, v)
                attended = self._run_module(*modules[3], attended, mode, training, teacher_on, projection_entries)
                attended = block.attention.finish(attended, training=training)
            else:
                attended = block.attention([x], training=training)[0]
            tokens = tokens + block.drop_path(attended, training=training)
            update = self._run_module(block.mlp, gate, block.norm2(tokens), mode, training, teacher_on, mlp_entries)
            tokens = tokens + block.drop_path(update, training=training)
            if return_intermediates:
                counts = mlp_entries[-1]["counts"]
                blocks.append({"assignment": counts, "compute": ops.cast(counts, "float32") / self.num_learners})
        record = {}
        if return_intermediates:
            entries = mlp_entries + projection_entries
            record = {
                "acm_choices": [e["choice"] for e in entries],
                "acm_probs": [e["probs"] for e in entries],
                "acm_counts": [e["counts"] for e in entries],
                "blocks": blocks,
            }
            if teacher_on:
                record["acm_outputs"] = [e["outputs"] for e in entries]  # (batch, tokens, N + 1, D): h(z, 0..N)
                record["acm_targets"] = [e["target"] for e in entries]  # (batch, tokens, D): the dense module's o
        return self.norm(tokens), record

    def _run_module(self, module, gate, z, mode, training, teacher_on, entries):
        """One ACM module on ``z``: its gate, then ``h(z, k)`` per token (every learner in the
        gates phase's teacher stream); appends the module's record entry to ``entries`` (``None``: no record)."""
        choice, prob = gate(z, training=training)
        confidence = ops.max(prob, axis=-1)
        entry = {}
        if teacher_on:  # phases 1-2: the stream is the dense model (acm.teacher)
            update, outputs = acm_teacher.stream(module, z)
            entry.update(outputs=outputs, target=update)
        else:
            update = module(z, ops.cast(choice, z.dtype), confidence=confidence, mode=mode, training=training)
        if entries is None:
            return update
        entry["counts"] = module.final_counts(choice, confidence, mode=mode)
        if module.min_count:  # counts 1..N: column k = 0 holds 0, one layout for every module
            choice, prob = with_zero_choice(choice), with_zero_choice(prob)
        entry.update(choice=choice, probs=prob)
        entries.append(entry)
        return update
