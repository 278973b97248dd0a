"""Which form of an operation a layer takes on this platform (CPU, GPU, TPU).

The zoo's forms were first measured on CPUs (BENCHMARKS.md); on a GPU other
forms pay (issue 40: an H200's profiles in BENCHMARKS.md). Each switch below is
an environment variable, read when a call is traced, so every form can be timed
against the others in one process (``bench/gpu_forms.py``); the forms of a
switch are equal within float rounding (``tests/test_platform_forms.py``,
``tests/test_layer_norm.py``; one-pass LayerNorm statistics lose precision on token
rows far from zero: ``layers.layer_norm``). Unset, each takes the form measured fastest
on the platform, or, where no card has timed a switch's forms yet (``statistics_form``),
the one whose compiled programs move the fewest bytes:

* ``$KERAS_MONE_ATTENTION`` (``attention_form``): the library's fused kernel, explicit
  matmuls, or a Pallas flash attention (jax; opt-in);
* ``$KERAS_MONE_GELU`` (``gelu_form``): ``jax.nn.gelu`` or one rational pass;
* ``$KERAS_MONE_PATCHES`` (``patches_form``): strided convolution or one matmul;
* ``$KERAS_MONE_ORDER`` (``order_form``): jax's weight-slice ties on or off;
* ``$KERAS_MONE_NORMS`` (``norms_form``): a block's LayerNorms per token group or over all;
* ``$KERAS_MONE_STATISTICS`` (``statistics_form``): how jax writes a block's LayerNorm
  statistics (Keras' form, one pass, the two passes XLA fuses on a GPU, or a Pallas kernel);
* ``$KERAS_MONE_LAYOUT`` (``layout_form``): a block's token groups as tensors of their own
  or packed into one token-major tensor (``layers.packed_block``);
* ``$KERAS_MONE_RESIDUALS`` (``residuals_form``): how often jax on a GPU writes the token
  groups' residual streams (never apart, once per block, or after each half block);
* ``$KERAS_MONE_MLP`` (``mlp_form``): XLA's MLP, or a Pallas kernel per nested group's MLP
  half or MLP (opt-in);
* ``$KERAS_MONE_PROJECTIONS`` (``projections_form``): a block's nested projections as one
  GEMM per token group, or one kernel over all groups (opt-in; Pallas on jax, Triton on torch),
  also in full-width blocks (``grouped_kernel_all``: a dense ViT in MoNE's fused form).

``compiling_for("gpu")`` makes a trace take another platform's forms, for a program
compiled here for a device this machine lacks (``bench.gpu_program``).
"""

import contextlib
import functools
import os
import warnings

import keras

ATTENTION_ENV = "KERAS_MONE_ATTENTION"
ATTENTION_FORMS = ("fused", "explicit", "flash")
MLP_ENV = "KERAS_MONE_MLP"
MLP_FORMS = ("plain", "fused", "mlp_kernel")
ORDER_ENV = "KERAS_MONE_ORDER"
ORDER_FORMS = ("tied", "free")
GELU_ENV = "KERAS_MONE_GELU"
GELU_FORMS = ("library", "rational")
PATCHES_ENV = "KERAS_MONE_PATCHES"
PATCHES_FORMS = ("conv", "matmul")
NORMS_ENV = "KERAS_MONE_NORMS"
NORMS_FORMS = ("grouped", "joint")
STATISTICS_ENV = "KERAS_MONE_STATISTICS"
STATISTICS_FORMS = ("keras", "one_pass", "fused", "kernel")
LAYOUT_ENV = "KERAS_MONE_LAYOUT"
LAYOUT_FORMS = ("grouped", "packed")
RESIDUALS_ENV = "KERAS_MONE_RESIDUALS"
RESIDUALS_FORMS = ("fused", "block", "half_block")
PROJECTIONS_ENV = "KERAS_MONE_PROJECTIONS"
PROJECTIONS_FORMS = ("per_group", "grouped_kernel", "grouped_kernel_all")


_TARGET = []
"""The platforms ``compiling_for`` set, innermost last (one per process: tracing is not
threaded here)."""


def accelerator(backend=None):
    """``"gpu"``, ``"tpu"`` or ``"cpu"``: where ``backend`` (default: Keras') places new
    tensors, or the platform of an enclosing ``compiling_for``."""
    return _TARGET[-1] if _TARGET else _detected_accelerator(backend or keras.backend.backend())


@contextlib.contextmanager
def compiling_for(platform):
    """Traces inside take ``platform``'s forms (``"gpu"``, ``"tpu"`` or ``"cpu"``), whatever
    this machine has: for a program lowered and compiled here for another device
    (``bench.gpu_program`` compiles for an H100 or H200 without one)."""
    if platform not in ("gpu", "tpu", "cpu"):
        raise ValueError(f"`platform` must be one of ['gpu', 'tpu', 'cpu'], got {platform!r}.")
    _TARGET.append(platform)
    try:
        yield
    finally:
        _TARGET.pop()


@functools.lru_cache(maxsize=None)
def _detected_accelerator(backend):
    if backend == "jax":
        import jax

        platform = jax.default_backend()
        return platform if platform in ("tpu", "cpu") else "gpu"
    if backend == "tensorflow":
        import tensorflow as tf

        for kind in ("TPU", "GPU"):
            if tf.config.list_logical_devices(kind):
                return kind.lower()
        return "cpu"
    if backend == "torch":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return "cpu"


def attention_form():
    """``"fused"`` (``keras.ops.dot_product_attention``; on jax's GPU cuDNN's flash
    attention for bf16, BENCHMARKS.md), ``"explicit"`` (batched matmuls around the
    softmax) or ``"flash"`` (``kernels.flash_attention``, jax only: one Pallas kernel that
    never writes the scores, in any float dtype; cuDNN takes no float32, where XLA's attention
    writes and rereads the ``(B, H, N, N)`` scores. Compiled for an H200 without one, with the
    grouped projection kernels, it lifts MoNE-ViViT-FE-B/16's float32 (TF32) roofline bound
    at batch 1 from 1.67x to 2.43x dense: BENCHMARKS.md, "Flash attention in float32". Compiled on a
    GPU, interpreted elsewhere: exact and slow, for tests; heads whose size is not a power of
    2 take ``keras.ops.dot_product_attention``). ``$KERAS_MONE_ATTENTION`` when set, else
    fused on torch and on accelerators, explicit on jax's and tensorflow's CPU: flash is not
    timed on a card."""
    fused = keras.backend.backend() == "torch" or accelerator() != "cpu"
    chosen = _env_form(ATTENTION_ENV, ATTENTION_FORMS, "fused" if fused else "explicit")
    if chosen == "flash" and keras.backend.backend() != "jax":
        raise ValueError(f"${ATTENTION_ENV}='flash' is a Pallas kernel (jax); the {keras.backend.backend()} "
                         "backend takes 'fused' or 'explicit' (or leave it unset).")
    if chosen == "flash" and accelerator() == "tpu":
        raise ValueError(f"${ATTENTION_ENV}='flash' is written for GPUs (Pallas' Triton lowering); on a TPU "
                         "take 'fused' or leave it unset.")
    return chosen


def mlp_form():
    """A nested token group's MLP: ``"plain"`` (XLA's GEMMs, the hidden activations in
    device memory), ``"fused"`` (a ``ViTBlock``'s whole MLP half, LayerNorm and residual
    included, as one Pallas kernel, ``kernels.fused_residual_mlp``; a ``NestedMLP`` called
    on its own takes ``kernels.fused_nested_mlp``) or ``"mlp_kernel"`` (the MLP alone as
    ``kernels.fused_nested_mlp`` everywhere: XLA applies the LayerNorm and adds the
    residual). On torch both name the Triton kernel ``kernels.triton_nested_mlp`` (the MLP
    alone), which eager torch's packed blocks run (``layers.packed_block``; under
    ``torch.compile`` the plain path runs); it needs Triton. Tensorflow takes "plain" only.
    ``$KERAS_MONE_MLP`` when set, else plain. The kernels are compiled on a GPU and interpreted elsewhere
    (exact, slow: for tests). They stay opt-in: on an H200 (BENCHMARKS.md, "MoNE on an H200,
    measured again") the block kernel at its screened tiles made MoNE-ViT-B/16's bf16 forward
    2% faster, and the Triton kernel was slower than torch's ops at every width. A width where
    a kernel does not pay by default (``kernels.tiles.kernel_pays``: the block kernel at
    ViT-B/16's d = 384, where XLA's path beat every tile) keeps the plain path unless
    ``$KERAS_MONE_MLP_TILES`` names its tiles; ``width:plain`` there keeps it for any width.
    A forward form: the kernels' backward passes recompute the plain path, which
    puts the training step's roofline bound under the plain program's (BENCHMARKS.md, "The
    fused kernels' products counted")."""
    return _kernel_form(MLP_ENV, _env_form(MLP_ENV, MLP_FORMS, "plain"), "plain", "mlp")


def projections_form():
    """``"per_group"``, ``"grouped_kernel"`` or ``"grouped_kernel_all"``: a ``ViTBlock``'s nested
    projections (q/k/v, the attention's out-projection, fc1, fc2) as one GEMM per token group, or
    each as one kernel launch over all the block's groups, with fc1's bias and GELU, the residual
    adds and MoNE's gate in the epilogues and the LayerNorms in the prologues: a Pallas kernel on
    jax (``kernels.grouped_projection``, ``layers.grouped_block``), a Triton kernel in torch's
    packed blocks (``kernels.triton_grouped_projection``, ``layers.packed_kernels``; it needs
    Triton). ``grouped_kernel_all`` also runs the blocks whose tokens are all at full width (a
    dense ViT's) through them (``kernel_covers``): dense in MoNE's fused form. Per group, an H200
    launched 1039 kernels per MoNE-ViT-B/16 forward against dense's 350; compiled for an H200
    without one, the kernels' bf16 forward at batch 256 has 104, bound 3.80x dense (BENCHMARKS.md);
    torch's forward issues 198-211 ops and launches per image (per group 424). Compiled on a GPU,
    interpreted elsewhere (exact and slow: for tests). jax's training calls take the kernels and
    backward kernels (``kernels.grouped_gradients``); torch's recompute the per-group path. Not
    timed on a card: ``$KERAS_MONE_PROJECTIONS`` when set, else per_group."""
    return _kernel_form(PROJECTIONS_ENV, _env_form(PROJECTIONS_ENV, PROJECTIONS_FORMS, "per_group"), "per_group",
                        "projections")


def kernel_covers(widths, hidden_dim):
    """Whether a block whose groups run at ``widths`` (of ``hidden_dim``) takes the grouped kernels: any
    under ``grouped_kernel_all``, one with a nested group under ``grouped_kernel``, none per group."""
    form, nested = projections_form(), any(width != hidden_dim for width in widths)
    return form == "grouped_kernel_all" or (form == "grouped_kernel" and nested)


def order_form():
    """``"tied"`` or ``"free"``: whether jax ties each nested weight slice and each token
    group's MLP to the tensor they follow (``layers.nested_dense.after``). The ties keep
    XLA's CPU scheduler from cutting every block's slices at the start and holding them
    (issue 27: 315 MiB of temporaries for MoNE-ViT-B/16 against 46 MiB). XLA's GPU
    pipeline folds the ties' exact zeros away (compiled for an H200, tied and free gave
    one program), so on a GPU "tied" now means the routed token groups are written once
    (``nested_dense.materialized``: an optimization barrier, which XLA keeps).
    ``$KERAS_MONE_ORDER`` when set, else tied (the measured CPU form)."""
    return _env_form(ORDER_ENV, ORDER_FORMS, "tied")


def gelu_form():
    """``"library"`` or ``"rational"``: the exact GELU of a dense MLP at inference on jax,
    ``jax.nn.gelu`` (its erfc form: both branches computed for every element, which XLA's
    CPU fuses into the matmul before it) or ``0.5 x (1 + erf(x / sqrt 2))`` with erf as
    a rational polynomial (``layers.activations.rational_erf``: one cheap elementwise
    pass). ``$KERAS_MONE_GELU`` when set, else rational on jax's GPU (an H200, bf16,
    ViT-B/16 at batch 256: dense forward 26.3 -> 21.9 ms with ``patches_form``'s
    matmul, MoNE e_c 0.3 19.7 -> 18.0; BENCHMARKS.md) and library elsewhere (the
    measured CPU form). Nested MoNE groups and training steps take their own forms
    (``layers.activations.gelu``)."""
    return _env_form(GELU_ENV, GELU_FORMS, "rational" if _jax_gpu() else "library")


def patches_form(training=False):
    """``"conv"`` or ``"matmul"``: a patch (or tubelet) embedding as Keras' strided
    convolution, or as one matmul over the image cut into patches (the same sum:
    ``layers.patch_embedding.strided_projection``). ``$KERAS_MONE_PATCHES`` when set,
    else matmul in jax's GPU inference (cuDNN's strided convolution took 1.5 ms of a
    ViT-B/16 forward at batch 256 on an H200, the matmul 0.12 with its transpose;
    BENCHMARKS.md) and conv elsewhere: in training (``training=True``; with the matmul,
    XLA lays the dense ViT-B/16's token stream out batch-minor through the whole training
    step compiled for an H200, 150 more transposes and 78.2 GB moved against 59.2, which
    the card's dense step time followed: BENCHMARKS.md, "The dense training step's
    transposes"), on the CPU (the measured form) and on torch's and tensorflow's GPUs (not
    measured)."""
    return _env_form(PATCHES_ENV, PATCHES_FORMS, "matmul" if _jax_gpu() and not training else "conv")


def norms_form():
    """``"grouped"`` or ``"joint"``: the generic block path (``layers.block.ViTBlock``) runs
    each LayerNorm once per token group, or once over all groups joined along the tokens,
    then cut again (the same per-token statistics). On an H200 a MoNE-ViT-B/16 forward
    ran 153 LayerNorm reductions against dense's 27 (1.4 against 0.7 ms at batch 256,
    BENCHMARKS.md); joined, XLA makes 62, but compiled for an H200 the program moves 9%
    more bytes (each join is a copy; ``bench/gpu_program.py``). Not timed on a GPU:
    ``$KERAS_MONE_NORMS`` when set, else grouped (the measured form everywhere). Packed
    blocks (``layout_form``) run one LayerNorm over all groups anyway."""
    return _env_form(NORMS_ENV, NORMS_FORMS, "grouped")


def statistics_form():
    """``"keras"``, ``"one_pass"`` or ``"fused"``: how a ``ViTBlock``'s LayerNorms compute
    their statistics on jax (``layers.layer_norm.normalize``; other backends always run
    Keras' ``LayerNormalization``). "keras": Keras' ``ops.layer_normalization``, two
    reductions and an rsqrt pass per LayerNorm and token group, the normalisation fused into
    its consumers. "one_pass": the mean and the mean square in one reduction (flax's
    ``LayerNorm`` default, ``use_fast_variance``), the normalisation still fused into its
    consumers. "fused": the two-pass statistics written ``(x - mean) * rsqrt(var + eps)``,
    which XLA's GPU compiler makes one Triton kernel per LayerNorm that also writes the
    normalised tokens. "kernel" (opt-in, GPUs; interpreted elsewhere, for tests): mean and
    rstd by one Pallas kernel per LayerNorm (``kernels.row_statistics``, two-pass numerics
    from one read), where the other forms give the grouped projection kernels' prologues a
    reduction and an rsqrt pass (BENCHMARKS.md, "Row statistics in one kernel"). Compiled for
    an H200 (BENCHMARKS.md, "LayerNorm statistics in the GPU programs"), keras / one_pass /
    fused: MoNE-ViT-B/16's bf16 forward at batch 256 893 / 797 / 653 kernels, 40.89 / 38.83 /
    39.81 GB, roofline 9.19 / 8.76 / 8.97 ms (dense 240 / 215 / 155 kernels, 43.56 / 43.48 /
    40.75 GB, heap 514.5 / 514.5 / 588.0 MiB); its training step at batch 128 68.01 / 62.96 /
    71.27 GB, heap 7316 / 6983 / 8001 MiB (dense 59.21 / 57.50 / 63.11 GB).

    One pass is the only form that moves fewer bytes in every program, for both models. With
    the grouped projection kernels (``projections_form``) its statistics are the out-projections'
    row sums of what they write (``kernels.row_sums``): no reduction runs between the kernels in
    inference. Torch's grouped kernels (``layers.packed_kernels``) take a LayerNorm's statistics
    at inference from the out-projection before (per-tile partials, two-pass numerics) in every
    form but "kernel": there one Triton kernel per LayerNorm. Not
    timed on a card: ``$KERAS_MONE_STATISTICS`` when set, else one_pass on jax's GPU and keras
    elsewhere (the CPU's measured form)."""
    chosen = _env_form(STATISTICS_ENV, STATISTICS_FORMS, "one_pass" if _jax_gpu() else "keras")
    if chosen == "kernel" and accelerator() == "tpu":
        raise ValueError(f"${STATISTICS_ENV}='kernel' is written for GPUs (Pallas' Triton lowering); on a TPU "
                         "take another form or leave it unset.")
    return chosen


def layout_form():
    """``"grouped"`` or ``"packed"``: whether ``ViTBlock`` runs its token groups as
    ``(batch, k_j, D)`` tensors of their own or packed into one token-major tensor, each
    group a contiguous run of rows (``layers.packed_block``; blocks it can take).
    ``$KERAS_MONE_LAYOUT`` when set, else packed on torch (eager torch pays per op:
    issue 40) and grouped on jax (packed is opt-in: MoNE-ViT-B/16's forward has 30% fewer
    kernels but moves 12% more bytes, and an H200 ran it in 21.07 ms against grouped's 18.60
    at batch 256 in bf16, BENCHMARKS.md) and tensorflow (which has no packed path)."""
    backend = keras.backend.backend()
    chosen = _env_form(LAYOUT_ENV, LAYOUT_FORMS, "packed" if backend == "torch" else "grouped")
    if chosen == "packed" and backend == "tensorflow":
        raise ValueError(f"${LAYOUT_ENV}='packed' runs on jax and torch; the tensorflow backend takes 'grouped' "
                         "(or leave it unset).")
    return chosen


def residuals_form():
    """``"fused"``, ``"block"`` or ``"half_block"``: where jax compiling for a GPU writes a
    block's token groups' residual streams (``layers.nested_dense.materialized``). "fused":
    never apart (XLA adds a block's updates to its input inside each consumer); "block":
    once, at the block's end; "half_block": also after its attention. Compiled for an H200,
    MoNE-ViT-B/16's forward at batch 256 keeps an XLA heap of 670.8 / 567.3 / 514.8 MiB
    (dense: 514.5) for 847 / 893 / 941 kernels and a roofline bound of 1.62x / 1.58x / 1.54x
    (BENCHMARKS.md). Only the default is timed on a card (an H200: 18.60 ms against dense's
    22.17, "MoNE on an H200, measured again"); it trades an estimated 2.5%
    of the bound for 15% of the heap. Every form gives the same values; nothing is written
    apart on the CPU, on torch and tensorflow, or under ``$KERAS_MONE_ORDER=free``.
    ``$KERAS_MONE_RESIDUALS`` when set, else block."""
    return _env_form(RESIDUALS_ENV, RESIDUALS_FORMS, "block")


def _jax_gpu():
    return keras.backend.backend() == "jax" and accelerator() == "gpu"


VARIABLES = (ATTENTION_ENV, MLP_ENV, GELU_ENV, PATCHES_ENV, ORDER_ENV, NORMS_ENV, STATISTICS_ENV, LAYOUT_ENV,
             RESIDUALS_ENV, PROJECTIONS_ENV)
"""Every switch above, in the order ``current_forms`` lists them."""


def current_forms():
    """``{"attention_form": ..., "mlp_form": ..., "gelu_form": ..., "patches_form": ...,
    "training_patches_form": ..., "order_form": ..., "norms_form": ..., "statistics_form": ...,
    "layout_form": ..., "residuals_form": ..., "projections_form": ...}``: the forms a call traced now takes (what bench reports record);
    the patch embedding's form differs between inference and training steps (``patches_form``)."""
    return {"attention_form": attention_form(), "mlp_form": mlp_form(), "gelu_form": gelu_form(),
            "patches_form": patches_form(), "training_patches_form": patches_form(training=True),
            "order_form": order_form(), "norms_form": norms_form(), "statistics_form": statistics_form(),
            "layout_form": layout_form(), "residuals_form": residuals_form(),
            "projections_form": projections_form()}


def _kernel_form(variable, chosen, plain, kernel):
    """``chosen``, the form of ``$variable``, where it may run: a kernel form (any but ``plain``)
    is a Pallas kernel on jax or a Triton kernel on torch (``kernel``: "mlp" or "projections",
    which needs Triton), lowered for GPUs. Raises ValueError elsewhere."""
    backend = keras.backend.backend()
    if chosen == plain:
        return chosen
    if backend not in ("jax", "torch"):
        raise ValueError(f"${variable}={chosen!r} is a Pallas kernel (jax) or a Triton kernel (torch); the "
                         f"{backend} backend takes {plain!r} (or leave it unset).")
    if backend == "torch":  # (plain imports, which dynamo traces: importlib it does not)
        if kernel == "mlp":
            from keras_mone.kernels.triton_nested_mlp import available
        else:
            from keras_mone.kernels.triton_grouped_projection import available
    if backend == "torch" and not available():
        raise ValueError(f"${variable}={chosen!r} on torch is a Triton kernel and needs Triton "
                         "(`pip install triton`; torch's CUDA wheels bring it), or leave it unset.")
    if accelerator() == "tpu":
        raise ValueError(f"${variable}={chosen!r} is written for GPUs (Pallas' Triton lowering); "
                         "on a TPU leave it unset.")
    return chosen


def _env_form(variable, forms, default):
    chosen = os.environ.get(variable, "") or default
    if chosen not in forms:
        raise ValueError(f"${variable} must be one of {list(forms)} or unset, got {chosen!r}.")
    return chosen


def fused_attention(query, key, value, heads_first=False):
    """Softmax attention by a fused kernel: ``(B, N, H, d)`` tensors (``heads_first``:
    ``(B, H, N, d)``) in, the same layout out. Under ``attention_form()`` "flash",
    ``kernels.flash_attention`` where the head size fits it; else the backend's.

    torch calls ``scaled_dot_product_attention`` itself: ``keras.ops.dot_product_attention``
    first builds torch's ``SDPAParams`` to check for flash attention, a C++
    object that ``torch.compile`` cannot trace, so every attention call broke
    the compiled graph (``tests/test_platform_forms.py``); SDPA picks flash
    attention by itself where it applies. Elsewhere ``keras.ops.dot_product_attention``."""
    if keras.backend.backend() == "torch":
        import torch

        query, key, value = (
            x if isinstance(x, torch.Tensor) else keras.ops.convert_to_tensor(x) for x in (query, key, value)
        )
        if not heads_first:
            query, key, value = (x.transpose(1, 2) for x in (query, key, value))
        attended = torch.nn.functional.scaled_dot_product_attention(query, key, value)
        return attended if heads_first else attended.transpose(1, 2)
    if heads_first:
        query, key, value = (keras.ops.transpose(x, (0, 2, 1, 3)) for x in (query, key, value))
        return keras.ops.transpose(fused_attention(query, key, value), (0, 2, 1, 3))
    if attention_form() == "flash":
        from keras_mone.kernels import flash_attention

        if flash_attention.shape_fits(query.shape[-1]):
            return flash_attention.flash_attention(query, key, value, interpret=accelerator() != "gpu")
    if _compiling_for_a_gpu_elsewhere() and str(query.dtype) in ("bfloat16", "float16"):
        return _cudnn_attention(query, key, value)
    return keras.ops.dot_product_attention(query, key, value)


def _compiling_for_a_gpu_elsewhere():
    """Whether a jax trace is for a GPU (``compiling_for``) that this machine lacks."""
    return bool(_TARGET) and _TARGET[-1] == "gpu" and _jax_gpu() and _detected_accelerator("jax") != "gpu"


def _cudnn_attention(query, key, value):
    """What Keras runs for half-precision attention on an Ampere or later GPU: cuDNN's
    flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``), else
    XLA's. Keras asks the attached device which to take; a program compiled here for
    a GPU this machine lacks gets the card's choice from the inputs instead."""
    import jax

    try:
        return jax.nn.dot_product_attention(query, key, value, implementation="cudnn")
    except Exception as error:  # what cuDNN does not take: Keras falls back to XLA's form too
        warnings.warn(f"Compiling for a GPU: cuDNN attention does not take these inputs "
                      f"({type(error).__name__}: {str(error)[:200]}); XLA's attention instead.", stacklevel=2)
        return jax.nn.dot_product_attention(query, key, value, implementation="xla")
