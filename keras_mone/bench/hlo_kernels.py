"""The kernels of an optimised XLA GPU program, read from its text (``compiled.as_text()``).

``program_kernels(hlo_text)`` lists every launch of the entry computation (fusions,
cuBLAS and cuDNN custom calls, copies; command buffers opened) with its kind
(``kernel_profile.KINDS``), the bytes it reads and writes and the FLOPs of its matmuls.
Bytes are traced back from each fusion's root: a slice, a concatenation's operand or an
elementwise op reads only the index box its output needs, a bitcast or transpose as
many elements. ``bench.gpu_program`` compiles the programs this reads.
"""

import collections
import math
import re

from keras_mone.bench.kernel_profile import kind_of

# ---------------------------------------------------------------------------
_FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "opt-barrier", "after-all",
         "partition-id", "replica-id", "copy-done", "add-dependency"}
"""Ops that launch no kernel (layout-only views, tuple plumbing)."""
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")

Kernel = collections.namedtuple("Kernel", "name op kind bytes flops shape")
"""One launch: its name without the numeric suffix (as a profile names it), HLO op, kind
(``kernel_profile.KINDS``), bytes it reads and writes (each operand once, as far as the
output needs it: ``_bytes_read``; a custom call's scratch output not counted), FLOPs of
its matmuls (GEMMs, cuDNN attention and the Pallas MLP kernels' two products; elementwise
work not counted) and output shape
text without layouts."""


def _shape_bytes(shape_text):
    return sum(math.prod(int(d) for d in filter(None, dims.split(","))) * _BYTES.get(dtype, 4)
               for dtype, dims in _ARRAY.findall(shape_text))


def _element_bytes(shape_text):
    match = _ARRAY.search(shape_text)
    return _BYTES.get(match.group(1), 4) if match else 4


def _dims(shape_text):
    match = _ARRAY.search(shape_text)
    return [int(d) for d in filter(None, match.group(2).split(","))] if match else []


def _computations(hlo_text):
    """``{name: [instruction lines]}`` and the entry computation's name."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            computations[current].append(line)
    if entry is None:
        raise ValueError("No ENTRY computation in the HLO text: pass an optimised module's `as_text()`.")
    return computations, entry


def _parsed(lines):
    """``[(name, shape, op, operands, line)]`` of a computation's instructions."""
    parsed = []
    for line in lines:
        match = _INSTRUCTION.match(line)
        if match:
            name, shape, op, rest = match.groups()
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            parsed.append((name, shape, op, operands, line))
    return parsed


def _matmul_flops(output_shape, lhs_shape, contracting):
    """2 x output elements x contracted size; ``contracting``: the text listing the lhs
    dimensions contracted (a dot's ``lhs_contracting_dims``, cuBLAS's backend config)."""
    lhs = _dims(lhs_shape)
    k = math.prod(lhs[d] for d in map(int, re.findall(r"\d+", contracting)) if d < len(lhs))
    return 2 * math.prod(_dims(output_shape)) * k


def _dot_contracting(line):
    match = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    return match.group(1) if match else ""


def _dot_flops(lines):
    """FLOPs of the dots in a fused computation."""
    shapes, flops = {}, 0
    for name, shape, op, operands, line in _parsed(lines):
        shapes[name] = shape
        if op == "dot" and operands:
            flops += _matmul_flops(shape, shapes.get(operands[0], ""), _dot_contracting(line))
    return flops


_ELEMENTWISE = {
    "abs", "add", "and", "ceil", "clamp", "compare", "convert", "copy", "cosine", "divide", "erf", "exponential",
    "exponential-minus-one", "floor", "log", "log-plus-one", "logistic", "maximum", "minimum", "multiply", "negate",
    "not", "or", "power", "round-nearest-even", "rsqrt", "select", "sign", "sine", "sqrt", "subtract", "tanh", "xor",
}
_REARRANGING = {"bitcast", "reshape", "transpose", "copy"}


class _Needs:
    """The parts of each value a fusion's output needs: each part ``("box", [(lo, hi), ...])``
    (an index box) or ``("count", elements)`` (past a reshape, where boxes lose their
    meaning). A value's parts are summed, at most the whole value: two cuts of one tensor
    read both, overlapping cuts may be counted twice up to that cap."""

    def __init__(self, parsed):
        self.dims = {name: _dims(shape) for name, shape, *_ in parsed}
        self.regions = {}

    def whole(self, name):
        return ("box", [(0, d) for d in self.dims.get(name, [])])

    @staticmethod
    def volume(region):
        return region[1] if region[0] == "count" else math.prod(max(hi - lo, 0) for lo, hi in region[1])

    def mark(self, name, region):
        if name not in self.dims:
            return
        parts = self.regions.setdefault(name, [])
        if region[0] == "count" or region not in parts:  # the same box twice is read once
            parts.append(region)

    def elements(self, name):
        """Elements of ``name`` its users need (at most all of it)."""
        return min(self.volume(self.whole(name)), sum(self.volume(r) for r in self.regions.get(name, [])))


def _bytes_read(lines, operand_bytes):
    """Bytes a fusion reads of each operand: what its output needs, traced back from the
    root through slices and gathers (a token group's rows, a weight's columns), concatenations (each
    operand's own part) and elementwise ops as index boxes, through bitcasts, reshapes
    and transposes as element counts; any other use reads its operand whole."""
    parsed = _parsed(lines)
    needs = _Needs(parsed)
    for name, shape, op, operands, line in reversed(parsed):
        if line.lstrip().startswith("ROOT"):
            for output in (operands if op == "tuple" else [name]):
                needs.mark(output, needs.whole(output))
            if op == "tuple":
                continue
        if op != "parameter":
            for region in needs.regions.get(name, []):
                _pass_back(needs, name, op, operands, line, region)
    read = list(operand_bytes)
    for name, shape, op, _, line in parsed:
        number = re.search(r"parameter\((\d+)\)", line) if op == "parameter" else None
        if number and int(number.group(1)) < len(read):
            index = int(number.group(1))
            read[index] = min(read[index], needs.elements(name) * _element_bytes(shape))
    return read


def _pass_back(needs, name, op, operands, line, region):
    """Marks what ``name``'s operands must supply for its ``region``."""
    if op == "slice" and region[0] == "box" and operands:
        spans = re.findall(r"\[(\d+):(\d+)(?::(\d+))?\]", line.split("slice={", 1)[-1].split("}", 1)[0])
        if len(spans) == len(region[1]) and all(step in ("", "1") for _, _, step in spans):
            shifted = [(int(start) + lo, int(start) + hi) for (start, _, _), (lo, hi) in zip(spans, region[1])]
            needs.mark(operands[0], ("box", shifted))
            return
    if op in ("slice", "dynamic-slice", "gather") and operands:  # reads no more elements than it writes
        needs.mark(operands[0], ("count", needs.volume(region)))
        for index in operands[1:]:  # a dynamic slice's start indices, a gather's indices
            needs.mark(index, needs.whole(index))
    elif op == "concatenate" and region[0] == "box":
        axis, offset = int(re.search(r"dimensions=\{(\d+)\}", line).group(1)), 0
        for operand in operands:
            size = needs.dims[operand][axis]
            lo, hi = max(region[1][axis][0] - offset, 0), min(region[1][axis][1] - offset, size)
            if lo < hi:
                needs.mark(operand, ("box", region[1][:axis] + [(lo, hi)] + region[1][axis + 1:]))
            offset += size
    elif op in _ELEMENTWISE:
        for operand in operands:
            same = needs.dims.get(operand) == needs.dims[name]
            needs.mark(operand, region if same else needs.whole(operand))
    elif op in _REARRANGING and operands:
        needs.mark(operands[0], ("count", needs.volume(region)))
    else:
        for operand in operands:
            needs.mark(operand, needs.whole(operand))


def _cublas_flops(line, shape, operand_shapes):
    """A cuBLAS GEMM (its first output; the second is a workspace)."""
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', line)
    if not contracting or not operand_shapes:
        return 0
    return _matmul_flops(shape, operand_shapes[0], contracting.group(1))


def _attention_flops(operand_shapes):
    """cuDNN fused attention: q k^T and the weighted sum of v, 2 x 2 x B H Nq Nk d."""
    if len(operand_shapes) < 3:
        return 0
    q, k = _dims(operand_shapes[0]), _dims(operand_shapes[1])
    if len(q) != 4 or len(k) != 4:
        return 0
    batch, queries, heads, head_dim = q  # (B, N, H, d), the layout jax passes
    return 4 * batch * heads * queries * k[1] * head_dim


def _pallas_traffic(label, shape, operand_shapes):
    """``(FLOPs, bytes)`` of a ``keras_mone.kernels`` Pallas kernel, from its name
    (``kernels.grouped_labels``' ``kernel_label`` and ``weight_gradient_label``
    and ``kernels.flash_attention.kernel_label``: all they need; ``kernels.tiles.kernel_name``: with its output's (padded) rows): its
    products and what it reads and writes (``kernel_bytes``: weight slices, not whole
    weights); ``None`` for another custom call."""
    from keras_mone.kernels import flash_attention, grouped_labels
    from keras_mone.kernels.tiles import kernel_bytes, kernel_flops

    itemsize = _element_bytes(shape)  # the rows' dtype: each kernel writes it, but dW's float32 partial sums
    inputs = _element_bytes(operand_shapes[0]) if operand_shapes and operand_shapes[0] else itemsize
    for labelled_cost, size in ((grouped_labels.labelled_cost, itemsize), (grouped_labels.weight_gradient_cost, inputs),
                                (flash_attention.labelled_cost, itemsize)):
        cost = labelled_cost(label, size)
        if cost is not None:
            return cost
    dims = _dims(shape)
    if len(dims) != 2 or kernel_flops(label, dims[0]) is None:
        return None
    full = _dims(operand_shapes[0])[-1] if operand_shapes else dims[1]
    return kernel_flops(label, dims[0]), kernel_bytes(label, dims[0], full, _element_bytes(shape))


def program_kernels(hlo_text):
    """``[Kernel]`` of an optimised GPU program (``compiled.as_text()``), in launch order:
    every instruction of the entry computation that runs on the device (fusions, custom
    calls such as cuBLAS and cuDNN, copies); ``call``s (command buffers) are opened."""
    computations, entry = _computations(hlo_text)
    kernels = []

    def visit(computation):
        shapes = {}
        for name, shape, op, operands, line in _parsed(computations[computation]):
            shapes[name] = shape
            if op in _FREE:
                continue
            called = re.search(r"(?:calls|to_apply)=%([\w.\-]+)", line)
            if op == "call" and called and called.group(1) in computations:
                visit(called.group(1))
                continue
            label = re.sub(r"\.\d+$", "", name)
            target = re.search(r'custom_call_target="([^"]+)"', line)
            if op == "custom-call" and target:
                label = target.group(1)
                kernel = re.search(r'\bname = "([^"]+)"', line)  # a Pallas kernel's own name (Triton's)
                label = kernel.group(1) if "triton" in label and kernel else label
            operand_shapes = [shapes.get(o, "") for o in operands]
            read = [_shape_bytes(s) for s in operand_shapes]
            flops = 0
            if op == "fusion" and called and called.group(1) in computations:
                read = _bytes_read(computations[called.group(1)], read)
                flops = _dot_flops(computations[called.group(1)])
            elif op == "custom-call" and "fmha" in label.lower():
                # the backward kernel recomputes q k^T and makes dQ, dK, dV, dP: 5 products, not 2
                flops = _attention_flops(operand_shapes) * (2.5 if "backward" in label.lower() else 1)
            elif op == "custom-call" and "cublas" in label.lower():
                flops = _cublas_flops(line, shape, operand_shapes)
            elif op == "dot":
                flops = _matmul_flops(shape, operand_shapes[0], _dot_contracting(line))
            elif op == "custom-call" and (pallas := _pallas_traffic(label, shape, operand_shapes)):
                flops, moved = pallas
                kernels.append(Kernel(label, op, _kind(label, op), moved, flops, re.sub(r"\{[^}]*\}", "", shape)))
                continue
            written = _shape_bytes(shape)
            if op == "custom-call" and shape.startswith("("):  # cuBLAS and cuDNN: (result, scratch workspace)
                written = _shape_bytes(_ARRAY.search(shape).group(0))
            kernels.append(Kernel(label, op, _kind(label, op), written + sum(read), flops,
                                  re.sub(r"\{[^}]*\}", "", shape)))

    visit(entry)
    return kernels


def _kind(label, op):
    text = label.lower()
    if "fmha" in text:
        return "attention"
    if "cudnn" in text and "conv" in text:
        return "convolution"
    return kind_of(label, op)


def kernel_counts(kernels, top=None):
    """``[(name, kind, launches, bytes)]`` by kernel name, most launched first."""
    launches, moved, kinds = collections.Counter(), collections.Counter(), {}
    for kernel in kernels:
        launches[kernel.name] += 1
        moved[kernel.name] += kernel.bytes
        kinds[kernel.name] = kernel.kind
    return [(name, kinds[name], count, moved[name]) for name, count in launches.most_common(top)]
