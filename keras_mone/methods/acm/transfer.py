"""Starting an ACM-ViT with ACM projections from a dense ViT (Wojcik et al., ``acm.txt``, Sec. 3.2)."""

import numpy as np
from keras import ops

from keras_mone.models.weight_transfer import copy_matching_weights


def acm_from_dense(source, target):
    """Copies a dense ViT into an ACM-ViT; projections by truncated SVD.

    Every ``source`` weight whose path exists in ``target`` is copied (patch
    embedding, norms, MLPs as learner slices, head between classifiers of the
    same class count), as ``transfer_weights`` does. With
    ``acm_projections`` each block's fused ``attention/qkv`` and
    ``attention/out`` kernels have no counterpart by path: they initialise the
    query, key, value and out ``ACMLinear`` learners by truncated SVD
    (``ACMAttention.load_dense``), so ``k = N`` is the best rank-``N r``
    approximation of each dense projection (exact when ``N r >= D``). This is
    a deterministic starting point; the paper distils the learners from a
    random initialisation instead (its phase 1), which can follow.

    Without projections to convert (a target without ``acm_projections``, or
    a source that has them too) it is ``transfer_weights``. It is
    ``copy_matching_weights`` (recipes' ``init_from``), whose hook for an
    ACM-ViT is ``dense_attention_conversion``. Both models are built
    backbones or both classifiers. Returns the sorted
    paths of ``target`` left at their initialisation (the gates, and for
    ACM projections nothing else). Raises ``ValueError`` (nothing copied) if
    a source weight fits nowhere or a shape differs.
    """
    return copy_matching_weights(source, target)


def dense_attention_conversion(backbone, source, target, source_weights):
    """ACM's ``weight_conversion`` hook of ``copy_matching_weights`` (``backbone``: the target's).

    With ``acm_projections`` (and a source without them), pops each block's
    dense ``attention/qkv`` and ``attention/out`` weights out of
    ``source_weights`` and returns the step that sets the block's
    ``ACMAttention`` from them by SVD; ``None`` otherwise. Raises
    ``ValueError`` if a block's dense attention kernels are missing.
    """
    if not getattr(backbone, "acm_projections", False) or getattr(
        getattr(source, "backbone", source), "acm_projections", False
    ):  # no projections to convert: weight by weight
        return None
    prefix = "backbone/" if backbone is not target else ""
    dense_attention = {}
    for index in range(backbone.depth):
        names = [f"{prefix}block_{index}/attention/{part}/{kind}" for part in ("qkv", "out") for kind in ("kernel", "bias")]
        if not all(name in source_weights for name in names[::2]):
            raise ValueError(
                f"Cannot start '{target.name}' from '{source.name}': no dense attention kernels at {names[::2]}."
            )
        dense_attention[index] = [
            np.asarray(ops.convert_to_numpy(source_weights.pop(name))) if name in source_weights else None
            for name in names
        ]

    def set_converted(target_weights):
        loaded = set()
        for index, (qkv_kernel, qkv_bias, out_kernel, out_bias) in dense_attention.items():
            backbone.blocks[index].attention.load_dense(qkv_kernel, qkv_bias, out_kernel, out_bias)
            loaded.update(path for path in target_weights if path.startswith(f"{prefix}block_{index}/attention/"))
        return loaded

    return set_converted
