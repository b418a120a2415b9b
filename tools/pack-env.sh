#!/usr/bin/env bash
# Packs the Python environment Spark's executors run DeepSpark in, the Spark way (venv-pack):
# a fresh venv with deepspark installed from this tree (not editable: venv-pack refuses those)
# and the extras named, packed into one .tar.gz for `deepspark train --executor-env OUT`
# (or `spark-submit --archives OUT#environment` with PYSPARK_PYTHON=./environment/bin/python).
#   tools/pack-env.sh [OUT]          (default dist/deepspark-env.tar.gz)
# Environment: PYTHON (python3.11), EXTRAS (tensorflow; empty for none), BUILD (build/pack-env),
# COMPRESS (gzip level, 4).
# Every node needs what a venv does not hold: the same Python at the same path (the venv links to it),
# and for the Caffe backend Caffe's system libraries (tools/setup-system.sh); pycaffe itself is copied in.
# pyspark is left out: Spark puts its own pyspark.zip on the executors' path.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/dist/deepspark-env.tar.gz}
python=${PYTHON:-python3.11}
extras=${EXTRAS-tensorflow}
build=${BUILD:-$here/build/pack-env}
case "$out" in /*) ;; *) out=$PWD/$out ;; esac

# pycaffe is no pip package: where the driver's venv imports a build (make caffe), a copy goes in,
# with the [caffe] extra (what its Python modules import).
caffe=$("${VENV:-$here/.venv}/bin/python" -c 'import os, caffe; print(os.path.dirname(caffe.__file__))' 2>/dev/null || true)
if [ -n "$caffe" ]; then extras=${extras:+$extras,}caffe; fi

echo "[pack-env] venv $build: deepspark${extras:+[$extras]} from $here"
rm -rf "$build"
"$python" -m venv "$build"
# deepspark as a wheel without its dependencies, then those its metadata lists for the extras named, but
# pyspark (the largest of them, which the pack would leave out anyway). No byte-compiling: the executors compile what
# they import, in their own copy.
pip=("$build/bin/python" -m pip -q --disable-pip-version-check)
"${pip[@]}" wheel --no-deps -w "$build/wheel" "$here"
wheel=$(ls "$build"/wheel/deepspark-*.whl)
"$build/bin/python" - "$wheel" "$extras" > "$build/requirements.txt" <<'EOF'
import re, sys, zipfile
wheel, extras = sys.argv[1], set(filter(None, sys.argv[2].split(",")))
with zipfile.ZipFile(wheel) as archive:
    metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
    lines = archive.read(metadata).decode().splitlines()
for line in lines:
    if line.startswith("Requires-Dist:"):
        requirement, _, marker = line[len("Requires-Dist:"):].partition(";")
        extra = re.search(r'extra == "([^"]+)"', marker)
        if re.match(r"\s*pyspark\b", requirement, re.I) is None and (extra is None or extra.group(1) in extras):
            print(requirement.strip())
EOF
"${pip[@]}" install --no-compile -c "$here/constraints.txt" -r "$build/requirements.txt" venv-pack
"${pip[@]}" install --no-compile --no-deps "$wheel" 2>&1 | { grep -v "requires pyspark" || true; } >&2
if [ -n "$caffe" ]; then
  site=$("$build/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp -r "$caffe" "$site/caffe"
  echo "[pack-env] pycaffe from $caffe"
fi
mkdir -p "$(dirname "$out")"
rm -f "$out.partial"
"$build/bin/venv-pack" -q -p "$build" -o "$out.partial" --format tar.gz --compress-level "${COMPRESS:-4}" \
  --exclude "lib/python*/site-packages/pyspark/*" --exclude "lib/python*/site-packages/pyspark-*"
mv "$out.partial" "$out"
echo "[pack-env] wrote $out ($(du -h "$out" | cut -f1)); train with --executor-env $out"
