#!/usr/bin/env bash
# CTest wrapper: run a program under mpirun with the repository's single-host Open MPI
# settings.   mpirun.sh NP PROGRAM [ARGS...]
# HOCCL_TEST_TIMEOUT (seconds, default 300) bounds the run so a hung rank fails the test.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 NP PROGRAM [ARGS...]" >&2
  exit 2
fi
np="$1"
shift
# shellcheck source=../scripts/mpi-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/mpi-env.sh"
exec timeout "${HOCCL_TEST_TIMEOUT:-300}" "${HOCCL_MPIRUN[@]}" -np "$np" "$@"
