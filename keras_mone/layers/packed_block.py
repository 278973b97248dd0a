"""``ViTBlock`` with its token groups packed into one token-major row tensor (torch; jax opt-in).

Eager torch pays on the host for every op (Keras' dispatch, then a kernel launch), and a
MoNE block that runs each token group through its own LayerNorms, projection layers, GELU,
gate and residuals issues several times the ops and layer calls of a dense block: the GPU
waits on the host (issue 40). Here a block's groups sit in one ``(tokens * batch, D)``
tensor in token-major order (row ``n * batch + b``), so every group is a contiguous run of
rows: LayerNorms, gate and residuals run once over all groups, the nested projections are
one matmul per group at its width (row slices, no copies), and Q, K, V come out of one
concatenation, heads first, ready for torch's SDPA. Every projection's bias is added inside
its GEMM (``addmm``). Without autograd (or autocast) the out-projections write their
columns of one zeroed buffer and, where the GELU runs once over all groups, the MLP's
in-projections their rows of one buffer (``out=``): padding and concatenating them held a
second copy.
Off the CPU the GELU runs once over all groups; on the CPU per group, in cache
(``fuse_groups``); with ``$KERAS_MONE_MLP=fused`` a nested group's whole MLP is one Triton
kernel (``kernels.triton_nested_mlp``); with ``$KERAS_MONE_PROJECTIONS=grouped_kernel`` each
nested projection is one Triton launch over all groups, LayerNorms, GELU, gate and residuals
inside (``layers.packed_kernels``). Sub-layers are read, not called; on eager torch the
LayerNorms run as torch ops (``torch_eager.direct_layer_norm``) and ``ViTBlock.direct_call`` runs the block
itself without Keras' ``Layer.__call__``, so a forward calls no Keras layer per block.

Each token sees the operations of the generic path (``ViTBlock.call``) in the same order,
so outputs agree to float32 rounding. Used (``packable``) when the block has its default
parts, a gate of ``None`` or "mone", no active dropout and no request for received
attention, on torch and on jax with ``$KERAS_MONE_LAYOUT=packed``
(``platform_forms.layout_form``); everything else takes the generic path.

On jax the point is XLA's GPU program: a group's rows are one contiguous range, which XLA
reads inside a GEMM, where batch-major groups are strided and each cut is a copy kernel;
and one LayerNorm, one residual add per block instead of one per group (an H200's program:
BENCHMARKS.md). There attention and LayerNorm statistics are in the platform's forms;
torch gets q, k and v heads first for SDPA. jax packs only blocks of several groups, not
with the Pallas MLP kernels, and without the weight-slice ties (``order_form``): a GPU form.

Layout work (reshapes, transposes, slices, concatenations, products) uses torch's tensor
methods: Keras' dispatch of each costs more host time than the op itself (host time of a
MoNE forward -28% against ``keras.ops``, tiny deep model).
"""

import keras
from keras import ops

from keras_mone.layers.activations import gelu
from keras_mone.layers.attention import MoNEAttention, multi_head_attention
from keras_mone.layers.mlp import NestedMLP
from keras_mone.layers.nested_dense import pad_features
from keras_mone.layers.packed_kernels import kernel_halves, kernels_apply
from keras_mone.layers.platform_forms import accelerator, fused_attention, layout_form, mlp_form
from keras_mone.layers.torch_eager import direct_cast, direct_layer_norm, eager, eager_without_grad, torch_hooks
from keras_mone.routing.token_major import cut_groups, tagged_whole


def packable(block, groups, gates, training=None, return_received_attention=False):
    """Whether ``block`` may run ``groups`` packed (see the module docstring)."""
    if return_received_attention or layout_form() != "packed":
        return False
    if not _torch() and (len(groups) < 2 or mlp_form() != "plain"):
        # jax: one group gains nothing from the token-major transposes; the Pallas MLP
        # kernels (KERAS_MONE_MLP=fused or mlp_kernel) belong to the grouped path
        return False
    if type(block.attention) is not MoNEAttention or type(block.mlp) is not NestedMLP:
        return False
    if block.gate not in (None, "mone") or any(g.shape[1] == 0 for g in groups):
        return False
    if _torch() and groups[0].device.type == "meta":  # Keras' shape inference on torch: the generic path
        return False
    attention, mlp = block.attention, block.mlp
    parts = (attention, attention.qkv, attention.out, attention.dropout, mlp, mlp.fc1, mlp.fc2, mlp.dropout)
    if _torch() and torch_hooks(*parts, block.drop_path):  # the generic path calls them as layers
        return False
    rates = (attention.dropout.rate, mlp.dropout.rate, block.drop_path.rate)
    if training and any(rates):
        return False
    return gates is None or len({g is None for g in gates}) == 1


def packed_block(block, groups, widths, gates, training=None, gate_forms=None):
    """``block``'s outputs for token ``groups`` (``(batch, k_j, D)`` each) at
    ``widths``, gated by ``gates``: ``(batch, k_j, D)`` views of one tensor. ``gate_forms``:
    where the gates' token-major rows are kept for the next blocks (``shared_gate_form``)."""
    sizes = [g.shape[1] for g in groups]
    spans = _row_spans(sizes, ops.shape(groups[0])[0])
    rows = token_major(groups)
    gate_rows = None
    if gates is not None and gates[0] is not None:
        gate_rows = shared_gate_form(gate_forms, ("rows", gates[0].dtype), lambda: token_major(gates).reshape(-1),
                                     gates)
    if kernels_apply(block, rows, widths):  # torch: one Triton launch per nested projection
        outputs = kernel_halves(block, rows, spans, widths, sum(sizes), gate_rows)
    else:
        z = rows + _attention(block.attention, direct_layer_norm(block.norm1, rows), spans, widths, sizes)
        update = _mlp(block.mlp, direct_layer_norm(block.norm2, z), spans, widths, training)
        outputs = z + (update if gate_rows is None else block._gate.scale_mlp(update, gate_rows, block.alpha))
    outputs = outputs.reshape(sum(sizes), -1, block.hidden_dim)
    if _torch():  # views the next packed block takes back whole (``token_major``)
        return cut_groups(outputs, sizes)
    return [_swap_first_two(outputs[start:stop]) for start, stop in _spans(sizes)]


def shared_gate_form(gate_forms, key, make, source):
    """``gate_forms[key]``, made by ``make()`` from the gates ``source`` the first time (``gate_forms``
    ``None``: made each time). ``gate_forms`` belongs to one routing's gates (``TokenGroups.gate_forms``),
    so every block after it reads the same cast and joined gates; an entry made from other gates
    than ``source`` (not the same object) is made again."""
    if gate_forms is None:
        return make()
    entry = gate_forms.get(key)
    if entry is None or entry[0] is not source:
        entry = gate_forms[key] = (source, make())
    return entry[1]


def token_major(groups):
    """``(batch, k_j, ...)`` groups as one ``(sum k_j * batch, ...)`` tensor, row ``n * batch + b``.

    Groups cut from one token-major tensor (``routing.token_major.cut_groups``: a packed
    block's outputs, the router's token-major gather) are that tensor's rows, reshaped: no
    copy, eager or under ``torch.compile``. Elsewhere one concatenation.
    """
    packed = tagged_whole(groups) if _torch() else None
    if packed is None:
        packed = _stack([_swap_first_two(g) for g in groups])
    return packed.reshape((-1,) + tuple(groups[0].shape[2:]))


def fuse_groups(x):
    """Whether the MLP's GELU runs once over all groups' rows (off the CPU: fewer
    kernel launches) or once per group right after its GEMM (on the CPU,
    where its rows are then still in cache; see ``_mlp``)."""
    return x.device.type != "cpu" if _torch() else accelerator() != "cpu"


def _weights(layer):
    """A dense layer's kernel and bias (``None`` without one) in its compute dtype."""
    bias = None if layer.bias is None else direct_cast(layer.bias, layer.compute_dtype)
    return direct_cast(layer.kernel, layer.compute_dtype), bias


def _attention(attention, normed, spans, widths, sizes):
    """``Pad(out_d(SA(qkv_d(x[:, :d]))))`` on packed rows (``MoNEAttention.call``)."""
    dim, heads = attention.hidden_dim, attention.num_heads
    qkv_layer, out_layer = attention.qkv, attention.out
    kernel, bias = _weights(qkv_layer)
    parts = []
    for (start, stop), width, size in zip(spans, widths, sizes):
        projected = _project(_rows(normed, start, stop, width), kernel[:width], bias)
        # (k, batch, 3, heads, head_dim) -> torch: (3, batch, heads, k, head_dim); jax: (batch, k, 3, heads, head_dim)
        axes = (2, 1, 3, 0, 4) if _torch() else (1, 0, 2, 3, 4)
        parts.append(_permute(projected.reshape(size, -1, 3, heads, dim // heads), axes))
    if _torch():  # SDPA on heads-first (batch, heads, tokens, head_dim) views of one copy
        qkv = _cat(parts, 3)
        attended = fused_attention(qkv[0], qkv[1], qkv[2], heads_first=True).permute(2, 0, 1, 3)
    else:  # the generic path's attention, in the platform's form: (batch, tokens, heads, head_dim)
        attended = _permute(multi_head_attention(parts), (1, 0, 2, 3))
    attended = attended.reshape(-1, dim)  # (tokens, batch, heads, head_dim): token-major rows again
    return _nested_out(out_layer, [_rows(attended, start, stop) for start, stop in spans], widths, dim)


def _mlp(mlp, normed, spans, widths, training):
    """``Pad(fc2_d(gelu(fc1(x[:, :d]))))`` on packed rows (``NestedMLP.call``).

    The bias is added in each group's GEMM (``_project``). Off the CPU the GELU
    runs once over every group's hidden rows; on the CPU once per group, right
    after its GEMM, while its rows are still
    in cache: over all groups at once they read the ``(tokens * batch, 4D)``
    activations from memory again (MoNE-ViT-B/16 forward, batch 8, one core:
    13% slower than the generic per-group path that way, 8% faster this way).
    No group's pre-activations outlive its GELU (``_grouped_products``), so at
    inference a MoNE MLP holds no more hidden activations than a dense one.
    """
    fc1 = mlp.fc1
    kernel, bias = _weights(fc1)
    tiles = _triton_tiles(mlp, normed, kernel, widths)
    if any(t is not None for t in tiles):  # torch: nested groups through the Triton kernel
        from keras_mone.kernels.triton_nested_mlp import grouped_nested_mlp
        fc2_kernel, fc2_bias = _weights(mlp.fc2)
        in_place = eager_without_grad(normed, kernel, bias, fc2_kernel, fc2_bias)
        return grouped_nested_mlp(normed, spans, widths, tiles, kernel, bias, fc2_kernel, fc2_bias,
                                  mlp.gelu_approximate, in_place)
    nested = any(width < mlp.hidden_dim for width in widths)

    def activation(x):
        return _gelu(x, mlp.gelu_approximate, training, nested)

    if fuse_groups(normed):
        packed = activation(_grouped_products(normed, kernel, bias, spans, widths))
        hidden = [_rows(packed, start, stop) for start, stop in spans]
    else:
        hidden = [
            activation(_project(_rows(normed, start, stop, width), kernel[:width], bias))
            for (start, stop), width in zip(spans, widths)
        ]
    return _nested_out(mlp.fc2, hidden, widths, mlp.hidden_dim)


def _triton_tiles(mlp, normed, kernel, widths):
    """Per group, the Triton MLP kernel's tile arguments (``kernels.triton_nested_mlp``), or
    ``None`` for torch's ops: torch with ``$KERAS_MONE_MLP`` set, eager, rows of a 16- or 32-bit
    float in the weights' dtype, no autocast, a nested width the kernel takes and that pays."""
    if not _torch() or mlp_form() == "plain" or not eager() or normed.dtype != kernel.dtype:
        return [None] * len(widths)
    import torch

    from keras_mone.kernels.triton_nested_mlp import kernel_fits, takes_dtype

    if torch.is_autocast_enabled(normed.device.type) or not takes_dtype(normed.dtype):
        return [None] * len(widths)
    interpret, full = normed.device.type != "cuda", mlp.hidden_dim
    return [mlp.kernel_tiles(w, interpret, fits=kernel_fits, kernel="triton") if w < full else None for w in widths]


def _gelu(x, approximate, training, nested):
    """The MLP's GELU (``layers.activations.gelu``); on torch ``F.gelu``, what ``ops.gelu``
    runs there, without Keras' dispatch."""
    if _torch():
        import torch

        return torch.nn.functional.gelu(x, approximate="tanh" if approximate else "none")
    return gelu(x, approximate=approximate, training=bool(training), nested=nested)


def _grouped_products(x, kernel, bias, spans, widths):
    """Each group's rows ``x[start:stop, :d] @ kernel[:d] (+ bias)``, stacked: one tensor.

    Without autograd every group's GEMM writes its rows of one buffer (``out=``,
    contiguous rows): no concatenation, which held the groups' products and
    their copy at once (peak forward memory above dense's, issue 40). With
    autograd (``out=`` records no gradient) the products are concatenated."""
    if len(spans) == 1 or not eager_without_grad(x, kernel, bias):
        return _stack([
            _project(_rows(x, start, stop, width), kernel[:width], bias) for (start, stop), width in zip(spans, widths)
        ])
    packed = x.new_empty((x.shape[0], kernel.shape[1]))
    for (start, stop), width in zip(spans, widths):
        _project(_rows(x, start, stop, width), kernel[:width], bias, out=_rows(packed, start, stop))
    return packed


def _nested_out(layer, inputs, widths, dim):
    """Each group's rows (``inputs``, one tensor per group) through
    ``x @ W[:, :d] + b[:d]``, zero-padded to ``dim``, stacked.

    Without autograd each group's GEMM writes its ``d`` columns of one zeroed
    buffer (``out=``: a strided view, which BLAS takes as it is) instead of
    being padded and concatenated."""
    kernel, bias = _weights(layer)
    biases = [None if bias is None else bias[:width] for width in widths]
    if len(inputs) == 1 or not eager_without_grad(kernel, bias, *inputs):
        return _stack([pad_features(_project(x, kernel[:, :w], b), dim) for x, w, b in zip(inputs, widths, biases)])
    rows = [x.shape[0] for x in inputs]
    outputs = inputs[0].new_zeros((sum(rows), dim))
    for x, width, b, (start, stop) in zip(inputs, widths, biases, _spans(rows)):
        _project(x, kernel[:, :width], b, out=_rows(outputs, start, stop, width))
    return outputs


def _project(x, kernel, bias, out=None):
    """``x @ kernel (+ bias)``, with a bias as one GEMM (torch's ``addmm``: the bias
    is the GEMM's ``C``): one kernel launch instead of a matmul and an add;
    written into ``out`` when given (no autograd). On jax a matmul and an add (XLA fuses)."""
    if not _torch():
        product = ops.matmul(x, kernel)
        return product if bias is None else product + bias
    import torch

    if out is None:
        return x @ kernel if bias is None else torch.addmm(bias, x, kernel)
    return torch.mm(x, kernel, out=out) if bias is None else torch.addmm(bias, x, kernel, out=out)


def _rows(x, start, stop, width=None):
    """``x[start:stop, :width]`` (``x`` itself when that is all of it)."""
    if start == 0 and stop == x.shape[0]:
        return x if width is None or width == x.shape[1] else x[:, :width]
    return x[start:stop] if width is None or width == x.shape[1] else x[start:stop, :width]


def _stack(parts):
    """``parts`` one after the other along the first axis."""
    return parts[0] if len(parts) == 1 else _cat(parts, 0)


def _cat(parts, axis):
    if not _torch():
        return ops.concatenate(parts, axis=axis)
    import torch

    return torch.cat(parts, axis)


def _permute(x, axes):
    """``x`` with its axes in the order ``axes`` (torch's tensor method: no Keras dispatch)."""
    return x.permute(*axes) if _torch() else ops.transpose(x, axes)


def _swap_first_two(x):
    return _permute(x, (1, 0) + tuple(range(2, len(x.shape))))


def _torch():
    return keras.backend.backend() == "torch"


def _spans(sizes):
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    return list(zip([0] + ends[:-1], ends))


def _row_spans(sizes, batch):
    return [(start * batch, stop * batch) for start, stop in _spans(sizes)]
