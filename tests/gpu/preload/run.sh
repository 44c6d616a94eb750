#!/usr/bin/env bash
# Builds libtensoralloc_preload.so (release) and preload_check.cu three times with nvcc (static
# and shared CUDA runtime, and shared with `--default-stream per-thread`, whose stream-ordered
# calls are the runtime's `_ptsz` functions), then runs each build without and with the preload
# on the real GPU.
# Every run must pass its checks; preloaded runs must show (TENSORALLOC_PRELOAD_STATS=1) that
# their allocations were served by tensoralloc, which for the static runtime proves that the
# driver calls it makes through cuGetProcAddress are intercepted.
# Usage: tests/gpu/preload/run.sh   (needs nvcc on PATH, or NVCC=/path/to/nvcc)
set -euo pipefail
cd "$(dirname "$0")/../../.."
nvcc=${NVCC:-nvcc}
out=target/gpu-preload
mkdir -p "$out"
cargo build --release -p tensoralloc_preload
lib=$PWD/target/release/libtensoralloc_preload.so
for runtime in static shared; do
  "$nvcc" -O2 -std=c++17 -cudart "$runtime" -o "$out/preload_check_$runtime" tests/gpu/preload/preload_check.cu
done
"$nvcc" -O2 -std=c++17 -cudart shared --default-stream per-thread -o "$out/preload_check_ptds" \
  tests/gpu/preload/preload_check.cu
status=0
for runtime in static shared ptds; do
  exe=$out/preload_check_$runtime
  echo "== $runtime runtime, without the preload"
  "$exe" || status=1
  echo "== $runtime runtime, with the preload"
  if ! LD_PRELOAD=$lib TENSORALLOC_PRELOAD_STATS=1 "$exe" 2> "$out/stats_$runtime.txt"; then
    status=1
  fi
  cat "$out/stats_$runtime.txt"
  served=$(sed -n 's/^tensoralloc preload: \([0-9]*\) device allocations served.*/\1/p' "$out/stats_$runtime.txt")
  if [ -z "$served" ] || [ "$served" -eq 0 ]; then
    echo "FAIL: the $runtime-runtime build's allocations did not go through tensoralloc" >&2
    status=1
  fi
done
[ "$status" -eq 0 ] && echo "preload GPU checks passed"
exit "$status"
