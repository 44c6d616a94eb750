#!/usr/bin/env bash
# Runs tensoralloc's checks against the real NVIDIA driver, on a machine with a GPU:
#   1. the C smoke suite (every c_examples/*.c), compiled against the built library and run
#      with the default driver (TENSORALLOC_DRIVER unset = cuda), and the C++ example
#      (c_examples/cpp) built against an installed copy (scripts/install);
#   2. the Rust GPU tests (`#[ignore]`d elsewhere), with --ignored;
#   3. the PyTorch training check (tests/gpu/pytorch_train.py) and the PyTorch hook checks
#      (tests/gpu/run-pytorch-suite.sh), when torch with CUDA is installed.
# Usage: tests/gpu/run-c-suite.sh   (from anywhere; builds in the repository's target/)
set -euo pipefail
cd "$(dirname "$0")/../.."
unset TENSORALLOC_DRIVER
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1' && [ -z "${LD_LIBRARY_PATH:-}" ]; then
  echo "warning: no libcuda.so.1 in the loader cache; the checks will fail if the driver cannot be found" >&2
fi
cargo build --release
lib=$PWD/target/release
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cc=${CC:-cc}
failed=0
for src in c_examples/*.c; do
  name=$(basename "$src" .c)
  "$cc" -std=c99 -Wall -Wextra -Werror -O1 -Iinclude "$src" -o "$out/$name" \
    -L"$lib" -ltensoralloc -lpthread -ldl -Wl,-rpath,"$lib"
  echo "== $name"
  if "$out/$name"; then echo "-- $name: ok"; else echo "-- $name: FAILED"; failed=1; fi
done
echo "== C++ example (c_examples/cpp), built with pkg-config against an installed tree"
if command -v pkg-config >/dev/null && command -v c++ >/dev/null; then
  scripts/install --lib "$lib/libtensoralloc.so" "$out/prefix"
  if PKG_CONFIG_LIBDIR="$out/prefix/lib/pkgconfig" make -s -C c_examples/cpp OUT="$out" && "$out/device_buffer"; then
    echo "-- device_buffer: ok"
  else
    echo "-- device_buffer: FAILED"; failed=1
  fi
else
  echo "-- no pkg-config or C++ compiler: skipping the C++ example"
fi
echo "== Rust GPU tests"
cargo test --release --test cuda_gpu -- --ignored || failed=1
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "== PyTorch training with tensoralloc"
  python3 tests/gpu/pytorch_train.py "$lib/libtensoralloc.so" || failed=1
  echo "== PyTorch hooks through the tensoralloc package"
  tests/gpu/run-pytorch-suite.sh || failed=1
else
  echo "== PyTorch with CUDA not installed: skipping tests/gpu/pytorch_train.py"
fi
if [ "$failed" -ne 0 ]; then echo "GPU checks FAILED"; exit 1; fi
echo "GPU checks passed"
