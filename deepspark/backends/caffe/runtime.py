"""pycaffe, imported quietly once, with OpenBLAS's thread count taken from DEEPSPARK_THREADS."""

import ctypes
import os

THREADS_VARIABLE = "DEEPSPARK_THREADS"

_caffe = None


def threads():
    """DEEPSPARK_THREADS as a positive int, or None when unset (OpenBLAS's own default)."""
    value = os.environ.get(THREADS_VARIABLE, "").strip()
    if not value:
        return None
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{THREADS_VARIABLE} must be a positive integer, not {value!r}") from None
    if count <= 0:
        raise ValueError(f"{THREADS_VARIABLE} must be a positive integer, not {value!r}")
    return count


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


def caffe():
    """The pycaffe module in CPU mode; glog quiet unless GLOG_minloglevel says otherwise."""
    global _caffe
    if _caffe is None:
        os.environ.setdefault("GLOG_minloglevel", "2")
        count = threads()
        if count is not None:
            # Read by OpenBLAS when it loads; set_threads covers an OpenBLAS loaded earlier (numpy's).
            os.environ["OPENBLAS_NUM_THREADS"] = str(count)
        try:
            import caffe as module
        except ImportError as error:
            raise ImportError(f"the Caffe backend needs pycaffe in this Python ({error}); "
                              "build it with `make caffe`") from None
        module.set_mode_cpu()
        _caffe = module
    count = threads()
    if count is not None:
        set_threads(count)
    return _caffe
