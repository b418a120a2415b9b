"""TensorFlow, imported quietly once, and its intra- and inter-op thread counts, set on first use."""

import warnings

from deepspark.backends import keras_deferred
from deepspark.log import import_quietly

# Quiet: deepspark/__init__.py set TF_CPP_MIN_LOG_LEVEL before anything loads it, and import_quietly holds back
# the start-up lines that no setting silences. Without Keras in the processes DeepSpark owns (keras_deferred).
with keras_deferred():
    tf = import_quietly("tensorflow")

_threads = None  # the count TensorFlow took in this process, once a model asked for one


def set_threads(count):
    """Intra- and inter-op threads for TensorFlow in this process (None: leave them as they are).

    TensorFlow takes them only before its runtime starts (at the first op or
    variable), so the first count asked for stays; a model that asks for
    another later is told so with a RuntimeWarning, and runs.
    """
    global _threads
    if count is None or count == _threads:
        return
    if _threads is None:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(count)
            tf.config.threading.set_inter_op_parallelism_threads(count)
        except RuntimeError:
            running = "its default thread counts (it started before any model asked for a count)"
        else:
            _threads = count
            return
    else:
        running = f"{_threads} threads (the first count asked for)"
    warnings.warn(f"TensorFlow already runs with {running} in this process; threads={count} is not applied: "
                  "TensorFlow takes a thread count only before it starts", RuntimeWarning, stacklevel=3)


def device():
    """Where TensorFlow places a model's ops: its first visible GPU, else the CPU."""
    gpus = tf.config.get_visible_devices("GPU")  # what use_gpu left visible; the runtime need not have started
    return f"GPU:{gpus[0].name.rsplit(':', 1)[-1]}" if gpus else "CPU"


def use_gpu(index):
    """Pin this process's TensorFlow to CUDA device `index` (None: to no GPU, the CPU), growing its memory as
    needed rather than taking it all; where a model runs now (device()).

    TensorFlow takes the choice only before its runtime starts: once a model has run, what it sees stays.
    """
    gpus = tf.config.list_physical_devices("GPU")  # lists devices without starting the runtime
    chosen = [gpu for gpu in gpus if index is not None and gpu.name.rsplit(":", 1)[-1] == str(index)]
    try:
        tf.config.set_visible_devices(chosen, "GPU")
        for gpu in chosen:
            tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError:
        pass  # the runtime has started (an earlier task in this Python worker): it keeps the device it has
    return device()
