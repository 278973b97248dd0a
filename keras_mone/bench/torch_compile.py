"""``torch.compile`` in ``keras-mone bench`` (issue 40 item 3): the modes a run times, and
whether the CUDA graphs of ``mode="reduce-overhead"`` ran.

* ``PATHS``: each mode and its timing path in the report: "default" (what Keras'
  ``jit_compile=True`` runs) -> ``compiled``; "reduce-overhead" (the compiled forward
  replayed as a CUDA graph: one launch instead of one per kernel) -> ``cudagraphs``.
* ``compile_modes(setting)``: the modes of a ``torch_compile`` setting, checked.
* ``compiled(function, mode)``: ``function`` under ``torch.compile`` in ``mode``.
* ``cudagraph_skips()``: how often inductor has fallen back from CUDA graphs so far in
  this process (always on a CPU, which has none; on a GPU for a graph it cannot capture).
"""

PATHS = {"default": "compiled", "reduce-overhead": "cudagraphs"}


def compile_modes(setting):
    """The ``torch.compile`` modes of a ``torch_compile`` setting, as a list without repeats:
    ``False`` / ``None`` / ``""`` -> none, ``True`` -> ``["default"]``, a mode, comma-separated
    modes or a list of modes of ``PATHS`` -> those. Anything else raises ValueError."""
    if setting is None or setting is False or setting == "" or setting == []:
        return []
    if setting is True:
        return ["default"]
    if isinstance(setting, str):
        words = setting.split(",")
    else:  # a list or tuple of modes; anything else has none and is refused below
        words = [str(mode) for mode in setting] if isinstance(setting, (list, tuple)) else []
    modes = list(dict.fromkeys(word.strip() for word in words if word.strip()))
    if not modes or any(mode not in PATHS for mode in modes):
        raise ValueError(f"`torch_compile` must be True, False or modes of {list(PATHS)}, got {setting!r}.")
    return modes


def compiled(function, mode=True):
    """``torch.compile(function)`` in ``mode`` (``True`` or "default": torch's default)."""
    import torch

    return torch.compile(function) if mode is True or mode == "default" else torch.compile(function, mode=mode)


def cudagraph_skips():
    """Inductor's count of CUDA-graph fallbacks in this process (0 where torch is absent)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["inductor"]["cudagraph_skips"])
