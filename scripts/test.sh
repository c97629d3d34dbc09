#!/usr/bin/env bash
# Command two: everything CI checks, from a fresh clone.
#   1. setup (apt packages, pinned nvcc wheels; idempotent)
#   2. cargo: cargo test --workspace --all-targets (hoccl and the NCCL library), the
#      collectives again with HOCCL_ENGINE=compressed, cargo test --doc (every test binary runs)
#   3. examples: every self-checking example under mpirun -np 2 and -np 4 (debug build:
#      it links the library cargo test built, so only the examples compile)
#   4. cmake: CMake configure, build, install; ctest --output-on-failure (which also builds
#      a consumer project against the installed package). CMake's cargo step shares target/
#      and the release profile with `cargo build --release` (scripts/demo.sh), so the
#      release library compiles once across the two scripts.
#   5. sanitize: the C and C++ checks of ctest/ built with AddressSanitizer and
#      UndefinedBehaviorSanitizer (-DHOCCL_SANITIZE=address,undefined, build/sanitize: only
#      those programs; the same release libraries) and run by `ctest -L sanitize`.
# Prints each part's summary and exits non-zero if anything failed. Examples that are
# expected but not written yet are reported as SKIPPED, never as passed. Tests that provoke
# errors on purpose keep the library's log to themselves unless they fail (ctest shows a
# test's output only then), so ERROR or WARN lines in a passing run are worth a look, except
# the one warning per run that bootstrap_check --user-init announces. Every part's log
# stays in build/test-logs/.
#
# An example is self-checking when its file has the line `//! hoccl-example: self-checking`;
# each `//! hoccl-example-run: ARGS` line adds a run with those arguments. It passes when
# every rank exits 0.
#   HOCCL_TEST_PARTS    the parts to run (default "cargo examples cmake sanitize")
#   HOCCL_TEST_NP       rank counts for the examples (default "2 4")
#   HOCCL_TEST_TIMEOUT  seconds per mpirun (default 300)
#   HOCCL_BUILD_DIR     CMake build dir (default build/cmake)
#   HOCCL_CUDA_ARCHS    the kernels' architectures (build.rs; default here: 80,90 with a GPU
#                       visible, 90 without one)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
root="$PWD"
target_dir="${CARGO_TARGET_DIR:-target}"
start=$SECONDS

[ -x "${HOME:-/root}/.cargo/bin/cargo" ] && export PATH="${HOME:-/root}/.cargo/bin:$PATH"
env_line="$(bash scripts/setup.sh | tail -n1)" || { echo "test: scripts/setup.sh failed" >&2; exit 1; }
export "${env_line:?setup printed nothing}"
# shellcheck source=mpi-env.sh
source scripts/mpi-env.sh
# Without a GPU no kernel runs here, so the kernels are compiled for one architecture
# (sm_90, the H200's) instead of build.rs's default 80,90: nvcc's per-architecture passes are
# most of a fresh build on a small machine. HOCCL_CUDA_ARCHS, when set, decides.
if [ -z "${HOCCL_CUDA_ARCHS:-}" ] && ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  export HOCCL_CUDA_ARCHS=90
  echo "test: no GPU visible: CUDA kernels compiled for sm_90 only (HOCCL_CUDA_ARCHS=90)"
fi

failed=()
summary=()
logs="$root/build/test-logs"
rm -rf "$logs" && mkdir -p "$logs"
stage() { echo; echo "==== $* ($((SECONDS - start)) s)"; }

# count LOG...: the sum of the `test result:` lines (one per test binary; doc-tests are one).
count() {
  awk '
  /^test result:/ { for (i = 1; i < NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) g += $i }; n++ }
  END { printf "%d passed, %d failed, %d ignored (%d test binaries)", p, f, g, n }' "$@"
}

# quiet NAME CMD...: CMD's output into $logs/NAME.log, shown only if CMD fails.
quiet() {
  local name=$1
  shift
  if "$@" > "$logs/$name.log" 2>&1; then
    echo "$name: ok"
  else
    cat "$logs/$name.log"
    echo "$name: FAILED"
    return 1
  fi
}

# ---------------------------------------------------------------- cargo test -------------
part_cargo() {
  stage "cargo test --workspace --all-targets"
  # --no-fail-fast: every test binary runs, so the summary counts them all.
  cargo test --workspace --all-targets --no-fail-fast 2>&1 | tee "$logs/cargo-test.log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("cargo test --workspace --all-targets")
  stage "collectives under HOCCL_ENGINE=compressed"
  HOCCL_ENGINE=compressed cargo test --test collectives 2>&1 | tee "$logs/cargo-compressed.log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("HOCCL_ENGINE=compressed cargo test --test collectives")
  stage "cargo test --doc"
  cargo test --doc --no-fail-fast 2>&1 | tee "$logs/cargo-doc.log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("cargo test --doc")
  summary+=("cargo test: $(count "$logs/cargo-test.log")")
  summary+=("collectives, compressed engine: $(count "$logs/cargo-compressed.log")")
  summary+=("doc-tests: $(count "$logs/cargo-doc.log")")
}

# ---------------------------------------------------------------- examples under MPI -----
part_examples() {
  stage "self-checking examples under mpirun"
  local expected=(bootstrap_check demo) skipped=() names=() srcs=() build=() pass=0 fail=0
  local src name i np extra label args runs
  for name in "${expected[@]}"; do
    [ -f "examples/$name.rs" ] || [ -f "examples/$name/main.rs" ] || skipped+=("$name (not written yet)")
  done
  for src in examples/*.rs examples/*/main.rs; do
    [ -f "$src" ] || continue
    if [ "${src##*/}" = main.rs ]; then name="$(basename "$(dirname "$src")")"; else name="$(basename "$src" .rs)"; fi
    if grep -q '^//! hoccl-example: self-checking' "$src"; then
      names+=("$name"); srcs+=("$src"); build+=(--example "$name")
    else
      echo "examples: $name is not self-checking; not run here"
    fi
  done
  # Only the self-checking examples are built as programs (cargo test compiled them all).
  if [ ${#names[@]} -gt 0 ]; then
    cargo build "${build[@]}" 2>&1 | tee "$logs/examples-build.log"
    if [ "${PIPESTATUS[0]}" != 0 ]; then
      failed+=("cargo build ${build[*]}")
      summary+=("examples: not run (build failed)")
      return
    fi
  fi
  for i in "${!names[@]}"; do
    name="${names[$i]}"
    runs=("")
    while IFS= read -r extra; do runs+=("$extra"); done < <(sed -n 's|^//! hoccl-example-run: *||p' "${srcs[$i]}")
    for np in ${HOCCL_TEST_NP:-2 4}; do
      for extra in "${runs[@]}"; do
        read -ra args <<< "$extra"
        label="$name${extra:+ $extra} -np $np"
        echo "---- $label"
        if timeout "${HOCCL_TEST_TIMEOUT:-300}" "${HOCCL_MPIRUN[@]}" -np "$np" "$target_dir/debug/examples/$name" "${args[@]}"; then
          pass=$((pass + 1))
        else
          fail=$((fail + 1)); failed+=("example: $label")
        fi
      done
    done
  done
  summary+=("examples: $pass passed, $fail failed, ${#skipped[@]} skipped${skipped[*]:+: ${skipped[*]}}")
}

# ---------------------------------------------------------------- CMake and CTest --------
part_cmake() {
  stage "CMake configure, build, install; ctest"
  local build="${HOCCL_BUILD_DIR:-build/cmake}"
  if quiet cmake-configure cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release \
     && cmake --build "$build" -j "$(nproc)" \
     && quiet cmake-install cmake --install "$build" --prefix "$root/$build/install"; then
    (cd "$build" && ctest --output-on-failure) 2>&1 | tee "$logs/ctest.log"
    [ "${PIPESTATUS[0]}" = 0 ] || failed+=("ctest")
    summary+=("ctest: $(grep -E 'tests passed, [0-9]+ tests? failed out of' "$logs/ctest.log" || echo 'no summary line')")
  else
    failed+=("CMake configure/build/install")
    summary+=("ctest: not run (CMake step failed)")
  fi
}

# ---------------------------------------------------------------- sanitizers -------------
# Only the C/C++ check programs are instrumented and run (label `sanitize`), not the whole
# suite again: about 100 s on 2 cores once the release libraries exist.
part_sanitize() {
  stage "C/C++ checks under AddressSanitizer and UndefinedBehaviorSanitizer"
  local build=build/sanitize
  if quiet sanitize-configure cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DHOCCL_SANITIZE=address,undefined -DHOCCL_BUILD_EXAMPLES=OFF \
     && quiet sanitize-build cmake --build "$build" -j "$(nproc)" --target hoccl_sanitized; then
    (cd "$build" && ctest -L sanitize --output-on-failure) 2>&1 | tee "$logs/ctest-sanitize.log"
    [ "${PIPESTATUS[0]}" = 0 ] || failed+=("ctest -L sanitize")
    summary+=("sanitizers: $(grep -E 'tests passed, [0-9]+ tests? failed out of' "$logs/ctest-sanitize.log" || echo 'no summary line')")
  else
    failed+=("sanitizer build")
    summary+=("sanitizers: not run (build failed)")
  fi
}

for part in ${HOCCL_TEST_PARTS:-cargo examples cmake sanitize}; do
  case "$part" in
    cargo | examples | cmake | sanitize) "part_$part" ;;
    *) echo "test: unknown part '$part' in HOCCL_TEST_PARTS (cargo, examples, cmake, sanitize)" >&2; exit 2 ;;
  esac
done

# ---------------------------------------------------------------- summary ----------------
stage "summary"
printf '%s\n' "${summary[@]}"
echo "total time: $((SECONDS - start)) s; logs in $logs/"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "test.sh: all passed"
