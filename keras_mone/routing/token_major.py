"""Token groups cut from one token-major tensor, and that tensor taken back without a copy (torch).

A packed block (``layers.packed_block``) runs its groups as the rows of one ``(tokens, batch,
...)`` tensor, and hands each group on as a ``(batch, k_j, ...)`` view of it; so does the
router's single gather (``routing.parts``). The next packed block needs the whole tensor
again. ``cut_groups`` tags each view with the tensor it was cut from and its place, and
``tagged_whole`` returns that tensor (or its first rows, where the tokens that skip the block
follow the groups) when the groups are those views, in order: no concatenation.

Eager torch could also find the tensor from the views' storage, but ``torch.compile`` reads
neither data pointers nor storage offsets, and inductor copies a concatenation into a buffer
wherever its reader is an opaque kernel (the Triton projections of
``KERAS_MONE_PROJECTIONS=grouped_kernel``: one read and one write of a block's rows per
block). Dynamo traces the tags as Python attributes, across graph breaks too. A group that
is not one of the tagged views (cast, copied, reordered) has no tag or the wrong one, and
the caller concatenates.
"""

TAG = "_keras_mone_token_major"
"""The attribute a cut view carries: ``(whole, its first row, its row past the last)``."""


def cut_groups(whole, sizes):
    """``whole`` (``(sum(sizes) [+ more], batch, ...)``, token-major) as ``(batch, k_j, ...)`` views of
    its first rows, one per size in ``sizes``, each tagged for ``tagged_whole``."""
    groups, start = [], 0
    for size in sizes:
        view = whole[start:start + size].transpose(0, 1)
        setattr(view, TAG, (whole, start, start + size))
        groups.append(view)
        start += size
    return groups


def tagged_whole(groups):
    """The token-major tensor ``groups`` were cut from by ``cut_groups``, as ``(sum k_j, batch,
    ...)`` (its first rows where it has more), or ``None`` unless ``groups`` are views of its
    consecutive rows from the first, in order, each still of its cut's shape (views cut from
    one tensor in two ways, or reshaped in place since, have no whole)."""
    tags = [getattr(group, TAG, None) for group in groups]
    if not tags or tags[0] is None:
        return None
    whole, stop = tags[0][0], 0
    for group, tag in zip(groups, tags):
        if tag is None or tag[0] is not whole or tag[1] != stop:
            return None
        if tuple(group.shape) != (whole.shape[1], tag[2] - tag[1]) + tuple(whole.shape[2:]):
            return None
        stop = tag[2]
    return whole if stop == whole.shape[0] else whole[:stop]
