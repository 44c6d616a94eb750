"""Loads libtensoralloc.so exactly as PyTorch's CUDAPluggableAllocator does (ctypes.CDLL, the
two symbols by name, their addresses as c_void_p) and calls the allocator through those
addresses with the function types PyTorch uses. Needs no torch.

Usage: python3 pluggable_allocator.py /path/to/libtensoralloc.so
"""

import ctypes
import sys


def main(path):
    lib = ctypes.CDLL(path)
    # torch.cuda.memory.CUDAPluggableAllocator does exactly this with the names it is given.
    alloc_addr = ctypes.cast(getattr(lib, "tensoralloc_malloc"), ctypes.c_void_p).value
    free_addr = ctypes.cast(getattr(lib, "tensoralloc_free"), ctypes.c_void_p).value
    assert alloc_addr and free_addr, "symbols not found"

    # The C++ side casts the addresses to void*(size_t, int, cudaStream_t) and
    # void(void*, size_t, int, cudaStream_t).
    alloc_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    free_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    alloc = alloc_t(alloc_addr)
    free = free_t(free_addr)
    lib.tensoralloc_last_error.restype = ctypes.c_char_p

    stream = ctypes.c_void_p(0x700)
    sizes = [1, 512, 4096, 1 << 20, (1 << 20) + 1, 25 << 20]
    ptrs = []
    for size in sizes:
        p = alloc(size, 0, stream)
        assert p, f"alloc({size}) failed: {lib.tensoralloc_last_error()!r}"
        ctypes.memset(p, 0x5A, size)
        ptrs.append((p, size))
    spans = sorted((p, p + s) for p, s in ptrs)
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0, "allocations overlap"

    for p, size in ptrs:
        free(p, size, 0, stream)
        assert lib.tensoralloc_last_error() == b"", lib.tensoralloc_last_error()

    # Freed memory is cached and reused on the same stream.
    p = alloc(4096, 0, stream)
    assert p in [q for q, _ in ptrs], "cached block reused"
    free(p, 4096, 0, stream)

    # Bad input through the same function pointers: NULL with a reason, never a crash.
    assert alloc(0, 0, stream) is None
    assert alloc(64, 42, stream) is None
    assert b"device 42" in lib.tensoralloc_last_error()
    free(None, 0, 0, stream)
    free(p, 4096, 0, stream)  # double free
    assert b"not a live allocation" in lib.tensoralloc_last_error()

    lib.tensoralloc_empty_cache()
    print("PyTorch-style loading works: %d allocations through the pluggable function pointers" % len(sizes))


if __name__ == "__main__":
    main(sys.argv[1])
