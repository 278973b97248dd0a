"""MatViT: a ViT with nested model widths, MoNE's MatFormer baseline (MoNE Sec. 5).

MatFormer / MatViT (Devvrit et al. 2023) trains nested sub-models jointly; the
MoNE paper's MatViT baseline nests the model dimension ``D`` (the in- and
out-projections of attention and MLP, exactly like MoNE's experts), with every
token at the same width. Training sums the loss over the widths
``D/8, D/4, D/2, D`` each step (``keras_mone.models.MatViTClassifier``).
"""

from keras_mone.layers.config import register
from keras_mone.models.block_loop import run_blocks
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.routing.parts import FixedWidths
from keras_mone.models.vivit_backbone import video_form


@register
class MatViTBackbone(ViTBackbone):
    """ViT whose blocks run at a settable nested width ``d = D * width_fraction``.

    At width ``d`` every token's QKV and MLP in-projections read its first
    ``d`` features and the attention-output and MLP out-projections write its
    first ``d`` features (zero-padded to ``D`` for the residual); attention
    scores and LayerNorms stay at ``D`` (``ViTBlock`` with ``widths=[d]``).
    At ``width_fraction=1`` it is the dense ``ViTBackbone`` with the same weights.

    Widths are static, so a width change retraces: ``set_width`` switches an
    existing model (compiled functions are kept per width, as for MoNE
    capacities).

    Args (beyond ``ViTBackbone``'s):
        num_widths: number of nested widths ``D/2**(num_widths-1), ..., D/2, D``
            (4 in MatViT / MoNE).
        width_fraction: fraction of ``D`` used by every block, one of
            ``nested_fractions``.
        layer_width_fractions: optional Mix'n'Match widths, one fraction per
            block (overrides ``width_fraction``).
    """

    default_name = "matvit_backbone"

    def __init__(self, num_widths=4, width_fraction=1.0, layer_width_fractions=None, **kwargs):
        hidden_dim = kwargs.get("hidden_dim", 768)
        if not isinstance(num_widths, int) or num_widths < 1 or hidden_dim % 2 ** (num_widths - 1):
            raise ValueError(
                f"`num_widths`={num_widths!r} needs `hidden_dim` ({hidden_dim}) divisible by "
                f"2**(num_widths - 1)."
            )
        super().__init__(**kwargs)
        self.num_widths = num_widths
        self.width_fraction = None
        self.layer_width_fractions = None
        self.set_width(width_fraction, layer_width_fractions)

    @property
    def nested_fractions(self):
        """Allowed width fractions, smallest first: ``(1/8, 1/4, 1/2, 1)`` for 4 widths."""
        return tuple(2.0 ** -k for k in reversed(range(self.num_widths)))

    def set_width(self, width_fraction=1.0, layer_width_fractions=None):
        """Runs every block at ``width_fraction * D`` (or block ``i`` at
        ``layer_width_fractions[i] * D``, Mix'n'Match) from now on."""
        self.width_fraction = self._check_fraction(width_fraction, "width_fraction")
        if layer_width_fractions is not None:
            layer_width_fractions = [
                self._check_fraction(f, "layer_width_fractions") for f in layer_width_fractions
            ]
            if len(layer_width_fractions) != self.depth:
                raise ValueError(
                    f"`layer_width_fractions` needs one fraction per block ({self.depth}), "
                    f"got {len(layer_width_fractions)}."
                )
        self.__dict__["layer_width_fractions"] = layer_width_fractions  # a plain list for get_config

    def _check_fraction(self, fraction, name):
        fraction = float(fraction)
        if not any(abs(fraction - f) < 1e-9 for f in self.nested_fractions):
            raise ValueError(f"`{name}` must be one of {self.nested_fractions}, got {fraction}.")
        return fraction

    def layer_widths(self, width_fraction=None):
        """Width ``d`` of each block, at ``width_fraction`` (default: the current setting)."""
        if width_fraction is None and self.layer_width_fractions is not None:
            fractions = self.layer_width_fractions
        else:
            fraction = self.width_fraction if width_fraction is None else width_fraction
            fractions = [self._check_fraction(fraction, "width_fraction")] * self.depth
        return [int(round(f * self.hidden_dim)) for f in fractions]

    def routing_key(self):
        return ("matvit", tuple(self.layer_widths()))

    def token_routing(self):
        return FixedWidths(self.layer_widths(), self.hidden_dim)

    def encode_at(self, tokens, widths, training=None):
        """Blocks (block ``i`` at width ``widths[i]``) and the final LayerNorm."""
        tokens, _ = run_blocks(self.blocks, tokens, FixedWidths(widths, self.hidden_dim), training=training)
        return self.norm(tokens)


MatViViTBackbone = video_form(MatViTBackbone)
MatViViTBackbone.__doc__ = """MatViT-ViViT-FE: the spatial transformer at a settable nested width (MatFormer).

    The MoNE paper starts its video models from "a baseline model with nested
    structure" trained jointly on all widths (Sec. 4.4 and 5): this backbone,
    trained with ``MatViViTClassifier`` (losses of ``D/8 .. D`` summed), is
    that baseline, and its weights load into ``MoNEViViTBackbone`` unchanged
    (``keras_mone.models.transfer_weights``). ``set_width`` nests the spatial
    blocks; the temporal transformer stays at full width, as in MoNE-ViViT.
    At ``width_fraction=1`` it equals ``ViViTBackbone`` with the same weights.
    """
