"""Checks the installed `tensoralloc` Python package on the simulated device (or whatever
TENSORALLOC_DRIVER selects), without PyTorch: the bundled library, the statistics with
torch.cuda.memory_stats()'s keys and the C struct's values, the summary, the memory fraction,
and the errors of tensoralloc.torch.install() where PyTorch cannot take the allocator.

Run with the Python of a virtual environment where `pip install ./python` was done, from a
directory outside the repository (so `import tensoralloc` finds the installed package).
"""

import ctypes
import os
import sys
import tempfile
import types

import tensoralloc
import tensoralloc.torch as ta_torch

MiB = 1 << 20

# torch.cuda.memory_stats()'s keys: each statistic array by pool and field, the two oversize
# statistics by field, and the plain counters.
ARRAYS = [
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
]
POOLS = ["all", "small_pool", "large_pool"]
FIELDS = ["current", "peak", "allocated", "freed"]
COUNTERS = [
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "max_split_size",
]


def raw_struct(lib, device):
    """tensoralloc_device_stats read as the 123 int64 words it is made of, by position: nine
    arrays of three stats of four words, two counters, two stats, five counters, and
    num_invalid_frees."""
    words = (ctypes.c_int64 * 123)()
    assert lib.tensoralloc_get_device_stats(device, ctypes.byref(words)) == 0
    expected = {}
    for a, name in enumerate(ARRAYS):
        for p, pool in enumerate(POOLS):
            for f, field in enumerate(FIELDS):
                expected[f"{name}.{pool}.{field}"] = words[a * 12 + p * 4 + f]
    expected["num_alloc_retries"] = words[108]
    expected["num_ooms"] = words[109]
    for s, name in enumerate(["oversize_allocations", "oversize_segments"]):
        for f, field in enumerate(FIELDS):
            expected[f"{name}.{field}"] = words[110 + s * 4 + f]
    for c, name in enumerate(["num_sync_all_streams", "num_device_alloc", "num_device_free", "max_split_size"]):
        expected[name] = words[118 + c]
    return expected


def expect_raises(kind, text, fn, *args):
    try:
        fn(*args)
    except kind as e:
        assert text in str(e), f"{kind.__name__} without {text!r}: {e}"
        return e
    raise AssertionError(f"{fn.__name__}{args} did not raise {kind.__name__}")


def check_library_is_bundled():
    path = tensoralloc.library_path()
    assert os.path.isfile(path), path
    assert os.path.dirname(path) == os.path.dirname(os.path.abspath(tensoralloc.__file__))
    assert os.path.realpath(path).startswith(os.path.realpath(sys.prefix)), (path, sys.prefix)
    for header in ("tensoralloc.h", "tensoralloc_torch.hpp"):
        assert os.path.isfile(os.path.join(tensoralloc.include_dir(), header)), header


def check_statistics(lib):
    alloc = lib.tensoralloc_malloc
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = lib.tensoralloc_free
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    stream = ctypes.c_void_p(0x800)

    tensoralloc.empty_cache()
    before = tensoralloc.memory_stats(0)
    sizes = [100, 512, 3 * MiB + 1]
    ptrs = [alloc(size, 0, stream) for size in sizes]
    assert all(ptrs), tensoralloc._last_error()

    stats = tensoralloc.memory_stats(0)
    expected_keys = (
        [f"{a}.{p}.{f}" for a in ARRAYS for p in POOLS for f in FIELDS]
        + [f"{s}.{f}" for s in ("oversize_allocations", "oversize_segments") for f in FIELDS]
        + COUNTERS
    )
    assert sorted(stats) == sorted(expected_keys), set(stats) ^ set(expected_keys)
    assert list(stats) == sorted(stats), "keys are sorted, as torch.cuda.memory_stats() sorts them"
    assert all(type(v) is int for v in stats.values())
    assert stats == raw_struct(lib, 0), "every value is the C struct's"

    grew = {k: stats[k] - before[k] for k in stats}
    assert grew["allocation.all.current"] == 3
    assert grew["allocation.small_pool.current"] == 2
    assert grew["allocation.large_pool.current"] == 1
    assert grew["requested_bytes.all.current"] == sum(sizes)
    # Client sizes are rounded up to 512 bytes.
    assert grew["allocated_bytes.all.current"] == 512 + 512 + (3 * MiB + 512)
    assert tensoralloc.memory_allocated(0) == stats["allocated_bytes.all.current"]
    assert tensoralloc.memory_reserved(0) == stats["reserved_bytes.all.current"] >= tensoralloc.memory_allocated(0)
    assert tensoralloc.memory_stats_as_nested_dict(0)["allocated_bytes"]["all"]["current"] == tensoralloc.memory_allocated(0)

    peak = tensoralloc.max_memory_allocated(0)
    for p, size in zip(ptrs, sizes):
        free(p, size, 0, stream)
    assert tensoralloc.memory_allocated(0) == before["allocated_bytes.all.current"]
    assert tensoralloc.max_memory_allocated(0) == peak > tensoralloc.memory_allocated(0)
    tensoralloc.reset_peak_memory_stats(0)
    assert tensoralloc.max_memory_allocated(0) == tensoralloc.memory_allocated(0)
    assert tensoralloc.max_memory_reserved(0) == tensoralloc.memory_reserved(0)

    assert tensoralloc.memory_reserved(0) > 0, "freed blocks stay cached"
    tensoralloc.empty_cache()
    assert tensoralloc.memory_reserved(0) == 0

    tensoralloc.reset_accumulated_memory_stats(0)
    assert tensoralloc.memory_stats(0)["allocation.all.allocated"] == 0

    # tensoralloc.torch re-exports them; without PyTorch, device None is device 0.
    assert ta_torch.memory_stats() == tensoralloc.memory_stats(0)


def check_summary():
    text = tensoralloc.memory_summary(0)
    lines = text.splitlines()
    assert "device ID 0" in lines[1], lines[1]
    assert any(line.startswith("| Allocated memory") for line in lines), text
    assert any("from small pool" in line for line in lines)
    assert all(line.startswith("|") and line.endswith("|") for line in lines)
    assert len({len(line) for line in lines}) == 1, "every line of the table is as wide"
    short = tensoralloc.memory_summary(0, abbreviated=True)
    assert "from small pool" not in short and "GPU reserved memory" in short


def check_bad_devices():
    e = expect_raises(tensoralloc.Error, "device 99", tensoralloc.memory_stats, 99)
    assert e.status != 0
    expect_raises(tensoralloc.Error, "device -1", tensoralloc.reset_peak_memory_stats, -1)
    expect_raises(TypeError, "bool", tensoralloc.memory_allocated, True)
    # Device strings as PyTorch takes them: another device type or a malformed index is refused.
    assert tensoralloc.memory_allocated("cuda:0") == tensoralloc.memory_allocated(0)
    assert tensoralloc.memory_allocated("cuda") == tensoralloc.memory_allocated(0)
    expect_raises(ValueError, "expected a cuda device", tensoralloc.memory_stats, "cpu")
    expect_raises(ValueError, "'cuda:x' is not a device", tensoralloc.memory_stats, "cuda:x")
    cpu = types.SimpleNamespace(type="cpu", index=None)
    expect_raises(ValueError, "expected a cuda device", tensoralloc.memory_stats, cpu)


def check_memory_fraction(lib):
    expect_raises(ValueError, "between 0 and 1", tensoralloc.set_per_process_memory_fraction, 1.5)
    expect_raises(ValueError, "between 0 and 1", tensoralloc.set_per_process_memory_fraction, -0.1)
    expect_raises(TypeError, "float", tensoralloc.set_per_process_memory_fraction, "half")
    expect_raises(tensoralloc.Error, "device 99", tensoralloc.set_per_process_memory_fraction, 0.5, 99)
    assert tensoralloc.get_per_process_memory_fraction(0) == 1.0

    total = lib_total_memory(lib)
    tensoralloc.set_per_process_memory_fraction(0.25, 0)
    assert tensoralloc.get_per_process_memory_fraction(0) == 0.25
    alloc = lib.tensoralloc_malloc
    assert alloc(total // 2, 0, None) is None, "half the device is beyond a quarter"
    assert tensoralloc._last_error().startswith("out of memory"), tensoralloc._last_error()
    p = alloc(total // 8, 0, None)
    assert p, tensoralloc._last_error()
    lib.tensoralloc_free(p, total // 8, 0, None)
    tensoralloc.set_per_process_memory_fraction(1.0, 0)
    tensoralloc.empty_cache()


def lib_total_memory(lib):
    """The device's capacity, from the out-of-memory message of an absurd request."""
    lib.tensoralloc_malloc(1 << 48, 0, None)
    message = tensoralloc._last_error()
    # "... device 0 has a total capacity of 16.00 GiB of which ..."
    number, unit = message.split("total capacity of ")[1].split()[:2]
    return int(float(number) * {"MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[unit])


def check_snapshot():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snapshot")
        if hasattr(tensoralloc._library(), "tensoralloc_dump_snapshot"):
            tensoralloc.dump_snapshot(path)
            assert os.path.getsize(path) > 0
            expect_raises(ValueError, "null byte", tensoralloc.dump_snapshot, path + "\0x")
            assert os.listdir(tmp) == ["snapshot"], os.listdir(tmp)
        else:
            expect_raises(NotImplementedError, "tensoralloc_dump_snapshot", tensoralloc.dump_snapshot, path)


def check_install_errors():
    # No PyTorch in this environment.
    assert "torch" not in sys.modules
    expect_raises(ta_torch.InstallError, "PyTorch is not installed", ta_torch.install)

    # A PyTorch without CUDA, then one whose CUDA is already initialized.
    fake = types.ModuleType("torch")
    fake.__version__ = "2.11.0+cpu"
    fake.version = types.SimpleNamespace(cuda=None)
    fake.backends = types.SimpleNamespace(cuda=types.SimpleNamespace(is_built=lambda: False))
    fake.cuda = types.SimpleNamespace(is_initialized=lambda: True)
    sys.modules["torch"] = fake
    try:
        expect_raises(ta_torch.InstallError, "built without CUDA", ta_torch.install)
        fake.version.cuda = "13.0"
        fake.backends.cuda.is_built = lambda: True
        expect_raises(ta_torch.InstallError, "CUDA is already initialized", ta_torch.install)
        fake.cuda.is_initialized = lambda: False
        os.environ["CXX"] = "no-such-compiler-tensoralloc"
        expect_raises(ta_torch.InstallError, "no C++ compiler", ta_torch.install)
    finally:
        del sys.modules["torch"]
        del os.environ["CXX"]
    assert not ta_torch.installed()


def main():
    # The test's own handle on the library the package loaded (same file, same allocator), so
    # its calls do not depend on the package's bindings.
    lib = ctypes.CDLL(tensoralloc.library_path())
    lib.tensoralloc_last_error.restype = ctypes.c_char_p
    tensoralloc._library()
    check_library_is_bundled()
    check_statistics(lib)
    check_summary()
    check_bad_devices()
    check_memory_fraction(lib)
    check_snapshot()
    check_install_errors()
    print("tensoralloc package works: %d statistics" % len(tensoralloc.memory_stats(0)))


if __name__ == "__main__":
    main()
