"""Device side of ``keras-mone bench``: the accelerator's name, the precision policy,
compiled steps on inputs already on the device, peak device memory and the timm peer.

* ``device_info()`` names the accelerator (jax ``device_kind``, torch
  ``get_device_name``, tensorflow's GPU details) or, on the CPU, the processor.
* ``forward_step`` / ``train_step`` time a model on a batch placed on the
  device once (``device_batch``). jax: ``jax.jit`` over ``model.stateless_call``
  (the train step adds the cross-entropy gradient and an AdamW update through
  ``optimizer.stateless_apply``, its state carried from call to call), blocked
  with ``block_until_ready``. torch: the model called eagerly under
  ``torch.no_grad`` (or wrapped in ``torch.compile``) and ``model.train_step``,
  with ``torch.cuda.synchronize()`` on CUDA. tensorflow: ``tf.function`` with
  the model's resolved ``jit_compile``, read back (a few bytes) to wait.
* ``Measured`` wraps a step: its first call compiles and runs it twice,
  recording the second run's peak device memory above the bytes already in use (jax
  ``memory_stats()``, torch ``max_memory_allocated()`` after
  ``reset_peak_memory_stats()``, tensorflow ``get_memory_info``), ``None``
  (reported "n/a") where the device keeps no statistics, e.g. the CPU. jax
  cannot reset its peak mark: a step that stays below an earlier peak only
  gives an upper bound (``exact: False``). On jax the compiled program's own
  temporaries and outputs (XLA ``memory_analysis()``) are recorded as well.
* ``build_timm_peer`` / ``timm_step``: timm's ``vit_base_patch16_224`` (random
  weights, the dense backbone's geometry) under ``torch.inference_mode()``,
  with ``torch.autocast`` for the mixed precisions.
"""

import contextlib
import importlib
import platform

import keras
import numpy as np

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
AUTOCAST = {"mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}
TIMM_MODEL = "vit_base_patch16_224"


# ---------------------------------------------------------------------------
# the device
# ---------------------------------------------------------------------------
def cpu_model():
    """The processor's model name (``/proc/cpuinfo``, else ``platform``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_info(backend=None):
    """``{"name", "platform", "count"}`` of the device the backend computes on."""
    backend = backend or keras.backend.backend()
    name, kind, count = None, "cpu", 1
    if backend == "jax":
        import jax

        devices = jax.devices()
        kind, count = devices[0].platform, len(devices)
        name = None if kind == "cpu" else devices[0].device_kind
    elif backend == "torch":
        import torch

        if torch.cuda.is_available():
            name, kind, count = torch.cuda.get_device_name(), "gpu", torch.cuda.device_count()
    elif backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            details = tf.config.experimental.get_device_details(gpus[0])
            name, kind, count = details.get("device_name", gpus[0].name), "gpu", len(gpus)
    if name is None:
        name = f"CPU: {cpu_model()}"
    return {"name": str(name), "platform": kind, "count": count}


@contextlib.contextmanager
def precision_policy(name):
    """Sets Keras' global dtype policy to ``name`` (None: unchanged); restores it after."""
    previous = keras.mixed_precision.global_policy()
    if name is not None:
        keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def check_precisions(precisions):
    """Validated, de-duplicated list of precision policy names."""
    names = list(dict.fromkeys(str(p).strip() for p in precisions if str(p).strip()))
    unknown = [p for p in names if p not in PRECISIONS]
    if not names or unknown:
        raise ValueError(f"`precisions` must list some of {PRECISIONS}, got {list(precisions)!r}.")
    return names


# ---------------------------------------------------------------------------
# steps on device inputs
# ---------------------------------------------------------------------------
def device_batch(images, labels):
    """``images`` and ``labels`` copied once to the backend's default device."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.device_put(images), jax.device_put(labels)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.identity(images), tf.identity(labels)  # placed on the default device (a GPU if any)
    return keras.ops.convert_to_tensor(images), keras.ops.convert_to_tensor(labels)  # torch: Keras' device


def _torch_sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Step:
    """A call on device inputs: ``prepare()`` compiles where that is separate, ``__call__`` runs,
    waits and returns the logits (forward) or the loss (training step)."""

    executable = None

    def __init__(self, run, prepare=None):
        self.run, self._prepare = run, prepare

    def prepare(self):
        if self._prepare is not None:
            self.executable, self._prepare = self._prepare(), None
        return self

    def __call__(self):
        self.prepare()
        return self.run(self)


def _logits(output):
    return output["logits"] if isinstance(output, dict) else output


def _loss(y, logits):
    logits = keras.ops.cast(logits, "float32")
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def _jax_program(function, arguments, carried=0, donate=()):
    """A ``_Step`` running ``jax.jit(function)`` compiled ahead; its first ``carried``
    outputs become its first arguments of the next call."""
    import jax

    state = {"arguments": tuple(arguments)}

    def run(step):
        outputs = step.executable(*state["arguments"])
        if carried:
            state["arguments"] = (*outputs[:carried], *state["arguments"][carried:])
        return jax.block_until_ready(outputs[carried] if carried else outputs)

    jitted = jax.jit(function, donate_argnums=donate)
    return _Step(run, lambda: jitted.lower(*state["arguments"]).compile())


def forward_step(model, x, compiled=False):
    """The forward pass of ``model`` on the device tensor ``x`` as a ``_Step``.

    ``compiled`` (torch only): wrap the call in ``torch.compile``; ``True`` or a mode of
    ``bench.torch_compile.PATHS`` (``"reduce-overhead"``: CUDA graphs)."""
    backend = keras.backend.backend()
    if backend == "jax":
        forward = jax_forward_function(model)
        return _jax_program(forward, (*_jax_copies(model.trainable_variables, model.non_trainable_variables), x))
    if backend == "torch":
        import torch

        function = (lambda x: model(x, training=False))
        if compiled:
            from keras_mone.bench.torch_compile import compiled as torch_compiled

            function = torch_compiled(function, compiled)

        def run(step):
            with torch.no_grad():
                output = function(x)
            _torch_sync()
            return output

        return _Step(run)
    import tensorflow as tf

    function = tf.function(lambda x: model(x, training=False), jit_compile=bool(model.jit_compile))
    return _Step(lambda step: _logits(function(x)).numpy())


def train_step(model, x, y):
    """One training step (forward, cross-entropy, backward, AdamW 1e-4) on device tensors as a ``_Step``."""
    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_train(model, x, y)
    if backend == "torch":
        def run(step):
            logs = model.train_step((x, y))
            _torch_sync()
            return logs["loss"]

        return _Step(run)
    import tensorflow as tf

    function = tf.function(model.train_step, jit_compile=bool(model.jit_compile))
    return _Step(lambda step: np.asarray(function((x, y))["loss"]))


def jax_forward_function(model):
    """jax's pure inference forward of ``model``: ``forward(trainable, non_trainable, x) -> logits``."""

    def forward(trainable, other, x):
        return _logits(model.stateless_call(trainable, other, x, training=False)[0])

    return forward


def jax_train_function(model):
    """``(step, optimizer)``: jax's pure training step of ``model`` (forward, cross-entropy,
    backward, AdamW 1e-4), ``step(trainable, non_trainable, optimizer_state, x, y) ->
    (trainable, non_trainable, optimizer_state, loss)``, and the built optimizer."""
    import jax

    optimizer = keras.optimizers.AdamW(1e-4)
    optimizer.build(model.trainable_variables)

    def loss(trainable, other, x, y):
        output, other, losses = model.stateless_call(trainable, other, x, training=True, return_losses=True)
        return _loss(y, _logits(output)) + sum(losses), other

    def step(trainable, other, state, x, y):
        (value, other), grads = jax.value_and_grad(loss, has_aux=True)(trainable, other, x, y)
        trainable, state = optimizer.stateless_apply(state, grads, trainable)
        return trainable, other, state, value

    return step, optimizer


def _jax_train(model, x, y):
    step, optimizer = jax_train_function(model)
    copies = _jax_copies(model.trainable_variables, model.non_trainable_variables, optimizer.variables)
    return _jax_program(step, (*copies, x, y), carried=3, donate=(0, 1, 2))


def _jax_copies(*variable_lists):
    """Own copies of the variables' values: Keras' compiled calls donate (and so delete) the originals."""
    import jax.numpy as jnp

    return [[jnp.array(v.value, copy=True) for v in variables] for variables in variable_lists]


# ---------------------------------------------------------------------------
# peak device memory
# ---------------------------------------------------------------------------
def memory_mark(backend):
    """Bytes in use (and the peak mark, reset where possible) before a call; None without statistics."""
    if backend == "jax":
        import jax

        stats = jax.devices()[0].memory_stats()
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        return {"in_use": stats["bytes_in_use"], "peak": stats["peak_bytes_in_use"]}
    if backend == "torch":
        import torch

        if not torch.cuda.is_available():
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return {"in_use": torch.cuda.memory_allocated(), "peak": None}
    if backend == "tensorflow":
        import tensorflow as tf

        if not tf.config.list_physical_devices("GPU"):
            return None
        tf.config.experimental.reset_memory_stats("GPU:0")
        return {"in_use": tf.config.experimental.get_memory_info("GPU:0")["current"], "peak": None}
    return None


def memory_peak(backend, mark):
    """``{"peak_mib", "exact"}``: the peak since ``mark`` above the bytes then in use; None without a mark."""
    if mark is None:
        return None
    if backend == "jax":
        import jax

        peak = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
        exact = peak > mark["peak"]  # no reset on jax: below an earlier peak it is an upper bound
    elif backend == "torch":
        import torch

        torch.cuda.synchronize()
        peak, exact = torch.cuda.max_memory_allocated(), True
    else:
        import tensorflow as tf

        peak, exact = tf.config.experimental.get_memory_info("GPU:0")["peak"], True
    return {"peak_mib": max(peak - mark["in_use"], 0) / 2**20, "exact": bool(exact)}


class Measured:
    """A step whose first call compiles, runs once more and records that run's peak device memory
    (``memory``: ``{"device": memory_peak(...), "compiled_mib": ...}``)."""

    def __init__(self, step, backend=None):
        self.step, self.backend, self.memory = step, backend or keras.backend.backend(), None

    def __call__(self):
        if self.memory is not None:
            return self.step()
        self.step()  # compiles (jax ahead of the run; torch.compile and tf.function on it)
        mark = memory_mark(self.backend)
        output = self.step()
        self.memory = {"device": memory_peak(self.backend, mark), "compiled_mib": _compiled_mib(self.step)}
        return output


def _compiled_mib(step):
    analysis = None if step.executable is None else step.executable.memory_analysis()
    if analysis is None:
        return None
    return (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / 2**20


# ---------------------------------------------------------------------------
# the timm peer
# ---------------------------------------------------------------------------
def build_timm_peer(backbone, num_classes, pooling="gap"):
    """``(model, info)``: timm's ViT of the dense backbone's geometry, or ``(None, info)``."""
    try:
        importlib.import_module("torch")
        timm = importlib.import_module("timm")
    except Exception as error:  # ImportError, or a broken install
        return None, {
            "available": False,
            "reason": f"timm not installed: {type(error).__name__}: {error}; `pip install timm` to time it",
        }
    height, width = backbone.image_size
    config = dict(
        img_size=(height, width), patch_size=backbone.patch_size, embed_dim=backbone.hidden_dim,
        depth=backbone.depth, num_heads=backbone.num_heads, mlp_ratio=backbone.mlp_dim / backbone.hidden_dim,
        num_classes=num_classes, class_token=bool(backbone.use_class_token),
        global_pool="token" if pooling == "token" else "avg",
    )
    info = {"available": True, "package": "timm", "version": getattr(timm, "__version__", "?"),
            "model": TIMM_MODEL, "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}}
    try:
        model = timm.create_model(TIMM_MODEL, pretrained=False, **config)
    except Exception as error:
        info.update(available=False, reason=f"timm {TIMM_MODEL} could not be built: {error}")
        return None, info
    info["parameters"] = int(sum(p.numel() for p in model.parameters()))
    return model, info


def timm_step(model, images, precision, tf32=None):
    """timm's forward on ``images`` (NHWC numpy, moved once to the device) as a ``_Step``.

    ``tf32``: float32 matmuls in TF32 during the call (True, as XLA's default on a GPU;
    what the jax backend's figures use), in full float32 (False), or torch's setting (None)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    x = torch.from_numpy(np.ascontiguousarray(np.moveaxis(images, -1, 1))).to(device)
    dtype = AUTOCAST.get(precision)
    matmul = torch.backends.cuda.matmul

    def run(step):
        previous = matmul.allow_tf32
        matmul.allow_tf32 = previous if tf32 is None else bool(tf32)
        cast = torch.autocast(device, dtype=getattr(torch, dtype)) if dtype else contextlib.nullcontext()
        try:
            with torch.inference_mode(), cast:
                output = model(x)
            _torch_sync()
        finally:
            matmul.allow_tf32 = previous
        return output

    return _Step(run)
