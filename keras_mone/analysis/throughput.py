"""Wall-clock throughput of a model's compiled forward pass."""

import statistics
import time


def images_per_second(model, images, batch_size=256, repeats=3):
    """Median images per second of ``model.predict_on_batch`` over ``images``.

    The first pass compiles and is not timed. Compare models measured in the
    same process, since the machine may be shared.
    """
    batches = [images[i : i + batch_size] for i in range(0, len(images), batch_size)]
    for batch in batches[:2]:
        model.predict_on_batch(batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in batches:
            model.predict_on_batch(batch)
        times.append(time.perf_counter() - start)
    return len(images) / statistics.median(times)
