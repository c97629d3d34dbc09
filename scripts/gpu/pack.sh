#!/usr/bin/env bash
# Build release binaries here (the GPU machine has no Rust) and copy them into carry/
# (ignored by git; named in the device tool's `carry`): test executables under
# carry/tests/, examples and tools under carry/.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf carry && mkdir -p carry/tests
cargo build --release --bins --examples 2>&1 | grep -E "^(warning|error)" || true
cargo test --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] != ["bin"] and m["profile"]["test"]:
        name = m["target"]["name"]
        shutil.copy(m["executable"], os.path.join("carry/tests", name))
'
for f in target/release/examples/*; do
  [ -f "$f" ] && [ -x "$f" ] && case "$f" in *-*|*.d) ;; *) cp "$f" carry/ ;; esac
done
for f in target/release/hoccl-*; do [ -f "$f" ] && [ -x "$f" ] && cp "$f" carry/; done
# The codec script's layout (scripts/gpu/codec.sh run) and the kernels' register report.
for t in codec_cuda codec_cpu; do [ -f carry/tests/$t ] && cp carry/tests/$t carry/; done
[ -f target/release/examples/codec_bench ] && cp target/release/examples/codec_bench carry/
ptx=$(ls -t target/release/build/hoccl-*/out/ptxas.log 2>/dev/null | head -1)
[ -n "$ptx" ] && cp "$ptx" carry/ptxas.log
# C++ tests and example, when the CMake build (scripts/test.sh) has made them.
if [ -d build/cmake/ctest ]; then
  mkdir -p carry/cpp
  for f in build/cmake/ctest/*_check build/cmake/examples/cpp/allgather_demo; do [ -x "$f" ] && cp "$f" carry/cpp/; done
fi
rm -f carry/tests/codec_* carry/cpp/version_check   # codec.sh runs the codec tests from carry/
find carry -type f -perm -u+x ! -name "*.sh" -exec strip --strip-debug {} +
# Hang diagnostics (scripts/gpu/catch-hang.sh): a backtrace-on-SIGUSR2 preload and tgkill.
if command -v gcc > /dev/null; then
  mkdir -p carry/stacks
  gcc -O1 -g -shared -fPIC -o carry/stacks/libbt.so scripts/gpu/stacks/bt.c
  gcc -O1 -static -o carry/stacks/tgk scripts/gpu/stacks/tgk.c
fi
# The device tool carries at most 64 MiB: ship one compressed bundle; all.sh unpacks it.
tar cf - -C carry . | xz -T2 -6 > /tmp/hoccl-bundle.txz
find carry -mindepth 1 -delete
mv /tmp/hoccl-bundle.txz carry/bundle.txz
du -sh carry
