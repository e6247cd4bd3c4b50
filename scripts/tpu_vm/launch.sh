#!/usr/bin/env bash
# Run scripts/tpu_vm/train.py on every worker of a Cloud TPU VM slice.
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b scripts/tpu_vm/launch.sh --steps 2000 \
#       --checkpoint-dir gs://my-bucket/run1
#
# Optional: CREATE=1 (create the slice first, ACCELERATOR and VERSION below),
# PROJECT (default: gcloud's), ERROR_DIR (on each worker, default /tmp/jaxstep-errors),
# RESTARTS or --restarts N (default 0, a first argument: the rest go to train.py).
# Every worker runs the same command at the same time (--worker=all); there
# jax.distributed.initialize() finds the coordinator and the process ids itself.
# Each worker writes its JSON error report to ERROR_DIR; fetch them with
#   gcloud compute tpus tpu-vm scp --worker=all "$TPU_NAME:$ERROR_DIR/*" . --zone "$ZONE"
#
# Restarts (python -m jaxstep.launch --restarts's rule): when the first worker to fail
# exited with 75 (jaxstep.RESTART_EXIT_CODE: fit(recover=...) after a hang or a lost
# peer, its emergency save done) or was killed by a signal (a crash), the whole job
# runs again, up to RESTARTS times, with JAXSTEP_RESTART=<attempt> (0 first). Any other
# failure (exit code 1: a bug, an unrecovered error) is final. Each worker prints
# "jaxstep-exit CODE TIME HOST" when its run ends: "first" is the earliest TIME. So that
# a restart goes on from the last verified checkpoint, pass train.py --recover --resume
# --checkpoint-dir gs://... (docs/multihost.md, "Restarting after a hang"):
#   TPU_NAME=my-v4-32 ZONE=us-central2-b scripts/tpu_vm/launch.sh --restarts 3 \
#       --steps 2000 --checkpoint-dir gs://my-bucket/run1 --resume --recover --step-timeout 60
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME to the slice name}"
: "${ZONE:?set ZONE, e.g. us-central2-b}"
ACCELERATOR="${ACCELERATOR:-v4-32}"
VERSION="${VERSION:-tpu-ubuntu2204-base}"
ERROR_DIR="${ERROR_DIR:-/tmp/jaxstep-errors}"
REMOTE_DIR="jaxstep"
RESTARTS="${RESTARTS:-0}"
case "${1:-}" in
  --restarts) RESTARTS="${2:?--restarts needs a number}"; shift 2 ;;
  --restarts=*) RESTARTS="${1#--restarts=}"; shift ;;
esac
if ! [[ "$RESTARTS" =~ ^[0-9]+$ ]]; then
  echo "launch.sh: RESTARTS must be an integer >= 0, got '$RESTARTS'" >&2
  exit 2
fi
project_flag=()
if [[ -n "${PROJECT:-}" ]]; then project_flag=(--project "$PROJECT"); fi

tpu() { gcloud compute tpus tpu-vm "$@" --zone "$ZONE" "${project_flag[@]}"; }

if [[ "${CREATE:-0}" == "1" ]]; then
  tpu create "$TPU_NAME" --accelerator-type "$ACCELERATOR" --version "$VERSION"
fi

repo="$(cd "$(dirname "$0")/../.." && pwd)"
archive="$(mktemp -t jaxstep.XXXXXX).tar.gz"
log=""
trap 'rm -f "$archive" "${archive%.tar.gz}" "$log"' EXIT
git -C "$repo" archive --format=tar.gz -o "$archive" HEAD
tpu scp "$archive" "$TPU_NAME:jaxstep.tar.gz" --worker=all

# Set-up on every worker: unpack, install jaxstep with JAX for TPU.
tpu ssh "$TPU_NAME" --worker=all --command "
  set -e
  rm -rf $REMOTE_DIR && mkdir -p $REMOTE_DIR && tar -xzf jaxstep.tar.gz -C $REMOTE_DIR
  python3 -m venv ~/jaxstep-venv
  ~/jaxstep-venv/bin/pip install -q -U pip
  ~/jaxstep-venv/bin/pip install -q 'jax[tpu]' -e ./$REMOTE_DIR
"

# The exit code of the worker whose run ended first among those that failed (from the
# "jaxstep-exit CODE TIME HOST" lines in the log $1); nothing when none failed.
first_failure() {
  grep -ao 'jaxstep-exit [0-9]* [0-9.]*' "$1" | awk '$2 != 0 {print $3, $2}' | sort -g |
    awk 'NR == 1 {print $2}'
}

# The run: the same command on all workers at once, again after a restartable failure.
# Quote the arguments for the remote shell.
args=$(printf ' %q' "$@")
log="$(mktemp -t jaxstep-run.XXXXXX)"
attempt=0
while true; do
  set +e
  tpu ssh "$TPU_NAME" --worker=all --command "
    cd $REMOTE_DIR && JAXSTEP_RESTART=$attempt JAXSTEP_ERROR_DIR=$ERROR_DIR \
      ~/jaxstep-venv/bin/python scripts/tpu_vm/train.py $args
    code=\$?; echo \"jaxstep-exit \$code \$(date +%s.%N) \$(hostname)\"; exit \$code
  " 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  set -e
  code="$(first_failure "$log" || true)"
  if [[ -z "$code" ]]; then  # no worker reported a failure
    if [[ "$status" != 0 ]]; then
      echo "launch.sh: gcloud exited with $status, and no worker reported a failure" >&2
    fi
    exit "$status"
  fi
  if [[ "$code" == 75 ]]; then
    why="exited with code 75 (restart requested)"
  elif ((code > 128)); then
    why="was killed by signal $((code - 128)) (a crash)"
  else
    exit "$code"  # an ordinary failure: final
  fi
  if ((attempt >= RESTARTS)); then
    echo "launch.sh: the first worker to fail $why; no restart left (RESTARTS=$RESTARTS)" >&2
    exit "$code"
  fi
  attempt=$((attempt + 1))
  echo "launch.sh: the first worker to fail $why; restarting the job ($attempt of $RESTARTS)" >&2
done
