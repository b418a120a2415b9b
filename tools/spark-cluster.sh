#!/usr/bin/env bash
# Starts, stops or reports a Spark standalone master and two workers on 127.0.0.1,
# from the pip-installed pyspark (which ships no start-master.sh / start-worker.sh).
#   tools/spark-cluster.sh start|stop|status|kill-worker N|add-worker N
# kill-worker N: SIGKILLs worker N's JVM for good, as a machine that is gone (its executors lose their Worker
# and exit; tools/chaos.py's kill_spark_worker runs it in the fault tests). add-worker N: starts worker N (N above
# WORKERS) on the running master, as a machine that joins: a running job is granted an executor on it.
# Environment: VENV (default .venv), CLUSTER_DIR (default /tmp/deepspark-spark-cluster),
# SPARK_MASTER_PORT (7077), SPARK_MASTER_WEBUI_PORT (8080), WORKERS (2), WORKER_CORES (1), WORKER_MEMORY (2g),
# HIDE_FROM_WORKERS (folders, space-separated, that the workers must not see: each is covered by an empty
# tmpfs in the workers' own mount namespace, as on nodes without the driver's disk; needs root),
# GPUS (GPUs each worker offers Spark's resource scheduling, 0 by default: worker i's are the addresses
# (i-1)*GPUS .. i*GPUS-1, told by a discovery script of its own in CLUSTER_DIR; on one machine with that many
# GPUs they are its CUDA devices, elsewhere addresses only, to test placement without a GPU).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$here/.venv}
dir=${CLUSTER_DIR:-/tmp/deepspark-spark-cluster}
port=${SPARK_MASTER_PORT:-7077}
webui=${SPARK_MASTER_WEBUI_PORT:-8080}
workers=${WORKERS:-2}
cores=${WORKER_CORES:-1}
gpus=${GPUS:-0}
memory=${WORKER_MEMORY:-2g}
url="spark://127.0.0.1:$port"

spark_home() {
  "$venv/bin/python" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))'
}

# Worker $1 in the background, its pid in worker-$1.pid; with HIDE_FROM_WORKERS, inside a mount namespace
# whose shell covers those folders and then execs the worker (so the pid is still the worker's).
start_worker() {
  local cmd=("$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.worker.Worker
             --host 127.0.0.1 --cores "$cores" --memory "$memory" --webui-port $((webui + $1))
             --work-dir "$dir/work-$1" "$url")
  if [ "$gpus" -gt 0 ]; then
    local script="$dir/gpus-$1.sh" first=$(( ($1 - 1) * gpus )) addresses=""
    for a in $(seq "$first" $(( first + gpus - 1 ))); do addresses+="${addresses:+, }\"$a\""; done
    printf '#!/bin/sh\necho '"'"'{"name": "gpu", "addresses": [%s]}'"'"'\n' "$addresses" >"$script"
    chmod +x "$script"
    cmd=(env SPARK_WORKER_OPTS="-Dspark.worker.resource.gpu.amount=$gpus -Dspark.worker.resource.gpu.discoveryScript=$script" "${cmd[@]}")
  fi
  if [ -n "${HIDE_FROM_WORKERS:-}" ]; then
    local mounts="" folder
    for folder in $HIDE_FROM_WORKERS; do mounts+="mount -t tmpfs tmpfs '$folder' && "; done
    cmd=(unshare -m --propagation private sh -c "${mounts}exec \"\$@\"" worker "${cmd[@]}")
  fi
  nohup "${cmd[@]}" >"$dir/worker-$1.log" 2>&1 &
  echo $! >"$dir/worker-$1.pid"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# How long start and add-worker wait for Workers to register: a JVM on a loaded machine (another test run beside
# this one) has taken more than 60 s.
REGISTER_SECONDS=120

# Waits until at least $1 workers are ALIVE on the master; fails after REGISTER_SECONDS.
await_workers() {
  local _
  for _ in $(seq 1 $((REGISTER_SECONDS * 2))); do
    [ "$(alive_workers)" -ge "$1" ] && return 0
    sleep 0.5
  done
  return 1
}

alive_workers() {
  curl -fsS "http://127.0.0.1:$webui/json/" 2>/dev/null |
    "$venv/bin/python" -c 'import json,sys; print(sum(w["state"]=="ALIVE" for w in json.load(sys.stdin)["workers"]))' 2>/dev/null || echo 0
}

start() {
  if alive "$dir/master.pid"; then
    echo "cluster already running at $url"; return 0
  fi
  export SPARK_HOME; SPARK_HOME=$(spark_home)
  export SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON="$venv/bin/python"
  mkdir -p "$dir"
  echo "[cluster] starting master at $url (web UI :$webui)"
  nohup "$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.master.Master \
    --host 127.0.0.1 --port "$port" --webui-port "$webui" >"$dir/master.log" 2>&1 &
  echo $! >"$dir/master.pid"
  for i in $(seq 1 "$workers"); do
    echo "[cluster] starting worker $i ($cores core, $memory)"
    mkdir -p "$dir/work-$i"
    start_worker "$i"
  done
  if await_workers "$workers"; then
    echo "[cluster] ready: $url with $workers workers ALIVE"; return 0
  fi
  echo "[cluster] workers did not register within $REGISTER_SECONDS s; logs in $dir" >&2
  tail -n 20 "$dir"/*.log >&2 || true
  stop
  return 1
}

stop() {
  for pidfile in "$dir"/worker-*.pid "$dir/master.pid"; do
    [ -f "$pidfile" ] || continue
    if alive "$pidfile"; then kill "$(cat "$pidfile")" 2>/dev/null || true; fi
  done
  for pidfile in "$dir"/worker-*.pid "$dir/master.pid"; do
    [ -f "$pidfile" ] || continue
    for _ in $(seq 1 20); do alive "$pidfile" || break; sleep 0.25; done
    if alive "$pidfile"; then kill -9 "$(cat "$pidfile")" 2>/dev/null || true; fi
    rm -f "$pidfile"
  done
  echo "[cluster] stopped"
}

kill_worker() {
  local pidfile="$dir/worker-$1.pid" pid
  if ! alive "$pidfile"; then
    echo "[cluster] worker $1 is not running (no live pid in $pidfile)" >&2; return 1
  fi
  pid=$(cat "$pidfile")
  kill -9 "$pid"
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  rm -f "$pidfile"
  echo "[cluster] killed worker $1 (pid $pid) for good"
}

add_worker() {
  export SPARK_HOME; SPARK_HOME=$(spark_home)
  export SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON="$venv/bin/python"
  local before; before=$(alive_workers)
  echo "[cluster] adding worker $1 ($cores core, $memory)"
  mkdir -p "$dir/work-$1"
  start_worker "$1"
  if await_workers $((before + 1)); then echo "[cluster] worker $1 ALIVE"; return 0; fi
  echo "[cluster] worker $1 did not register within $REGISTER_SECONDS s; its log: $dir/worker-$1.log" >&2
  return 1
}

status() {
  if alive "$dir/master.pid"; then
    echo "master $url running; $(alive_workers) workers ALIVE"
  else
    echo "not running"; return 3
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  kill-worker) [ -n "${2:-}" ] || { echo "usage: $0 kill-worker N" >&2; exit 2; }; kill_worker "$2" ;;
  add-worker) [ -n "${2:-}" ] || { echo "usage: $0 add-worker N" >&2; exit 2; }; add_worker "$2" ;;
  *) echo "usage: $0 start|stop|status|kill-worker N|add-worker N" >&2; exit 2 ;;
esac
