"""Sparse-MLP started from a trained MLP-Mixer (Lou et al. 2021, Sec. 3.2)."""

from keras import ops

from keras_mone.models.weight_transfer import relative_weight_paths


def sparse_mlp_from_mixer(mixer, sparse_mlp):
    """Starts a Sparse-MLP from a trained MLP-Mixer of the same width (Lou et al. 2021, Sec. 3.2:
    the dense blocks come first, the sparse ones replace the last blocks).

    Copies the patch embedding, the Mixer's first ``sparse_mlp.depth`` blocks,
    the final LayerNorm and (between classifiers, same class count) the head;
    the Re-represent layers and sparse blocks keep their initialisation. Both
    models are backbones or both classifiers, built.

    Returns:
        Sorted paths of ``sparse_mlp`` weights left at their initialisation.

    Raises:
        ValueError: the Mixer has fewer blocks than the Sparse-MLP's dense
            part, or a copied weight's shape differs; nothing is copied then.
    """
    mixer_backbone = getattr(mixer, "backbone", mixer)
    sparse_backbone = getattr(sparse_mlp, "backbone", sparse_mlp)
    if mixer_backbone.depth < sparse_backbone.depth:
        raise ValueError(
            f"The Mixer has {mixer_backbone.depth} blocks; the Sparse-MLP's dense part needs "
            f"{sparse_backbone.depth}."
        )
    dense_blocks = {f"block_{i}" for i in range(sparse_backbone.depth)}
    source = relative_weight_paths(mixer)
    target = relative_weight_paths(sparse_mlp)
    prefix = "backbone/" if mixer is not mixer_backbone else ""

    def wanted(path):
        inner = path[len(prefix):] if path.startswith(prefix) else path
        part = inner.split("/")[0]
        return part in dense_blocks or part in ("patch_embedding", "norm") or (
            prefix and path.startswith("head/") and path in target
            and tuple(source[path].shape) == tuple(target[path].shape)
        )

    copied = {path: variable for path, variable in source.items() if wanted(path)}
    mismatched = [
        f"{path}: {tuple(v.shape)} vs {tuple(target[path].shape) if path in target else 'absent'}"
        for path, v in copied.items()
        if path not in target or tuple(v.shape) != tuple(target[path].shape)
    ]
    if mismatched:
        raise ValueError(f"Cannot start '{sparse_mlp.name}' from '{mixer.name}': {mismatched}.")
    for path, variable in copied.items():
        target[path].assign(ops.copy(variable.value))
    return sorted(set(target) - set(copied))
