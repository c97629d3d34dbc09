#!/usr/bin/env bash
# Command one: set up, build in release, and run the collectives demo (examples/demo.rs)
# on 4 ranks of this machine. Works without a GPU (host backend) and on GPU machines. The
# release library it builds is the one scripts/test.sh's CMake step links (same target/ and
# profile), so it compiles once.
#   HOCCL_DEMO_NP   number of ranks (default 4)
# Extra arguments are passed to the demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

[ -x "${HOME:-/root}/.cargo/bin/cargo" ] && export PATH="${HOME:-/root}/.cargo/bin:$PATH"
env_line="$(bash scripts/setup.sh | tail -n1)"
export "${env_line:?setup printed nothing}"
# shellcheck source=mpi-env.sh
source scripts/mpi-env.sh

cargo build --release --example demo
np="${HOCCL_DEMO_NP:-4}"
echo "demo: mpirun -np $np ${CARGO_TARGET_DIR:-target}/release/examples/demo $*" >&2
exec "${HOCCL_MPIRUN[@]}" -np "$np" "${CARGO_TARGET_DIR:-target}/release/examples/demo" "$@"
