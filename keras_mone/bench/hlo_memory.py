"""What an XLA program holds at its memory peak, read from XLA's own dump (issue 40).

``memory_analysis()`` gives a compiled program's temporaries: the size of the heap XLA
laid its buffers out in. It does not say what is live when: that is in the buffer
assignment (each buffer's offset and size in the heap) and the live ranges (each
buffer's first and last instruction in the schedule) that XLA writes when asked to dump
a compile (``compiler_options={"xla_dump_to": folder}``, ``dump_options``).

``program_memory(folder)`` reads them back. At each instruction the live bytes are the
union of the live buffers' ``[offset, offset + size)`` in the heap, so a buffer that
XLA reuses in place for an elementwise result counts once; the live peak is the most
of these along the schedule. The heap can be larger than the live peak: the difference
is where XLA placed buffers of different sizes and lifetimes (fragmentation).
"""

import collections
import contextlib
import glob
import os
import re

Buffer = collections.namedtuple("Buffer", "name op_name shape bytes start end")
"""A temporary buffer: the instruction that defines it, its ``op_name`` (the jax
computation it comes from), its shape, its bytes and its live range in the schedule."""

ProgramMemory = collections.namedtuple("ProgramMemory", "heap_bytes live_peak_bytes peak_instruction at_peak")
"""``heap_bytes``: XLA's temporaries (``memory_analysis().temp_size_in_bytes``, up to
alignment); ``live_peak_bytes``: the most bytes live at one instruction; the instruction
where that happens; ``at_peak``: the buffers live there, largest first."""


def dump_options(folder, module=None):
    """``compiler_options`` for ``Lowered.compile`` that make XLA dump what
    ``program_memory`` reads into ``folder``; ``module``: the program's name (``jit_<function
    name>``), so that no other program compiled alongside it (a GPU's autotuning) is dumped
    there. Compile under ``compiled_afresh``: a program jax's persistent cache holds is
    loaded, not compiled, and nothing is dumped."""
    options = {"xla_dump_to": folder, "xla_dump_hlo_as_text": True}
    if module is not None:
        options["xla_dump_hlo_module_re"] = re.escape(module)
    return options


@contextlib.contextmanager
def compiled_afresh():
    """Inside, jax compiles every program instead of loading it from its persistent
    compilation cache (which would skip XLA's dump)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # jax decides once whether to use the cache: decide again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def program_memory(folder):
    """The ``ProgramMemory`` of the one program XLA dumped into ``folder`` (``dump_options``).

    Raises ValueError when ``folder`` holds no dump of an optimised program, or several, or
    a temporary the live ranges do not place (a dump format this reader does not know).
    """
    found = sorted(glob.glob(os.path.join(folder, "*after_optimizations-buffer-assignment.txt")))
    if len(found) != 1:
        raise ValueError(f"`folder` must hold XLA's dump of exactly one compiled program (dump_options); "
                         f"{folder!r} holds {len(found)} buffer assignments.")
    prefix = found[0][: -len("-buffer-assignment.txt")]
    with open(found[0]) as f:
        assignment = f.read()
    with open(prefix + "-live-range.txt") as f:
        live_ranges = f.read()
    with open(prefix + ".txt") as f:
        op_names = dict(re.findall(r'^\s+(?:ROOT )?%(\S+) = .*?op_name="([^"]+)"', f.read(), re.M))
    return _peak(*_temporaries(assignment), _ranges(live_ranges), op_names)


def _temporaries(assignment):
    """``(heap bytes, {value name: (place, bytes, shape)})`` of the preallocated temporaries;
    a value's place is its offset in its allocation, allocations kept apart (XLA may make one
    per memory space)."""
    heap, values = 0, {}
    allocations = list(re.finditer(  # "color N, ": temporaries in a memory space of their own (an XLA flag)
        r"^allocation (\d+): size (\d+),(?: color \d+,)? preallocated-temp:\n((?: value: .*\n)*)", assignment, re.M
    ))
    if len(allocations) != len(re.findall(r"^allocation \d+: .*preallocated-temp", assignment, re.M)):
        raise ValueError("XLA's buffer assignment has a preallocated-temp allocation in a form this reader "
                         "does not know.")
    for allocation in allocations:
        base = int(allocation.group(1)) << 48
        heap += int(allocation.group(2))
        for name, size, offset, shape in re.findall(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.+)",
                                                    allocation.group(3)):
            values[name] = (base + int(offset), int(size), shape.strip())
    return heap, values


def _ranges(live_ranges):
    """``(instruction sequence, {value name: (start, end)})`` from XLA's live-range dump."""
    sequence_text, _, rest = live_ranges.partition("BufferLiveRange:")
    sequence = [name for _, name in re.findall(r"^\s+(\d+):(\S+)$", sequence_text, re.M)]
    ranges = {}
    for name, index, start, end in re.findall(r"^\s+(\S+?)(\{[^}]*\}):(\d+)-(\d+)$", rest, re.M):
        ranges[name + ("" if index == "{}" else index)] = (int(start), int(end))
    return sequence, ranges


def _peak(heap_bytes, values, schedule, op_names):
    sequence, ranges = schedule
    buffers = []
    for name, (offset, size, shape) in values.items():
        span = ranges.get(name) or ranges.get(name.split("{")[0])
        if span is None:
            raise ValueError(f"XLA's live ranges do not place the temporary {name!r}: a dump this reader cannot read.")
        buffers.append((offset, Buffer(name, op_names.get(name.split("{")[0], ""), shape, size, *span)))
    best, best_at = 0, None
    for moment in sorted({b.start for _, b in buffers}):  # the live bytes only grow where a buffer starts
        live = sorted((offset, offset + b.bytes) for offset, b in buffers if b.start <= moment <= b.end)
        covered, reach = 0, 0
        for low, high in live:  # the union of the live intervals of the heap
            covered += max(0, high - max(low, reach))
            reach = max(reach, high)
        if covered > best:
            best, best_at = covered, moment
    if best_at is None:
        return ProgramMemory(heap_bytes, 0, None, [])
    at_peak = sorted((b for _, b in buffers if b.start <= best_at <= b.end), key=lambda b: -b.bytes)
    instruction = sequence[best_at] if best_at < len(sequence) else None
    return ProgramMemory(heap_bytes, best, instruction, at_peak)
