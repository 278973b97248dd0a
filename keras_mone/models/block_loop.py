"""The encoder loop of every ViT in keras_mone, written once.

``run_blocks`` runs the blocks on the token groups a routing part
(``keras_mone.routing.parts``) plans for each of them; dense, MatViT, MoNE,
MoD and A-MoD encoders differ only in the part they hand it.
"""

from keras import ops

from keras_mone.layers.nested_dense import materialized
from keras_mone.routing.token_groups import to_original


class BlockRecord:
    """The named intermediates of one forward pass (``return_intermediates=True``).

    ``as_dict()`` gives:

    * ``"blocks"``: one dict per block with ``"assignment"`` (``(batch,
      tokens)`` int32: expert / group of each token, -1 when it skips the
      block), ``"compute"`` (``(batch, tokens)`` float32: share of the full
      width each token runs at, 0 when skipped) and, in blocks where a router
      decided, ``"scores"`` (its scores, original token order);
    * the method's own lists, one entry per routing decision: MoNE
      ``"router_probs"`` and ``"expert_index"``, MoD / A-MoD ``"scores"``
      and ``"selected"``.

    Tokens are in their original order in every entry (``selected`` holds
    original token indices).
    """

    def __init__(self, hidden_dim):
        self.hidden_dim = hidden_dim
        self.blocks = []
        self.lists = {}
        self._scores = {}

    def add(self, name, order, value):
        """Appends ``value`` (laid out in ``order``) to the list ``name``."""
        self.lists.setdefault(name, []).append(to_original(value, order))

    def set_scores(self, index, order, scores):
        self._scores[index] = to_original(scores, order)

    def add_block(self, index, state):
        like = state.groups[0] if state.groups else state.passed
        entry = {
            "assignment": state.assignment(like),
            "compute": state.compute_per_token(like, self.hidden_dim),
        }
        if index in self._scores:
            entry["scores"] = self._scores[index]
        self.blocks.append(entry)

    def as_dict(self):
        return {**self.lists, "blocks": self.blocks}


def run_blocks(blocks, tokens, routing, training=None, return_intermediates=False):
    """Runs ``blocks`` on ``tokens`` as ``routing`` plans; returns ``(tokens, intermediates)``,
    the tokens back in their original order."""
    record = BlockRecord(routing.hidden_dim) if return_intermediates else None
    state = routing.start(tokens)
    received = None
    for index, block in enumerate(blocks):
        regrouped = routing.before_block(index, state, received, record)
        if regrouped is not state:  # tokens regrouped: each group written once (jax's GPU)
            regrouped.groups = materialized(regrouped.groups)
        state = regrouped
        wants_attention = routing.wants_received_attention(index)
        outputs = None if wants_attention else _direct_call(block, state, training)
        if outputs is None:
            outputs = block(
                state.groups, widths=state.widths, gates=state.gates, training=training,
                return_received_attention=wants_attention,
            )
        if wants_attention:
            outputs, received = outputs
        if record is not None:
            record.add_block(index, state)
        state = routing.after_block(index, state.with_outputs(outputs))
    return state.restored(), ({} if record is None else record.as_dict())


def _direct_call(block, state, training):
    """The block's outputs without Keras' ``Layer.__call__`` where the block offers that
    exactly (``ViTBlock.direct_call``: the packed block on eager torch), else ``None``. The
    blocks after one routing share its forms of the gates (``TokenGroups.gate_forms``)."""
    direct_call = getattr(block, "direct_call", None)
    if direct_call is None:
        return None
    return direct_call(state.groups, state.widths, state.gates, training, gate_forms=state.gate_forms)


def compute_per_token(intermediates):
    """``(batch, tokens)`` mean share of the full width each token ran at, over blocks."""
    shares = [entry["compute"] for entry in intermediates["blocks"]]
    return ops.mean(ops.stack(shares, axis=0), axis=0)
