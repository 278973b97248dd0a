"""Checkpoint keys read by a converter, and why the others stay unused.

A converter reads every array through a ``KeyReader``; the keys it never read
are the checkpoint's *unused* keys, each with the reason the model cannot
represent it (``load_vit_state`` refuses them in strict mode). A key no rule
explains gets ``UNKNOWN``, which the loader turns into a reason naming the
class of the model it loads into (``name_target``).
"""

import re
import warnings

#: What ``strict=False`` does not relax (ends every shape-mismatch error).
STRICT_SCOPE = ("strict=False does not relax this: it skips only checkpoint keys the model has no part for; "
                "a missing or misshaped weight is an error in either mode")
UNKNOWN = "unknown key: no part of the model reads it"  # the loader names the model (``name_target``)


class KeyReader:
    """``reader(key, where)``: the array at ``key``, remembered as read.

    Args:
        arrays: ``{key: array}`` of the checkpoint.
        reasons: ``[(regex, reason)]`` for keys the converter knows but the
            model has no part for; the first match names an unused key's reason.
    """

    def __init__(self, arrays, reasons=()):
        self.arrays = dict(arrays)
        self.reasons = list(reasons)
        self.read = set()

    def __contains__(self, key):
        return key in self.arrays

    def __call__(self, key, where="the checkpoint"):
        if key not in self.arrays:
            raise ValueError(f"{where} has no {key!r} (a missing weight is an error, also with strict=False).")
        self.read.add(key)
        return self.arrays[key]

    def optional(self, key):
        """The array at ``key`` (read) or ``None``."""
        return self(key) if key in self.arrays else None

    def unused(self):
        """``{key: reason}`` of every key not read."""
        return {key: self.reason(key) for key in sorted(self.arrays) if key not in self.read}

    def reason(self, key):
        return next((reason for pattern, reason in self.reasons if re.search(pattern, key)), UNKNOWN)


def name_target(unused, backbone):
    """``unused`` with each ``UNKNOWN`` reason naming ``backbone``'s class (the model family loaded into)."""
    reason = f"not a part of keras_mone's {type(backbone).__name__} or its classifier (unknown key)"
    return {key: reason if why == UNKNOWN else why for key, why in unused.items()}


def contiguous_blocks(indices, name):
    """``sorted(indices)`` if they are ``0 .. n-1``; else a ``ValueError`` naming the gap."""
    indices = sorted(set(indices))
    if not indices:
        raise ValueError(f"the checkpoint has no blocks ({name}).")
    missing = sorted(set(range(indices[-1] + 1)) - set(indices))
    if missing:
        raise ValueError(
            f"its blocks are numbered {indices} ({name}): block(s) {missing} missing, so the "
            "checkpoint is incomplete or not one model."
        )
    return indices


def describe_unused(unused, limit=40):
    """Unused keys grouped by reason, one line per reason (at most ``limit`` keys per line)."""
    groups = {}
    for key, reason in unused.items():
        groups.setdefault(reason, []).append(key)
    lines = []
    for reason, keys in groups.items():
        shown = ", ".join(repr(k) for k in keys[:limit])
        more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
        lines.append(f"  {shown}{more}: {reason}")
    return "\n".join(lines)


def warn_unused(source, unused):
    """Warns that ``strict=False`` left the keys of ``unused`` unloaded, naming each with its reason."""
    if unused:
        warnings.warn(
            f"{source}: strict=False skipped {len(unused)} key(s) the model would not use (the report's "
            "'unused' lists them; the model computes something else than the checkpoint):\n"
            + describe_unused(unused),
            stacklevel=4,
        )
