#!/usr/bin/env bash
# On the build machine: the backtraces of a catch-hang.sh log, one block per thread, with
# the program's frames turned into functions (addr2line on BINARY, the unstripped build of
# the binary that ran: pack.sh strips only debug info, so offsets match) and the driver's
# exported names kept. Symbolize before rebuilding: a rebuild replaces BINARY in place.
#   bash scripts/gpu/symbolize.sh hang-1.log.gz target/release/deps/collectives-<hash>
set -euo pipefail
log=$1; bin=$2
name=$(basename "$bin" | sed 's/-[0-9a-f]\{16\}$//')
(zcat -f "$log") | awk '/^== BT /,/^== END/' | while IFS= read -r line; do
  case "$line" in
    "== BT "*) echo "${line#== BT }" ;;
    "== END") echo ;;
    *"$name("+0x*)
      a=$(echo "$line" | grep -o '(+0x[0-9a-f]*)' | tr -d '(+)')
      addr2line -e "$bin" -f -C -i "$a" | paste - - | awk -F'\t' '{ printf "    %s  %s\n", substr($1, 1, 100), $2 }' ;;
    *libcuda*|*libc.so*|*libpthread*)
      echo "$line" | grep -o '([A-Za-z_][A-Za-z_0-9]*+0x[0-9a-f]*)' | sed 's/^/    /' || true ;;
  esac
done
