#!/usr/bin/env bash
# Build real pycaffe (CPU only) from the brocolli-caffe sdist and put it on a venv's path.
#
# usage: tools/build-caffe.sh VENV_DIR
#
# The sdist is BVLC Caffe plus extra layers; its own setup.py wants conda and
# Python <= 3.9, so this script builds the source tree with CMake directly
# (recipe and reasons: the team's caffe-build notes). The result is a folder
# holding the `caffe` package (_caffe.so, proto/caffe_pb2.py), cached outside
# the work tree under
#
#   ${DEEPSPARK_CACHE:-$HOME/.cache/deepspark}/caffe-9.0.2-<key>
#
# where <key> hashes the sdist's sha256, this script's content, the venv's
# Python version and numpy's major version: change any of them and it rebuilds.
# The venv gets a one-line deepspark-caffe.pth naming that folder, so a cached
# run costs a couple of seconds. The build happens in a temporary folder that
# is renamed into place only when complete.
#
# Environment:
#   DEEPSPARK_CACHE        cache root (default $HOME/.cache/deepspark)
#   DEEPSPARK_BUILD_JOBS   parallel compile jobs (default 2)
#
# Root installs missing Debian build packages with apt-get; anyone else is
# told the exact command. pycaffe's import-time Python needs (numpy, protobuf,
# six) are pip-installed into the venv only when missing.
set -euo pipefail

readonly SDIST_NAME=brocolli-caffe
readonly SDIST_VERSION=9.0.2
readonly SDIST_SHA256=c6410cc60bdd6db685d441b66be7df05410f8850ac88d6b75d48ef9b2315c08a
readonly APT_PACKAGES=(
  build-essential cmake
  libboost-system-dev libboost-thread-dev libboost-filesystem-dev
  libboost-regex-dev libboost-python-dev
  libprotobuf-dev protobuf-compiler libgoogle-glog-dev libgflags-dev
  libhdf5-dev libopenblas-dev liblmdb-dev
)
# pycaffe's top-level imports (pycaffe.py, net_spec.py, io.py) beyond the stdlib;
# load_image needs Pillow (deepspark's own dependency), imported when called; the io.py patch below
# leaves no scikit-image or scipy.
readonly PY_IMPORTS=(numpy google.protobuf six)
readonly PY_REQUIREMENTS=(numpy 'protobuf>=3.20,<8' six)

say() { printf '[caffe] %s\n' "$*"; }
die() { printf '[caffe] error while %s: %s\n' "$STEP" "$*" >&2; REPORTED=1; exit 1; }

STEP="starting"
LOG=""
TMP=""
REPORTED=0
step() { STEP=$1; say "$1..."; }

# Run a command with its output going to the build log.
run() {
  if [[ -z $LOG ]]; then
    mkdir -p "$CACHE/logs"
    LOG="$CACHE/logs/caffe-$SDIST_VERSION-$(date +%Y%m%d-%H%M%S)-$$.log"
  fi
  printf '\n$ %s\n' "$*" >>"$LOG"
  "$@" >>"$LOG" 2>&1
}

on_exit() {
  local rc=$?
  if ((rc != 0)); then
    if ((!REPORTED)); then printf '[caffe] FAILED while %s (exit status %s)\n' "$STEP" "$rc" >&2; fi
    if [[ -n $LOG && -s $LOG ]]; then
      printf '[caffe] last lines of the build log %s:\n' "$LOG" >&2
      tail -n 40 "$LOG" | sed 's/^/  | /' >&2
      if grep -q -E 'error:|CMake Error|\*\*\* \[' "$LOG"; then
        printf '[caffe] first errors in it:\n' >&2
        grep -m 8 -E 'error:|CMake Error|\*\*\* \[' "$LOG" | sed 's/^/  | /' >&2
      fi
      printf '[caffe] full build log: %s\n' "$LOG" >&2
    fi
  fi
  if [[ -n $TMP && -d $TMP ]]; then rm -rf "$TMP"; fi
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

STEP="checking arguments"
(($# == 1)) || { echo "usage: $0 VENV_DIR" >&2; REPORTED=1; exit 2; }
[[ -x $1/bin/python ]] || die "$1 is not a virtualenv (no $1/bin/python); create one with: python3 -m venv $1"
VENV=$(cd "$1" && pwd)
PY=$VENV/bin/python
SCRIPT=$(readlink -f "${BASH_SOURCE[0]}")
CACHE=${DEEPSPARK_CACHE:-$HOME/.cache/deepspark}
JOBS=${DEEPSPARK_BUILD_JOBS:-2}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)

# Everything we need to know about the venv's interpreter, in one start-up:
# version, headers, base prefix, site-packages, numpy, missing imports.
py_facts() {
  "$PY" - "${PY_IMPORTS[@]}" <<'EOF'
import importlib.util, sys, sysconfig
missing = []
for name in sys.argv[1:]:
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    if not found:
        missing.append(name)
numpy_include = numpy_major = "-"
if "numpy" not in missing:
    import numpy
    numpy_include, numpy_major = numpy.get_include(), numpy.__version__.split(".")[0]
print("%d.%d" % sys.version_info[:2])
print(sysconfig.get_paths()["include"])
print(sys.base_prefix)
print(sysconfig.get_paths()["purelib"])
print(numpy_include)
print(numpy_major)
print(" ".join(missing) or "-")
EOF
}

read_py_facts() {
  local facts
  facts=$(py_facts) || die "cannot run $PY"
  { read -r PY_VER; read -r PY_INCLUDE; read -r PY_BASE; read -r SITE
    read -r NUMPY_INCLUDE; read -r NUMPY_MAJOR; read -r PY_MISSING; } <<<"$facts"
}

STEP="inspecting $PY"
read_py_facts
if [[ $PY_MISSING != - ]]; then
  step "installing pycaffe's Python dependencies into $VENV ($PY_MISSING)"
  reqs=()
  for i in "${!PY_IMPORTS[@]}"; do
    if [[ " $PY_MISSING " == *" ${PY_IMPORTS[$i]} "* ]]; then reqs+=("${PY_REQUIREMENTS[$i]}"); fi
  done
  STEP="pip-installing ${reqs[*]} into $VENV"
  run "$PY" -m pip install --disable-pip-version-check "${reqs[@]}"
  read_py_facts
  [[ $PY_MISSING == - ]] || die "still missing after pip install: $PY_MISSING"
fi

SCRIPT_SHA=$(sha256sum "$SCRIPT" | cut -d' ' -f1)
KEY=$(printf '%s\n' "$SDIST_SHA256" "$SCRIPT_SHA" "python$PY_VER" "numpy$NUMPY_MAJOR" | sha256sum | cut -c1-12)
NAME=caffe-$SDIST_VERSION-$KEY
DEST=$CACHE/$NAME

ensure_apt_packages() {
  STEP="checking Debian build packages"
  local missing=() pkg
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
  done
  ((${#missing[@]} == 0)) && return 0
  local cmd="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
  if ((EUID != 0)); then
    die "missing Debian packages: ${missing[*]}; as root run: $cmd"
  fi
  step "installing Debian packages (${missing[*]})"
  STEP="apt-get update"
  run env DEBIAN_FRONTEND=noninteractive apt-get update
  STEP="apt-get install of ${missing[*]}"
  run env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

# A finished build is usable if its extension's shared libraries all resolve.
build_ok() {
  [[ -f $DEST/caffe/_caffe.so && -f $DEST/caffe/proto/caffe_pb2.py ]] || return 1
  ! ldd "$DEST/caffe/_caffe.so" 2>/dev/null | grep -q 'not found'
}

install_into_venv() {
  STEP="linking the build into $VENV"
  local pth=$SITE/deepspark-caffe.pth
  if [[ ! -f $pth || $(cat "$pth") != "$DEST" ]]; then
    printf '%s\n' "$DEST" >"$pth.tmp.$$"
    mv -f "$pth.tmp.$$" "$pth"
  fi
  STEP="importing caffe in $VENV"
  local where
  where=$(cd / && GLOG_minloglevel=2 "$PY" -c 'import caffe, caffe.proto.caffe_pb2; print(caffe.__file__)' 2>&1) \
    || die "import caffe failed in $VENV: $(tail -n 5 <<<"$where")"
  [[ $where == "$DEST/caffe/__init__.py" || $where == "$DEST/caffe/__init__.pyc" ]] \
    || die "import caffe in $VENV loads $where, not $DEST; remove the other caffe from the venv"
  say "ready: import caffe in $VENV loads $DEST/caffe (via $pth)"
}

if [[ -d $DEST ]] && ! build_ok && [[ -f $DEST/caffe/_caffe.so ]]; then
  # Cached, but a runtime library went away (e.g. a package was removed).
  ensure_apt_packages
fi
if build_ok; then
  say "using cached build $DEST"
  install_into_venv
  exit 0
fi

# One builder per key at a time; a second caller waits, then finds the cache.
exec 9>"$CACHE/.$NAME.lock"
if ! flock -n 9; then
  say "another build of $NAME is running; waiting for it..."
  flock 9
fi
if build_ok; then
  say "using cached build $DEST (built by the run we waited for)"
  install_into_venv
  exit 0
fi
rm -rf "$CACHE/.$NAME.tmp."*   # left by a run that was killed outright
say "building $NAME for Python $PY_VER (numpy $NUMPY_MAJOR.x) with $JOBS jobs; this takes about 5 minutes"
rm -rf "$DEST"   # an unusable leftover, if any

ensure_apt_packages
MULTIARCH=$(gcc -print-multiarch)
BOOST_PYTHON=boost_python${PY_VER//./}
[[ -e /usr/lib/$MULTIARCH/lib$BOOST_PYTHON.so ]] || die "the venv's Python is $PY_VER but Debian's libboost-python-dev has no lib$BOOST_PYTHON.so (it has: $(cd /usr/lib/"$MULTIARCH" && ls libboost_python3*.so 2>/dev/null | tr '\n' ' ')); use a venv made with that Python"

# --- sdist: cached download, checked against the pinned sha256
step "fetching the $SDIST_NAME $SDIST_VERSION sdist"
SDIST_DIR=$CACHE/sdist   # shared with the caffe_source fixture in tests/conftest.py
SDIST=$SDIST_DIR/$SDIST_NAME-$SDIST_VERSION.tar.gz
mkdir -p "$SDIST_DIR"
if [[ ! -f $SDIST ]] || [[ $(sha256sum "$SDIST" | cut -d' ' -f1) != "$SDIST_SHA256" ]]; then
  dl=$(mktemp -d "$SDIST_DIR/.download.XXXXXX")
  STEP="pip download of $SDIST_NAME==$SDIST_VERSION"
  if ! run "$PY" -m pip download --disable-pip-version-check --no-deps --no-binary :all: \
      "$SDIST_NAME==$SDIST_VERSION" -d "$dl"; then
    rm -rf "$dl"; false
  fi
  got=$(sha256sum "$dl/$SDIST_NAME-$SDIST_VERSION.tar.gz" | cut -d' ' -f1)
  if [[ $got != "$SDIST_SHA256" ]]; then
    rm -rf "$dl"
    die "downloaded $SDIST_NAME-$SDIST_VERSION.tar.gz has sha256 $got, expected $SDIST_SHA256"
  fi
  mv -f "$dl/$SDIST_NAME-$SDIST_VERSION.tar.gz" "$SDIST"
  rm -rf "$dl"
fi
say "sdist $SDIST (sha256 verified)"

TMP=$(mktemp -d "$CACHE/.$NAME.tmp.XXXXXX")
SRC=$TMP/src
BUILD=$TMP/build
step "unpacking"
mkdir -p "$SRC"
run tar -xzf "$SDIST" -C "$SRC" --strip-components=1

# --- source changes; each edit must match exactly once or the build stops
step "patching the source"
run "$PY" - "$SRC" "$BOOST_PYTHON" <<'EOF'
import os, shutil, sys
src, boost_python = sys.argv[1], sys.argv[2]

def replace_once(rel, old, new):
    path = os.path.join(src, rel)
    with open(path) as f:
        text = f.read()
    if text.count(old) != 1:
        sys.exit("patch failed: %r occurs %d times in %s (expected once)" % (old, text.count(old), rel))
    with open(path, "w") as f:
        f.write(text.replace(old, new))
    print("patched", rel)

def replace_between(rel, start, end, new):
    """Replaces the text from `start` up to (not including) `end`, each occurring once."""
    path = os.path.join(src, rel)
    with open(path) as f:
        text = f.read()
    for marker in (start, end):
        if text.count(marker) != 1:
            sys.exit("patch failed: %r occurs %d times in %s (expected once)" % (marker, text.count(marker), rel))
    i, j = text.index(start), text.index(end)
    with open(path, "w") as f:
        f.write(text[:i] + new + text[j:])
    print("patched", rel)

# Debian ships only the versioned Boost.Python library name.
replace_once("python/CMakeLists.txt", " -lboost_python ", " -l%s " % boost_python)

# Unused include that drags in gtest.
replace_once("src/caffe/net.cpp", '#include "caffe/test/test_caffe_main.hpp"\n', "")

# TensorFlow exports its own protobuf C++ symbols process-wide; if it is
# imported first, Caffe's protobuf calls land in them and caffe.Net crashes.
# RTLD_DEEPBIND makes _caffe.so bind to its own libraries first.
replace_once("python/caffe/__init__.py", "from .pycaffe import Net,", '''\
# DeepSpark: load _caffe with RTLD_DEEPBIND so it uses its own libprotobuf even
# when TensorFlow, imported earlier, has exported a different one.
import os as _os, sys as _sys
_flags = _sys.getdlopenflags()
_sys.setdlopenflags(_flags | _os.RTLD_DEEPBIND)
try:
    from . import _caffe
finally:
    _sys.setdlopenflags(_flags)
del _os, _sys, _flags

from .pycaffe import Net,''')

# load_image and resize_image used scikit-image and scipy (large dependencies; and scikit-image
# 0.19 renamed imread's as_grey, so the fork's load_image failed with any current one). They are rewritten
# on Pillow and numpy with the numbers they gave with the scikit-image of Caffe's day: img_as_float of the
# file's pixels (RGB, a gray image repeated; as_grey's BT.709 gray), and a linear resize with pixel centres
# aligned and zero beyond the edge (skimage's resize, mode='constant', no anti-aliasing), or corners aligned
# (scipy's zoom) for images of other than 1 or 3 channels. tests/test_io.py checks them against deepspark.io.
replace_once("python/caffe/io.py", "import skimage.io\nfrom scipy.ndimage import zoom\n", "")
replace_between("python/caffe/io.py", "def load_image(", "def oversample(", """\
def load_image(filename, color=True):
    \"\"\"
    Load an image converting from grayscale or alpha as needed.

    Parameters
    ----------
    filename : string
    color : boolean
        flag for color format. True (default) loads as RGB while False
        loads as intensity (if image is already grayscale).

    Returns
    -------
    image : an image with type np.float32 in range [0, 1]
        of size (H x W x 3) in RGB or
        of size (H x W x 1) in grayscale.
    \"\"\"
    # DeepSpark: Pillow and numpy, as skimage.img_as_float(skimage.io.imread(filename, as_grey=not color)).
    from PIL import Image
    with Image.open(filename) as pil:
        pil.load()
        if pil.mode.startswith('I;16'):
            img = np.array(pil, dtype=np.uint16) / 65535.0
        elif pil.mode in ('L', 'RGB', 'RGBA'):
            img = np.array(pil, dtype=np.uint8) / 255.0
        else:
            img = np.array(pil.convert('RGBA' if 'transparency' in pil.info else 'RGB'), dtype=np.uint8) / 255.0
    if img.ndim == 3 and not color:
        img = img[:, :, 0] * 0.2125 + img[:, :, 1] * 0.7154 + img[:, :, 2] * 0.0721
    img = img.astype(np.float32)
    if img.ndim == 2:
        img = img[:, :, np.newaxis]
        if color:
            img = np.tile(img, (1, 1, 3))
    elif img.shape[2] == 4:
        img = img[:, :, :3]
    return img


def _linear(im, axis, size, centers):
    # DeepSpark: linear interpolation along one axis. centers: sample (o + 0.5) * n / size - 0.5 with zero
    # beyond the edge (skimage's resize, mode='constant'); else o * (n - 1) / (size - 1) (scipy's zoom).
    n = im.shape[axis]
    o = np.arange(size, dtype=np.float64)
    x = (o + 0.5) * n / size - 0.5 if centers else o * (n - 1) / max(size - 1, 1)
    lo = np.floor(x).astype(int)
    frac = (x - lo).reshape((-1,) + (1,) * (im.ndim - 1 - axis))
    pad = [(0, 0)] * im.ndim
    pad[axis] = (1, 2)
    padded = np.pad(im.astype(np.float64), pad)
    return (np.take(padded, lo + 1, axis=axis) * (1 - frac) +
            np.take(padded, lo + 2, axis=axis) * frac)


def resize_image(im, new_dims, interp_order=1):
    \"\"\"
    Resize an image array with interpolation.

    Parameters
    ----------
    im : (H x W x K) ndarray
    new_dims : (height, width) tuple of new dimensions.
    interp_order : interpolation order, default is linear (DeepSpark: the only one).

    Returns
    -------
    im : resized ndarray with shape (new_dims[0], new_dims[1], K)
    \"\"\"
    if interp_order != 1:
        raise ValueError('resize_image: only interp_order=1 (linear) is supported')
    if im.shape[-1] == 1 or im.shape[-1] == 3:
        im_min, im_max = im.min(), im.max()
        if im_max > im_min:
            # as skimage, which only understands {1,3} channel images in [0, 1].
            im_std = (im - im_min) / (im_max - im_min)
            resized_std = _linear(_linear(im_std, 0, int(new_dims[0]), True), 1, int(new_dims[1]), True)
            resized_im = np.clip(resized_std, 0, 1) * (im_max - im_min) + im_min
        else:
            # the image is a constant -- avoid divide by 0
            ret = np.empty((new_dims[0], new_dims[1], im.shape[-1]),
                           dtype=np.float32)
            ret.fill(im_min)
            return ret
    else:
        # as ndimage's zoom, which interpolates anything.
        resized_im = _linear(_linear(im, 0, int(new_dims[0]), False), 1, int(new_dims[1]), False)
    return resized_im.astype(np.float32)


""")

# Caffe's own upgrade tools (upgrade_net_proto_text, upgrade_solver_proto_text) as
# functions of pycaffe: the fork builds no tools, and the tests compare DeepSpark's
# upgrade of old nets and solvers with Caffe's, field for field. Each returns
# (the upgraded text as the tool writes it, whether the upgrade was clean).
replace_once("python/caffe/_caffe.cpp", "BOOST_PYTHON_MEMBER_FUNCTION_OVERLOADS(SolveOverloads, Solve, 0, 1);\n", '''\
BOOST_PYTHON_MEMBER_FUNCTION_OVERLOADS(SolveOverloads, Solve, 0, 1);

// DeepSpark: tools/upgrade_net_proto_text.cpp and upgrade_solver_proto_text.cpp
// as functions, the text as WriteProtoToTextFile prints it.
bp::tuple UpgradeNetText(const string& filename) {
  CheckFile(filename);
  NetParameter param;
  if (!ReadProtoFromTextFile(filename, &param)) {
    throw std::runtime_error("Failed to parse input text file as NetParameter: " + filename);
  }
  bool success = !NetNeedsUpgrade(param) || UpgradeNetAsNeeded(filename, &param);
  string text;
  google::protobuf::TextFormat::PrintToString(param, &text);
  return bp::make_tuple(text, success);
}

bp::tuple UpgradeSolverText(const string& filename) {
  CheckFile(filename);
  SolverParameter param;
  if (!ReadProtoFromTextFile(filename, &param)) {
    throw std::runtime_error("Failed to parse input text file as SolverParameter: " + filename);
  }
  bool success = !SolverNeedsTypeUpgrade(param) || UpgradeSolverAsNeeded(filename, &param);
  string text;
  google::protobuf::TextFormat::PrintToString(param, &text);
  return bp::make_tuple(text, success);
}
''')
replace_once("python/caffe/_caffe.cpp", "  bp::def(\"layer_type_list\", &LayerRegistry<Dtype>::LayerTypeList);\n", '''\
  bp::def("layer_type_list", &LayerRegistry<Dtype>::LayerTypeList);
  bp::def("upgrade_net_text", &UpgradeNetText);
  bp::def("upgrade_solver_text", &UpgradeSolverText);
''')
replace_once("python/caffe/_caffe.cpp", '#include "caffe/sgd_solvers.hpp"\n', '''\
#include "caffe/sgd_solvers.hpp"
#include "caffe/util/upgrade_proto.hpp"
#include <google/protobuf/text_format.h>  // NOLINT(build/include_order)
#include <stdexcept>  // NOLINT(build/include_order)
''')

# Generated files shipped in the sdist (old protoc); the build makes fresh ones.
for rel in ("python/caffe/proto/caffe_pb2.py", "include/caffe/proto/caffe.pb.h",
            "src/caffe/proto/caffe.pb.cc"):
    path = os.path.join(src, rel)
    if os.path.exists(path):
        os.remove(path)
        print("removed stale", rel)
for root, dirs, _ in os.walk(os.path.join(src, "python")):
    for d in dirs:
        if d == "__pycache__":
            shutil.rmtree(os.path.join(root, d))
            print("removed stale", os.path.relpath(os.path.join(root, d), src))
EOF

# --- configure, build, install
step "configuring with CMake"
# -DWITH_PYTHON_LAYER: Caffe's `type: "Python"` layer. The fork's BUILD_python_layer
# option puts the define on a list that its one target (pycaffe) never reads.
run cmake -S "$SRC" -B "$BUILD" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_INSTALL_PREFIX="$TMP/install" \
  -DCPU_ONLY=ON -DBUILD_python=ON -Dpython_version=3 \
  -DANACONDA_HOME="$PY_BASE" -DPYTHON_VERSION="python$PY_VER" \
  -DCMAKE_CXX_FLAGS="-I/usr/include/hdf5/serial -I$NUMPY_INCLUDE -I$PY_INCLUDE -DUSE_LMDB -DWITH_PYTHON_LAYER" \
  -DCMAKE_SHARED_LINKER_FLAGS="-L/usr/lib/$MULTIARCH/hdf5/serial" \
  -DCMAKE_CXX_STANDARD_LIBRARIES=-llmdb

step "compiling (make -j$JOBS, about 5 minutes on 2 cores)"
start=$SECONDS
run make -C "$BUILD" -j"$JOBS"
say "compiled in $((SECONDS - start)) s"

step "installing into the cache"
run cmake --install "$BUILD"
mkdir -p "$TMP/result"
mv "$TMP/install/python/caffe" "$TMP/result/caffe"
DEST_TMP=$TMP/result
[[ -f $DEST_TMP/caffe/_caffe.so && -f $DEST_TMP/caffe/proto/caffe_pb2.py ]] \
  || die "the install did not produce caffe/_caffe.so and caffe/proto/caffe_pb2.py"
if ldd "$DEST_TMP/caffe/_caffe.so" | grep 'not found' >>"$LOG"; then
  die "_caffe.so has unresolved libraries (see $LOG)"
fi
# Byte-compile now, so the cache folder never needs to be writable at import.
run "$PY" -m compileall -q "$DEST_TMP/caffe"
{
  echo "sdist: $SDIST_NAME-$SDIST_VERSION.tar.gz sha256 $SDIST_SHA256"
  echo "script: $SCRIPT sha256 $SCRIPT_SHA"
  echo "python: $PY_VER ($PY)  numpy: $NUMPY_MAJOR.x"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on ${HOSTNAME:-unknown host}"
} >"$DEST_TMP/BUILD-INFO"
cp "$LOG" "$DEST_TMP/build.log"
mv -T "$DEST_TMP" "$DEST"
rm -rf "$TMP"
TMP=""
rm -f "$LOG"
LOG=""
say "built $DEST"

install_into_venv
