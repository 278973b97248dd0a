"""Peak allocations of one forward pass or training step, per backend (``keras-mone bench --memory``).

Peak RSS (``bench_measure``) counts the process: compiler, allocator caches
and code. The figure here counts the tensors a step allocates, measured the
way each backend allows on CPU:

* jax: the temporaries of the compiled program (XLA ``memory_analysis()``:
  every buffer that is neither an argument nor an output, as laid out by the
  compiler), for the forward pass and for forward + backward (the gradients
  of the cross-entropy loss with respect to every trainable weight; the
  optimizer update, the same for dense and MoNE, is left out);
* torch: the peak of the bytes held by tensors allocated during one call
  (``predict_on_batch`` or ``train_on_batch``), from the allocation events of
  ``torch.profiler`` (``profile_memory=True``), above what was live before,
  with Python's cycle collector held off (``torch_peak_bytes``);
* tensorflow: none; its CPU allocator reports no peak
  (``tf.config.experimental.get_memory_info`` serves GPUs only), so peak RSS
  is the measure there.
"""

import keras

MEASURES = {
    "jax": "compiled temporaries (XLA memory_analysis)",
    "torch": "peak tensor allocations during the call (torch.profiler memory events)",
}


def allocation_measure():
    """What ``peak_allocation_bytes`` measures on this backend, or ``None``."""
    return MEASURES.get(keras.backend.backend())


def peak_allocation_bytes(model, images, labels, train):
    """Bytes the step allocates at its peak (see the module docstring); ``None`` on tensorflow."""
    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_temporaries(model, images, labels, train)
    if backend == "torch":
        return _torch_peak(model, images, labels, train)
    return None


def _jax_temporaries(model, images, labels, train):
    executable, _ = compiled_jax_step(model, images, labels, train)
    analysis = executable.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def compiled_jax_step(model, images, labels, train):
    """``(executable, arguments)``: the model's forward pass (``train=False``) or the gradients
    of its cross-entropy loss with respect to every trainable weight (``train=True``), compiled
    with ``jax.jit`` with the weights as arguments; ``executable(*arguments)`` runs it (jax)."""
    import jax

    trainable = [v.value for v in model.trainable_variables]
    other = [v.value for v in model.non_trainable_variables]

    def forward(trainable, other, x, training=False):
        return model.stateless_call(trainable, other, x, training=training)[0]

    if train:
        def loss(trainable, other, x, y):
            logits = forward(trainable, other, x, training=True)
            return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))

        function, arguments = jax.grad(loss), (trainable, other, images, labels)
    else:
        function, arguments = forward, (trainable, other, images)
    return jax.jit(function).lower(*arguments).compile(), arguments


def _torch_peak(model, images, labels, train):
    if train:
        return torch_peak_bytes(lambda: model.train_on_batch(images, labels))
    return torch_peak_bytes(lambda: model.predict_on_batch(images))


def torch_peak_bytes(run):
    """Peak bytes held by tensors allocated while ``run()`` runs, above what was live
    before (torch: the allocation events of ``torch.profiler``, ``profile_memory=True``).

    Python's cycle collector is run first and held off during the call, so the
    figure is repeatable and an upper bound: Keras' layer calls on torch flatten
    their arguments with closures that form reference cycles (torch's pytree
    helpers), and the tensors those hold were freed whenever a collection
    happened to run; with it running, the same call's peak varied by a few token
    tensors from call to call."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            run()
    finally:
        if was_enabled:
            gc.enable()
    events = [e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak
