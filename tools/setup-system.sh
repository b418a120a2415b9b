#!/usr/bin/env bash
# Installs the Debian packages DeepSpark needs beyond Python: the Fashion-MNIST
# data, Java 17 for Spark, and protoc for `make proto`. pycaffe's build
# dependencies are installed by tools/build-caffe.sh.
set -euo pipefail

need=()
dpkg -s dataset-fashion-mnist >/dev/null 2>&1 || need+=(dataset-fashion-mnist)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
if ! java -version 2>&1 | grep -Eq 'version "(1[7-9]|2[0-9])'; then
  need+=(openjdk-17-jre-headless)
fi

if [ ${#need[@]} -eq 0 ]; then
  echo "[system] Debian packages present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "[system] missing Debian packages: ${need[*]}" >&2
  echo "[system] run as root: apt-get update && apt-get install -y ${need[*]}" >&2
  exit 1
fi
echo "[system] installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
