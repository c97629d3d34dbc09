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
find carry -type f -perm -u+x ! -name "*.sh" -exec strip --strip-debug {} +
du -sh carry; ls carry carry/tests
