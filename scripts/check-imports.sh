#!/usr/bin/env bash
# Keeps the import direction of the layout: the public transfer library
# imports nothing under internal/, and the load balancer builds without the
# model engine.
set -euo pipefail
mod=$(go list -m)
fail=0
for p in $(go list ./pkg/transfer/...); do
  if go list -deps "$p" | grep -q "^$mod/internal/"; then
    case "$p" in
      */transfer/nvlink*|*/transfer/rdma*) ;;   # cgo transports bind internal/cuda, internal/ibv
      *) echo "$p imports internal/"; fail=1 ;;
    esac
  fi
done
if go list ./internal/lb >/dev/null 2>&1; then
  for bad in internal/engine internal/model internal/compute; do
    if go list -deps ./internal/lb | grep -q "^$mod/$bad"; then echo "internal/lb imports $bad"; fail=1; fi
  done
fi
exit $fail
