#!/usr/bin/env bash
# Runs the PyTorch hook checks (tests/gpu/pytorch_hooks.py) on a machine with an NVIDIA GPU:
# installs the `tensoralloc` package (release build of the library) into a virtual environment
# that sees the system's PyTorch, then builds the extension and checks its hooks on the
# simulated device (tests/python/torch_extension_check.py) and on the GPU.
# Usage: tests/gpu/run-pytorch-suite.sh [CHECK...]   (needs torch with CUDA, c++ and ninja)
set -euo pipefail
cd "$(dirname "$0")/../.."
unset TENSORALLOC_DRIVER
cargo build --release --lib
root=$PWD
venv=$root/target/gpu-venv
python3 -m venv --system-site-packages --clear "$venv"
TENSORALLOC_LIB=$root/target/release/libtensoralloc.so \
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check ./python
"$venv/bin/python" -c 'import torch.utils.cpp_extension as c, sys; sys.exit(0 if c.is_ninja_available() else 1)' \
  || "$venv/bin/python" -m pip install --quiet ninja
# PyTorch's CUDA headers include crt/host_config.h, which PyTorch's wheels do not install.
if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null; then
  cuda=$("$venv/bin/python" -c 'import torch; print(".".join(torch.version.cuda.split(".")[:2]))')
  "$venv/bin/python" -m pip install --quiet "nvidia-cuda-crt==$cuda.*"
fi
# A fresh extension cache, so the run also checks that the extension builds.
rm -rf "$root/target/gpu-torch-extension"
export TENSORALLOC_TORCH_CACHE=$root/target/gpu-torch-extension
# From outside the repository, so `import tensoralloc` is the installed package.
cd "$venv"
echo "== the extension's hooks through PyTorch's C++ entry points (simulated device)"
TENSORALLOC_DRIVER=sim bin/python "$root/tests/python/torch_extension_check.py"
echo "== PyTorch hook checks on the GPU"
bin/python "$root/tests/gpu/pytorch_hooks.py" "$@"
