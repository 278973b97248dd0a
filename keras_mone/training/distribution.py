"""Multi-device training: keras.distribution on jax, tf.distribute on tensorflow.

``distribution_scope(kind)`` is entered while the model and optimizer are
built and compiled:

- ``"data_parallel"``: jax -> ``keras.distribution.DataParallel`` over all
  devices (set globally, so ``fit`` shards each batch); tensorflow ->
  ``tf.distribute.MirroredStrategy`` over all GPUs, else all logical CPUs.
- ``"model_parallel"`` (jax): a ``(batch, model)`` device mesh and
  ``vit_layout_map``: attention and MLP kernels split over the ``model`` axis
  (Megatron style), everything else replicated, batch split over ``batch``.
- ``"none"``: one device.
- ``"auto"``: ``"data_parallel"`` when there are several local accelerators
  (GPUs or TPUs on jax, GPUs on tensorflow), ``"none"`` otherwise (a CPU, one
  accelerator, torch); ``resolve`` gives the choice.

Torch runs single-device here (Keras' torch backend has no
``keras.distribution``; use ``torchrun`` + DDP outside this package).
"""

import contextlib
import warnings

import keras

DISTRIBUTION_STRATEGIES = ("none", "data_parallel", "model_parallel", "auto")
"""The ``distribution`` kinds ``distribution_scope`` takes (multi-device strategies)."""
DISTRIBUTIONS = DISTRIBUTION_STRATEGIES  # former name, kept for one release

#: Full-path regexes (``re.fullmatch`` since Keras 3.14) -> sharding of ViT weights.
VIT_LAYOUT = {
    r".*/attention/qkv/kernel": (None, "model"),
    r".*/attention/qkv/bias": ("model",),
    r".*/attention/out/kernel": ("model", None),
    r".*/mlp/fc1/kernel": (None, "model"),
    r".*/mlp/fc1/bias": ("model",),
    r".*/mlp/fc2/kernel": ("model", None),
}


def local_accelerators(backend=None):
    """The local GPUs / TPUs the backend can spread a batch over (names; none on a CPU)."""
    backend = backend or keras.backend.backend()
    if backend == "jax":
        import jax

        return [str(d) for d in jax.local_devices() if d.platform != "cpu"]
    if backend == "tensorflow":
        import tensorflow as tf

        return [d.name for d in tf.config.list_logical_devices("GPU")]
    import torch

    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def resolve(kind, backend=None):
    """``kind`` with ``"auto"`` replaced by ``"data_parallel"`` (several local
    accelerators) or ``"none"`` (one device)."""
    if kind != "auto":
        return kind
    backend = backend or keras.backend.backend()
    accelerators = local_accelerators(backend)
    if len(accelerators) < 2:
        return "none"
    if backend == "torch":
        warnings.warn(
            f"distribution='auto' trains on one of the {len(accelerators)} GPUs: Keras' torch backend has "
            "no keras.distribution (use the jax or tensorflow backend for all of them).",
            stacklevel=2,
        )
        return "none"
    return "data_parallel"


def check_supported(kind, backend=None):
    """Raises a clear error if ``kind`` cannot run on ``backend``."""
    backend = backend or keras.backend.backend()
    if kind not in DISTRIBUTION_STRATEGIES:
        raise ValueError(f"`distribution` must be one of {DISTRIBUTION_STRATEGIES}, got {kind!r}.")
    if kind in ("none", "auto"):
        return
    if backend == "torch":
        raise ValueError(
            f"distribution={kind!r} needs the jax or tensorflow backend; Keras' torch backend has "
            "no keras.distribution (use distribution='none')."
        )
    if kind == "model_parallel" and backend != "jax":
        raise ValueError("distribution='model_parallel' needs the jax backend (keras.distribution).")


def vit_layout_map(device_mesh):
    """``keras.distribution.LayoutMap`` sharding ViT / MoNE / MatViT blocks over ``model``."""
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for pattern, axes in VIT_LAYOUT.items():
        layout_map[pattern] = axes
    return layout_map


def _jax_distribution(kind, model_parallel_size):
    devices = keras.distribution.list_devices()
    if kind == "data_parallel":
        return keras.distribution.DataParallel(devices=devices)
    if len(devices) % model_parallel_size:
        raise ValueError(
            f"model_parallel_size={model_parallel_size} must divide the device count ({len(devices)})."
        )
    mesh = keras.distribution.DeviceMesh(
        shape=(len(devices) // model_parallel_size, model_parallel_size),
        axis_names=("batch", "model"),
        devices=devices,
    )
    return keras.distribution.ModelParallel(layout_map=vit_layout_map(mesh), batch_dim_name="batch")


def tf_strategy():
    """``MirroredStrategy`` over all GPUs, or else all logical CPU devices."""
    import tensorflow as tf

    devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    return tf.distribute.MirroredStrategy(devices=[d.name for d in devices])


def split_tf_cpu(num_devices):
    """Splits the CPU into ``num_devices`` logical TF devices (before TF runs any op)."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
    )


def num_replicas(kind):
    """Devices a batch is split over under ``kind`` (1 for ``"none"``)."""
    kind = resolve(kind)
    if kind == "none":
        return 1
    if keras.backend.backend() == "jax":
        return len(keras.distribution.list_devices())
    import tensorflow as tf

    return tf.distribute.get_strategy().num_replicas_in_sync


@contextlib.contextmanager
def distribution_scope(kind, model_parallel_size=2):
    """Context for building and compiling a model under distribution ``kind``."""
    check_supported(kind)
    kind = resolve(kind)
    if kind == "none":
        yield None
        return
    if keras.backend.backend() == "jax":
        distribution = _jax_distribution(kind, model_parallel_size)
        keras.distribution.set_distribution(distribution)
        yield distribution
        return
    strategy = tf_strategy()
    with strategy.scope():
        yield strategy
