"""Copying weights between models that share a layout (dense ViT -> MoNE-ViT, MatViT, MoD, ACM)."""

from keras import ops


def relative_weight_paths(model):
    """``{path below the model: variable}`` of a built model.

    Paths are relative to ``model`` wherever it was built: a backbone built
    inside a classifier has paths ``classifier/backbone/block_0/...``, and
    both that and a stand-alone backbone give ``block_0/...``. In a
    classifier, the backbone's own name becomes ``backbone``, so a dense
    classifier's weights find their place in a MoNE classifier's.
    """
    backbone = getattr(model, "backbone", None)
    paths = {}
    for variable in model.weights:
        parts = variable.path.split("/")
        if model.name in parts[:-1]:
            parts = parts[parts.index(model.name) + 1:]
        if backbone is not None and len(parts) > 1 and parts[0] == backbone.name:
            parts[0] = "backbone"
        paths["/".join(parts)] = variable
    return paths


def transfer_weights(source, target):
    """Copies every weight of ``source`` into the weight of ``target`` at the same path.

    Both models must be built; they are backbones or classifiers (head
    included) of the same size. Typical use: initialise a ``MoNEViTBackbone``
    from a trained ``ViTBackbone``; the routers and the per-block ``alpha``
    are the only MoNE weights without a dense counterpart and keep their
    initial values (with ``alpha = 0`` the MoNE model at capacity 1.0 then
    reproduces the dense model).

    Returns:
        Sorted paths of ``target`` weights that had no counterpart.

    Raises:
        ValueError: a ``source`` weight has no place in ``target`` or a shape
            differs; nothing is copied in that case.
    """
    source_weights, target_weights = relative_weight_paths(source), relative_weight_paths(target)
    copy_by_path(source_weights, target_weights, f"Cannot transfer weights from '{source.name}' to '{target.name}'")
    return sorted(set(target_weights) - set(source_weights))


def copy_matching_weights(source, target):
    """Copies ``source`` into ``target`` weight by weight; recipes' ``init_from`` copy.

    ``transfer_weights`` with one hook for weights that change form between
    architectures: a target backbone's ``weight_conversion(source, target,
    source_weights)`` may pop the source weights it converts out of
    ``source_weights`` (``{relative path: variable}``) and return a function
    ``set_converted(target_weights)`` that sets them once the rest is copied
    by path and returns the target paths it set. The hook returns ``None``
    when there is nothing to convert and raises ``ValueError`` before
    anything is copied; ACM's is ``ACMViTBackbone.weight_conversion``. Returns the
    sorted paths of ``target`` left at their initialisation.
    """
    hook = getattr(getattr(target, "backbone", target), "weight_conversion", None)
    source_weights, target_weights = relative_weight_paths(source), relative_weight_paths(target)
    set_converted = None if hook is None else hook(source, target, source_weights)
    if set_converted is None:
        context = f"Cannot transfer weights from '{source.name}' to '{target.name}'"
    else:
        context = f"Cannot start '{target.name}' from '{source.name}'"
    copy_by_path(source_weights, target_weights, context)
    loaded = set(source_weights) | (set() if set_converted is None else set(set_converted(target_weights)))
    return sorted(set(target_weights) - loaded)


def copy_by_path(source_weights, target_weights, context):
    """Copies each ``{path: variable}`` of ``source_weights`` into ``target_weights[path]``.

    Checks first: a source path absent in the target or a shape that differs
    raises ``ValueError`` (starting with ``context``) and nothing is copied.
    """
    missing = sorted(set(source_weights) - set(target_weights))
    mismatched = [
        f"{path}: {tuple(v.shape)} vs {tuple(target_weights[path].shape)}"
        for path, v in source_weights.items()
        if path in target_weights and tuple(v.shape) != tuple(target_weights[path].shape)
    ]
    if missing or mismatched:
        raise ValueError(f"{context}: weights absent in the target: {missing}; shape mismatches: {mismatched}.")
    for path, variable in source_weights.items():
        # A copy, not the source's buffer: on jax, training the source later
        # donates (deletes) its buffers, which the target would still hold.
        target_weights[path].assign(ops.copy(variable.value))
