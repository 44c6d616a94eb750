"""Builds and installs the PyTorch extension (tensoralloc.torch.install()) and drives its hooks
through PyTorch's own C++ entry points, on the simulated device: needs PyTorch (a CUDA build,
with its nvidia-* wheels, plus nvidia-cuda-crt for the headers), a C++ compiler and ninja, but
no GPU. PyTorch's CUDA runtime is never initialized; everything goes through the allocator
object the extension made current.

Usage: TENSORALLOC_DRIVER=sim python tests/python/torch_extension_check.py
(with the `tensoralloc` package installed in the same environment as torch)
"""

import ctypes
import time

import tensoralloc.torch as ta
import torch

MiB = 1 << 20


def main():
    start = time.time()
    ta.install()
    print(f"install: {time.time() - start:.1f} s")
    assert ta.installed() and not torch.cuda.is_initialized()
    ta.install()  # a second call does nothing

    lib = ctypes.CDLL(ta.library_path())
    lib.tensoralloc_malloc.restype = ctypes.c_void_p
    lib.tensoralloc_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.tensoralloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    # Statistics: PyTorch's getDeviceStats is tensoralloc's.
    p = lib.tensoralloc_malloc(MiB, 0, None)
    nested = torch._C._cuda_memoryStats(0)
    assert nested["allocated_bytes"]["all"]["current"] == ta.memory_allocated(0) >= MiB
    assert nested == ta.memory_stats_as_nested_dict(0)
    lib.tensoralloc_free(p, MiB, 0, None)
    torch._C._cuda_resetPeakMemoryStats(0)
    assert ta.max_memory_allocated(0) == ta.memory_allocated(0)

    # Memory fraction, both ways.
    torch._C._cuda_setMemoryFraction(0.5, 0)
    assert ta.get_per_process_memory_fraction(0) == 0.5
    ta.set_per_process_memory_fraction(0.25, 0)
    assert torch._C._cuda_getMemoryFraction(0) == 0.25
    torch._C._cuda_setMemoryFraction(1.0, 0)

    # empty_cache is the reset hook.
    assert ta.memory_reserved(0) > 0
    torch._C._cuda_emptyCache()
    assert ta.memory_reserved(0) == 0

    # Graph pools: PyTorch's stream filter (here: "allocations of this thread") reaches
    # tensoralloc; a block of the pool is not handed out outside it.
    pool = (7, 9)
    torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
    p = lib.tensoralloc_malloc(MiB, 0, None)
    lib.tensoralloc_free(p, MiB, 0, None)
    torch._C._cuda_endAllocateToPool(0, pool)
    q = lib.tensoralloc_malloc(MiB, 0, None)
    assert q != p, "a block of the graph pool was reused outside it"
    lib.tensoralloc_free(q, MiB, 0, None)
    torch._C._cuda_releasePool(0, pool)
    try:
        torch._C._cuda_endAllocateToPool(0, pool)
    except RuntimeError as e:
        assert "no allocation to pool (7, 9)" in str(e), e
    else:
        raise AssertionError("ending a pool that was not begun succeeded")
    # A failed release warns instead of throwing (PyTorch calls it from destructors).
    torch._C._cuda_releasePool(0, (5, 5))

    # torch.compile's CUDA-graph trees: a checkpoint can be taken, restoring one says why not.
    state = torch._C._cuda_getCheckpointState(0, (7, 9))
    try:
        torch._C._cuda_setCheckpointPoolState(0, state, [], [])
    except RuntimeError as e:
        assert "cudagraph_trees = False" in str(e), e
    else:
        raise AssertionError("restoring a graph pool checkpoint succeeded")
    print("the PyTorch extension works: statistics, fraction, empty_cache, graph pools and checkpoints")


if __name__ == "__main__":
    main()
