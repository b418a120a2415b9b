"""pycaffe, imported quietly once in CPU mode, and the thread count of the OpenBLAS behind Caffe's GEMMs."""

import ctypes
import os

_caffe = None


def _loaded_openblas():
    """Paths of the OpenBLAS libraries mapped into this process."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "openblas" in line and "/" in line})
    except OSError:
        return []


def set_threads(count):
    """OpenBLAS threads for Caffe's GEMMs in this process; True if a loaded OpenBLAS took it."""
    done = False
    for path in _loaded_openblas():
        try:
            library = ctypes.CDLL(path)
            library.openblas_set_num_threads(ctypes.c_int(count))
            done = True
        except (OSError, AttributeError):
            continue
    return done


def caffe(threads=None):
    """The pycaffe module in CPU mode, glog quiet unless GLOG_minloglevel says otherwise.

    threads: OpenBLAS's thread count from now on (None: leave it as it is).
    """
    global _caffe
    if _caffe is None:
        os.environ.setdefault("GLOG_minloglevel", "2")
        if threads is not None:
            # Read by OpenBLAS when it loads; set_threads covers an OpenBLAS loaded earlier (numpy's).
            os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
        try:
            import caffe as module
        except ImportError as error:
            raise ImportError(f"the Caffe backend needs pycaffe in this Python ({error}); "
                              "build it with `make caffe`") from None
        module.set_mode_cpu()
        _caffe = module
    if threads is not None:
        set_threads(threads)
    return _caffe


_device = "CPU"


def device():
    """Where Caffe computes in this process: "GPU:i" once use_gpu pinned it there, else the CPU."""
    return _device


def built_with_cuda():
    """Whether this pycaffe was built with CUDA (tools/build-caffe.sh builds CPU_ONLY): its _caffe library needs
    libcudart. Asked without calling into Caffe, whose CPU_ONLY build aborts the process on set_mode_gpu."""
    module = caffe()
    library = os.path.join(os.path.dirname(module.__file__), "_caffe.so")
    try:
        with open(library, "rb") as f:
            return b"libcudart" in f.read()
    except OSError:
        return False


def use_gpu(index):
    """Caffe in GPU mode on CUDA device `index` (None: CPU mode) where this pycaffe has CUDA; where it runs now.
    Caffe's mode is per thread: the thread that builds and steps the net is the one that must ask."""
    global _device
    module = caffe()
    if index is None or not built_with_cuda():
        module.set_mode_cpu()
        _device = "CPU"
    else:
        module.set_mode_gpu()
        module.set_device(int(index))
        _device = f"GPU:{int(index)}"
    return _device
