# shellcheck shell=bash
# Sourced by the scripts of scripts/gpu/ (not run on its own): the repository root as the
# working directory, the binaries, where logs and results go, and the run environment.
#
#   HOCCL_BIN_DIR      a folder of prebuilt binaries, made by scripts/gpu/build.sh (on this
#                      machine, or on another one and copied here, for a GPU machine without
#                      Rust). Unset: build/gpu-bin, which build.sh fills first when cargo is
#                      installed. A bundle.txz in it (build.sh --archive) is unpacked first.
#   HOCCL_MACHINE      the name of the results folder, docs/results/<name> (default: from
#                      nvidia-smi, e.g. h200-1gpu, h200-4gpu)
#   HOCCL_RESULTS_DIR  where results go (default docs/results/$HOCCL_MACHINE)
#   HOCCL_GPU_LOGS     where each command's full log goes (default build/gpu-logs)
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
root=$PWD

# Single-host Open MPI settings (root, containers, more ranks than cores).
# shellcheck source=../mpi-env.sh
source scripts/mpi-env.sh
# NCCL's NVLink multicast (NVLS) stays off in every run: hoccl's comparison is with NCCL's
# other paths, and on a host whose GPUs others share, a program using multicast objects can
# put those GPUs out of service.
export NCCL_NVLS_ENABLE=0
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"
# The test binaries read their fixtures from here (cargo sets it when it runs them).
export HOCCL_TEST_DATA="$root/tests/data"

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
ngpu=${ngpu:-0}

# The results folder's name: the GPU model's last word and the GPU count (h200-1gpu).
machine_name() {
  local model
  model=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)
  model=${model##* }
  model=$(echo "${model:-nogpu}" | tr '[:upper:]' '[:lower:]' | tr -c 'a-z0-9\n' '-')
  echo "$model-${ngpu}gpu"
}
machine="${HOCCL_MACHINE:-$(machine_name)}"
results="${HOCCL_RESULTS_DIR:-$root/docs/results/$machine}"
logs="${HOCCL_GPU_LOGS:-$root/build/gpu-logs}"
mkdir -p "$results" "$logs"

bin="${HOCCL_BIN_DIR:-$root/build/gpu-bin}"
if [ -z "${HOCCL_BIN_DIR:-}" ] && [ ! -d "$bin" ]; then
  if command -v cargo >/dev/null 2>&1 || [ -x "${HOME:-/root}/.cargo/bin/cargo" ]; then
    bash scripts/gpu/build.sh || exit 2
  else
    echo "$(basename "$0"): no binaries: set HOCCL_BIN_DIR to a folder made by scripts/gpu/build.sh, or install Rust" >&2
    exit 2
  fi
fi
bin="$(cd "$bin" && pwd)"
if [ -f "$bin/bundle.txz" ]; then
  tar xJf "$bin/bundle.txz" -C "$bin" && rm -f "$bin/bundle.txz"
fi

# The commit the binaries were built from (build.sh records it; a folder of binaries may
# come from another checkout than the one the scripts run in).
built=$(cat "$bin/commit.txt" 2>/dev/null || echo unknown)

# record RESULT COMMAND: write RESULT.cmd, saying which command (one string) made the result
# file RESULT, run from the repository root, with the date, the commit and the machine.
# Paths are written relative to the repository root, and the binaries as $HOCCL_BIN_DIR.
record() {
  local cmd=${2//$bin/\$HOCCL_BIN_DIR}
  cmd=${cmd//$root\//}
  {
    echo "# $(date -u +%FT%TZ), binaries of commit $built, $ngpu GPU(s) ($machine)"
    echo "$cmd"
  } > "$1.cmd"
}

# need PROGRAM...: exit 2 unless each is an executable of the binaries folder.
need() {
  local p
  for p in "$@"; do
    [ -x "$bin/$p" ] || { echo "$(basename "$0"): $bin/$p missing (scripts/gpu/build.sh makes it)" >&2; exit 2; }
  done
}
