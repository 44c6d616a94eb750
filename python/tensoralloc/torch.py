"""tensoralloc as PyTorch's CUDA allocator, with every hook.

    import tensoralloc.torch
    tensoralloc.torch.install()   # first thing, before any CUDA call

`install()` compiles a small PyTorch C++ extension from the bundled `tensoralloc_torch.hpp`
against the installed torch (once; later processes load the cached build) and makes
tensoralloc the current allocator with allocation, free, record_stream, empty_cache, init,
memory fraction, base allocation, CUDA-graph pools and statistics wired to it. Afterwards
`torch.cuda.memory_stats()` and the functions built on it report tensoralloc's statistics; the
same functions are here too, taking PyTorch's current device when `device` is None.
"""

import hashlib
import os
import shutil
import sys
import threading

import tensoralloc as _ta

# The statistics and controls, re-exported: with `device` None they take PyTorch's current
# device once PyTorch has started CUDA.
from tensoralloc import *  # noqa: F401,F403

__all__ = ["InstallError", "install", "installed"] + _ta.__all__

# The translation unit of the extension: load_inline adds <torch/extension.h> and the Python
# binding of `install`.
_EXTENSION_SOURCE = """
#include <tensoralloc_torch.hpp>

void install() { tensoralloc::torch::install(); }
"""


class InstallError(RuntimeError):
    """tensoralloc cannot be installed into PyTorch here; the message says why and what to do."""


_installed = False
_install_lock = threading.Lock()


def installed():
    """Whether install() made tensoralloc PyTorch's allocator in this process."""
    return _installed


def _import_torch():
    try:
        import torch
    except ImportError as e:
        raise InstallError(
            f"PyTorch is not installed for this Python ({sys.executable}): "
            f"tensoralloc.torch.install() needs it ({e}). Install a CUDA build of PyTorch, "
            "e.g. `pip install torch`, or use tensoralloc without PyTorch through the "
            "functions of the `tensoralloc` module."
        ) from None
    return torch


def _cuda_include_dirs(torch):
    """Directories with the CUDA runtime headers that PyTorch's CUDA headers include:
    cuda_runtime_api.h and crt/host_config.h, from $CUDA_HOME/include, else from the NVIDIA
    wheels (nvidia/*/include; the second one is in nvidia-cuda-crt, which PyTorch does not
    install)."""
    candidates = []
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # pragma: no cover - torch without cpp_extension
        CUDA_HOME = None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), CUDA_HOME):
        if home:
            candidates.append(os.path.join(home, "include"))
    for entry in sys.path:
        nvidia = os.path.join(entry or ".", "nvidia")
        if os.path.isdir(nvidia):
            candidates.append(os.path.join(nvidia, "include"))
            for name in sorted(os.listdir(nvidia)):
                candidates.append(os.path.join(nvidia, name, "include"))
    found = []
    for header in ("cuda_runtime_api.h", os.path.join("crt", "host_config.h")):
        where = next((d for d in candidates if os.path.isfile(os.path.join(d, header))), None)
        if where is None:
            major_minor = ".".join(str(torch.version.cuda).split(".")[:2])
            package = "nvidia-cuda-runtime" if header.endswith("api.h") else "nvidia-cuda-crt"
            raise InstallError(
                f"the CUDA header {header} was not found, in $CUDA_HOME/include nor in the "
                "nvidia/*/include directories of the NVIDIA wheels, and PyTorch's CUDA headers "
                "need it: install the CUDA toolkit and set CUDA_HOME, or "
                f"`pip install \"{package}=={major_minor}.*\"` (PyTorch's CUDA {torch.version.cuda})."
            )
        if where not in found:
            found.append(where)
    return found


def _check_can_install(torch):
    if torch.version.cuda is None or not torch.backends.cuda.is_built():
        raise InstallError(
            f"this PyTorch ({torch.__version__}) is built without CUDA, so it has no CUDA "
            "allocator to replace: install a CUDA build of PyTorch "
            "(https://pytorch.org/get-started/locally/)."
        )
    if torch.cuda.is_initialized():
        raise InstallError(
            "CUDA is already initialized in this process, and PyTorch cannot swap the allocator "
            "of an initialized CUDA runtime: call tensoralloc.torch.install() first, before "
            "anything that touches CUDA (creating CUDA tensors, .cuda(), .to('cuda'), "
            "torch.cuda.* calls other than is_available())."
        )
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise InstallError(
            f"no C++ compiler ({compiler!r}, from $CXX or the default c++) is on PATH: "
            "tensoralloc.torch.install() compiles a small extension against your PyTorch. "
            "Install one (e.g. `apt-get install g++`) or point CXX at it."
        )
    from torch.utils.cpp_extension import is_ninja_available

    # The ninja of `pip install ninja` is in this environment's bin directory, which is not on
    # PATH when Python runs without the environment being activated.
    scripts = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.isfile(os.path.join(scripts, "ninja")):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    if not is_ninja_available():
        raise InstallError(
            "ninja is not available, and PyTorch builds extensions with it: `pip install ninja`."
        )


def _cache_dir(torch, sources):
    """The build directory of the extension, keyed by the torch version and every input."""
    digest = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.cuda), sys.version, _ta.library_path()):
        digest.update(part.encode())
    for source in sources:
        digest.update(source)
    key = digest.hexdigest()[:16]
    root = os.environ.get("TENSORALLOC_TORCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "tensoralloc",
        "torch-extension",
    )
    path = os.path.join(root, key)
    os.makedirs(path, exist_ok=True)
    return key, path


def _config_string(config):
    if isinstance(config, str):
        return config
    if isinstance(config, dict):
        return ",".join(f"{key}:{value}" for key, value in config.items())
    raise TypeError(f"config must be a TENSORALLOC_CONF string or a dict, not {type(config).__name__}")


def install(config=None, verbose=False):
    """Makes tensoralloc PyTorch's CUDA allocator for this process, with every hook.

    `config` (a TENSORALLOC_CONF string such as "max_split_size_mb:128", or a dict of the same
    options) is put in TENSORALLOC_CONF first; the library reads it when it initializes. Call
    this before anything touches CUDA. The first call for a given torch builds the extension
    (tens of seconds); later ones load it from the cache (~/.cache/tensoralloc, or
    $TENSORALLOC_TORCH_CACHE). Calling it again after it succeeded does nothing.

    Raises InstallError, saying why and what to do, when PyTorch is missing or built without
    CUDA, CUDA is already initialized, or no C++ compiler, ninja or CUDA headers are found.
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        torch = _import_torch()
        _check_can_install(torch)
        cuda_includes = _cuda_include_dirs(torch)
        if config is not None:
            os.environ["TENSORALLOC_CONF"] = _config_string(config)
        include = _ta.include_dir()
        sources = [_EXTENSION_SOURCE.encode()]
        for name in ("tensoralloc.h", "tensoralloc_torch.hpp"):
            with open(os.path.join(include, name), "rb") as f:
                sources.append(f.read())
        key, build_dir = _cache_dir(torch, sources)
        # Loading the library first, with global symbols, makes the extension and the
        # statistics functions of this package share one allocator.
        _ta._library()
        lib_dir = os.path.dirname(_ta.library_path())
        torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        from torch.utils.cpp_extension import load_inline

        try:
            module = load_inline(
                name=f"tensoralloc_torch_{key}",
                cpp_sources=[_EXTENSION_SOURCE],
                functions=["install"],
                extra_include_paths=[include, *cuda_includes],
                extra_cflags=["-O2"],
                extra_ldflags=[
                    f"-L{torch_lib}",
                    "-ltorch_cuda",
                    "-lc10_cuda",
                    f"-L{lib_dir}",
                    "-ltensoralloc",
                    f"-Wl,-rpath,{lib_dir}",
                ],
                build_directory=build_dir,
                with_cuda=False,
                verbose=verbose,
            )
        except Exception as e:
            raise InstallError(
                f"building the tensoralloc extension for PyTorch {torch.__version__} in "
                f"{build_dir} failed: {e}. Run tensoralloc.torch.install(verbose=True) to see "
                "the compiler's output."
            ) from e
        module.install()
        _installed = True
