#!/usr/bin/env bash
# Builds bench/.venv-peers, the venv that bench/peers.py runs the external peers of #14 in: Elephas with the
# TensorFlow it accepts, and PyTorch for Spark's TorchDistributor. Apart from the main venv because elephas
# 7.3 pins tensorflow<2.20, numpy<2 and pyspark<=4.0.0 (the main venv has TF 2.21, numpy 2, pyspark 4.3.0).
# One venv holds both peers: torch 2.13.0 asks for none of those. A stamp (this script's hash) makes a second
# run a no-op; the versions pip resolved are written to bench/.venv-peers/versions.txt.
#   tools/peers-env.sh            (PYTHON: python3.11)
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
venv=$here/bench/.venv-peers
python=${PYTHON:-python3.11}
# torch==2.13.0 exactly: this machine keeps that CPU build on disk; a range would fetch a multi-GB CUDA build.
# pyspark==4.0.0 is the newest that elephas 7.3's pin allows; tensorflow==2.19.1 the newest below its <2.20.
requirements=(elephas==7.3.0 tensorflow==2.19.1 pyspark==4.0.0 torch==2.13.0)
stamp=$venv/.stamp
want=$(sha256sum "$0" | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[peers-env] $venv is up to date"
  exit 0
fi
echo "[peers-env] building $venv: ${requirements[*]}"
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
"${pip[@]}" install "${requirements[@]}"
"${pip[@]}" check
"${pip[@]}" freeze > "$venv/versions.txt"
grep -iE '^(elephas|tensorflow|keras|pyspark|torch|numpy|h5py|flask)==' "$venv/versions.txt" | sed 's/^/[peers-env] /'
echo "$want" > "$stamp"
