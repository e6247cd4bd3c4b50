#!/usr/bin/env bash
# Run scripts/tpu_vm/train.py on every worker of a Cloud TPU VM slice.
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b scripts/tpu_vm/launch.sh --steps 2000 \
#       --checkpoint-dir gs://my-bucket/run1
#
# Optional: CREATE=1 (create the slice first, ACCELERATOR and VERSION below),
# PROJECT (default: gcloud's), ERROR_DIR (on each worker, default /tmp/jaxstep-errors).
# Every worker runs the same command at the same time (--worker=all); there
# jax.distributed.initialize() finds the coordinator and the process ids itself.
# Each worker writes its JSON error report to ERROR_DIR; fetch them with
#   gcloud compute tpus tpu-vm scp --worker=all "$TPU_NAME:$ERROR_DIR/*" . --zone "$ZONE"
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME to the slice name}"
: "${ZONE:?set ZONE, e.g. us-central2-b}"
ACCELERATOR="${ACCELERATOR:-v4-32}"
VERSION="${VERSION:-tpu-ubuntu2204-base}"
ERROR_DIR="${ERROR_DIR:-/tmp/jaxstep-errors}"
REMOTE_DIR="jaxstep"
project_flag=()
if [[ -n "${PROJECT:-}" ]]; then project_flag=(--project "$PROJECT"); fi

tpu() { gcloud compute tpus tpu-vm "$@" --zone "$ZONE" "${project_flag[@]}"; }

if [[ "${CREATE:-0}" == "1" ]]; then
  tpu create "$TPU_NAME" --accelerator-type "$ACCELERATOR" --version "$VERSION"
fi

repo="$(cd "$(dirname "$0")/../.." && pwd)"
archive="$(mktemp -t jaxstep.XXXXXX).tar.gz"
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

# The run: the same command on all workers at once. Quote the arguments for the remote shell.
args=$(printf ' %q' "$@")
tpu ssh "$TPU_NAME" --worker=all --command "
  cd $REMOTE_DIR && JAXSTEP_ERROR_DIR=$ERROR_DIR ~/jaxstep-venv/bin/python scripts/tpu_vm/train.py $args
"
