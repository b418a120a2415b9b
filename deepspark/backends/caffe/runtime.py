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


def device():
    """Where Caffe computes: on the CPU, as tools/build-caffe.sh builds it (CPU_ONLY)."""
    return "CPU"
