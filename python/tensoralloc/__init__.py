"""tensoralloc: the bundled libtensoralloc.so, its statistics and controls, from Python.

The functions here read and steer the allocator of this process through its C ABI (ctypes);
they need no PyTorch. They report what tensoralloc does in any process that loaded the
library: through `tensoralloc.torch.install()`, through
`torch.cuda.memory.CUDAPluggableAllocator(tensoralloc.library_path(), ...)`, or from C code
linked against the same file. `tensoralloc.torch` installs the allocator into PyTorch.

Statistics have the keys and meaning of `torch.cuda.memory_stats()`.
"""

import ctypes
import os
import sys
import threading

__all__ = [
    "Error",
    "library_path",
    "include_dir",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "memory_summary",
    "empty_cache",
    "set_per_process_memory_fraction",
    "get_per_process_memory_fraction",
    "dump_snapshot",
]

_HERE = os.path.dirname(os.path.abspath(__file__))

# Status codes of include/tensoralloc.h.
_OK = 0
_ERR_INVALID_ARGUMENT = 1
_ERR_OUT_OF_MEMORY = 2


class Error(RuntimeError):
    """A tensoralloc call failed; `status` is its TENSORALLOC_ERR_* code."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


def library_path():
    """The path of the bundled libtensoralloc.so."""
    return os.path.join(_HERE, "libtensoralloc.so")


def include_dir():
    """The directory holding the bundled tensoralloc.h and tensoralloc_torch.hpp."""
    return os.path.join(_HERE, "include")


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("current", "peak", "allocated", "freed")]


# The statistics arrays of tensoralloc_device_stats, in the struct's order; each holds the
# pools all, small, large (TENSORALLOC_STAT_AGGREGATE, _SMALL_POOL, _LARGE_POOL).
_STAT_ARRAYS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
_POOLS = ("all", "small_pool", "large_pool")
_COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "max_split_size",
)


class _DeviceStats(ctypes.Structure):
    """tensoralloc_device_stats (include/tensoralloc.h)."""

    _fields_ = [(name, _Stat * 3) for name in _STAT_ARRAYS] + [
        ("num_alloc_retries", ctypes.c_int64),
        ("num_ooms", ctypes.c_int64),
        ("oversize_allocations", _Stat),
        ("oversize_segments", _Stat),
        ("num_sync_all_streams", ctypes.c_int64),
        ("num_device_alloc", ctypes.c_int64),
        ("num_device_free", ctypes.c_int64),
        ("max_split_size", ctypes.c_int64),
        ("num_invalid_frees", ctypes.c_int64),
    ]


_lib = None
_lib_lock = threading.Lock()


def _library():
    """The bundled library, loaded once with its symbols global (a PyTorch extension linked
    against the same file then shares its state)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            lib = ctypes.CDLL(library_path(), mode=ctypes.RTLD_GLOBAL)
            lib.tensoralloc_last_error.restype = ctypes.c_char_p
            lib.tensoralloc_last_error.argtypes = []
            lib.tensoralloc_get_device_stats.argtypes = [ctypes.c_int, ctypes.POINTER(_DeviceStats)]
            lib.tensoralloc_get_device_stats.restype = ctypes.c_int
            for name in ("tensoralloc_reset_peak_stats", "tensoralloc_reset_accumulated_stats"):
                getattr(lib, name).argtypes = [ctypes.c_int]
                getattr(lib, name).restype = ctypes.c_int
            lib.tensoralloc_empty_cache.argtypes = []
            lib.tensoralloc_empty_cache.restype = None
            lib.tensoralloc_device_count.argtypes = []
            lib.tensoralloc_device_count.restype = ctypes.c_int
            _lib = lib
        return _lib


def _symbol(name):
    """The function `name` of the library, or NotImplementedError naming what is missing."""
    lib = _library()
    try:
        return getattr(lib, name)
    except AttributeError:
        raise NotImplementedError(
            f"{library_path()} does not export {name}: this build of tensoralloc does not "
            "have that feature"
        ) from None


def _last_error():
    return (_library().tensoralloc_last_error() or b"").decode("utf-8", "replace")


def _check(status, what):
    if status != _OK:
        raise Error(f"tensoralloc: {what}: {_last_error()}", status)


def _device_index(device):
    """An int device index from None (PyTorch's current device once PyTorch has started CUDA in
    this process, else 0), an int, or a cuda torch.device / "cuda" / "cuda:N" string; other
    device types raise ValueError, as PyTorch's memory functions do."""
    if device is None:
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_initialized():
            return cuda.current_device()
        return 0
    if isinstance(device, bool):
        raise TypeError("device must be an int, a torch.device or None, not bool")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, colon, index = device.partition(":")
        if kind != "cuda":
            raise ValueError(f"expected a cuda device, not {device!r}")
        if not colon:
            return 0
        if not index.isdigit():
            raise ValueError(f"{device!r} is not a device: use 'cuda' or 'cuda:N'")
        return int(index)
    kind = getattr(device, "type", None)
    if kind is not None and kind != "cuda":
        raise ValueError(f"expected a cuda device, not {device!r}")
    index = getattr(device, "index", None)
    if index is None and kind is not None:
        return 0
    if isinstance(index, int):
        return index
    raise TypeError(f"device must be an int, a torch.device or None, not {device!r}")


def _raw_stats(device):
    stats = _DeviceStats()
    index = _device_index(device)
    _check(
        _library().tensoralloc_get_device_stats(index, ctypes.byref(stats)),
        f"statistics of device {index}",
    )
    return stats


def _stat_dict(stat):
    return {"current": stat.current, "peak": stat.peak, "allocated": stat.allocated, "freed": stat.freed}


def memory_stats_as_nested_dict(device=None):
    """The statistics of `device` as nested dictionaries (torch.cuda.memory_stats_as_nested_dict)."""
    raw = _raw_stats(device)
    nested = {name: getattr(raw, name) for name in _COUNTERS}
    for name in _STAT_ARRAYS:
        array = getattr(raw, name)
        nested[name] = {pool: _stat_dict(array[i]) for i, pool in enumerate(_POOLS)}
    nested["oversize_allocations"] = _stat_dict(raw.oversize_allocations)
    nested["oversize_segments"] = _stat_dict(raw.oversize_segments)
    return nested


def memory_stats(device=None):
    """The statistics of `device` with the keys, order and values of torch.cuda.memory_stats():
    "allocated_bytes.all.current", ..., "num_device_alloc", sorted by key."""
    flat = []

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            flat.append((prefix, value))

    walk("", memory_stats_as_nested_dict(device))
    flat.sort()
    return dict(flat)


def memory_allocated(device=None):
    """Bytes handed out to clients on `device` now."""
    return _raw_stats(device).allocated_bytes[0].current


def max_memory_allocated(device=None):
    """The most bytes handed out on `device` since the start or the last peak reset."""
    return _raw_stats(device).allocated_bytes[0].peak


def memory_reserved(device=None):
    """Bytes tensoralloc holds from the driver on `device` now (allocated plus cached)."""
    return _raw_stats(device).reserved_bytes[0].current


def max_memory_reserved(device=None):
    """The most bytes held from the driver on `device` since the start or the last peak reset."""
    return _raw_stats(device).reserved_bytes[0].peak


def reset_peak_memory_stats(device=None):
    """Sets every "peak" statistic of `device` to its current value."""
    index = _device_index(device)
    _check(_library().tensoralloc_reset_peak_stats(index), f"reset the peaks of device {index}")


def reset_accumulated_memory_stats(device=None):
    """Sets every "allocated"/"freed" total and event count of `device` to zero."""
    index = _device_index(device)
    _check(
        _library().tensoralloc_reset_accumulated_stats(index),
        f"reset the totals of device {index}",
    )


def empty_cache():
    """Returns every cached, unused segment of every device to the driver."""
    _library().tensoralloc_empty_cache()


def set_per_process_memory_fraction(fraction, device=None):
    """Limits tensoralloc on `device` to `fraction` (0 to 1) of the device's total memory;
    allocations beyond it fail as out of memory (torch.cuda.set_per_process_memory_fraction)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"fraction must be a float between 0 and 1, not {type(fraction).__name__}")
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"invalid fraction {fraction}: it must be between 0 and 1")
    index = _device_index(device)
    fn = _symbol("tensoralloc_set_memory_fraction")
    fn.argtypes = [ctypes.c_double, ctypes.c_int]
    fn.restype = None
    fn(fraction, index)
    # The function returns nothing: a failure shows in the last error of this thread.
    error = _last_error()
    if error:
        raise Error(f"tensoralloc: set the memory fraction of device {index}: {error}", _ERR_INVALID_ARGUMENT)


def get_per_process_memory_fraction(device=None):
    """The memory fraction of `device` (1.0 when none was set)."""
    index = _device_index(device)
    fn = _symbol("tensoralloc_get_memory_fraction")
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    fn.restype = ctypes.c_int
    out = ctypes.c_double()
    _check(fn(index, ctypes.byref(out)), f"read the memory fraction of device {index}")
    return out.value


def dump_snapshot(path):
    """Writes tensoralloc's memory snapshot to `path` (tensoralloc_dump_snapshot);
    NotImplementedError when the bundled library has no snapshots."""
    encoded = os.fsencode(path)
    if b"\0" in encoded:
        raise ValueError(f"embedded null byte in the snapshot path {path!r}")
    fn = _symbol("tensoralloc_dump_snapshot")
    fn.argtypes = [ctypes.c_char_p]
    fn.restype = ctypes.c_int
    _check(fn(encoded), f"write a snapshot to {path}")


def _scaled(template, units, step, threshold):
    """A formatter for the summary: `value` in the unit that `reference` (the row's total)
    reaches, as PyTorch's summary scales its columns."""

    def format_value(value, reference):
        unit = 0
        while unit + 1 < len(units) and reference >= threshold:
            value //= step
            reference /= step
            unit += 1
        return template.format(value, units[unit])

    return format_value


_format_size = _scaled("{:6d} {}", ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB"), 1024, 768 * 1024)
_format_count = _scaled("{:7d} {} ", (" ", "K", "M"), 1000, 750 * 1000)


_SUMMARY_ROWS = (
    ("allocated_bytes", "Allocated memory", _format_size),
    ("active_bytes", "Active memory", _format_size),
    ("requested_bytes", "Requested memory", _format_size),
    ("reserved_bytes", "GPU reserved memory", _format_size),
    ("inactive_split_bytes", "Non-releasable memory", _format_size),
    ("allocation", "Allocations", _format_count),
    ("active", "Active allocs", _format_count),
    ("segment", "GPU reserved segments", _format_count),
    ("inactive_split", "Non-releasable allocs", _format_count),
)


def memory_summary(device=None, abbreviated=False):
    """A table of the statistics of `device`, laid out like torch.cuda.memory_summary()."""
    index = _device_index(device)
    stats = memory_stats(index)
    width = 75
    rule, double = "-" * width, "=" * width
    lines = [
        double,
        f"tensoralloc memory summary, device ID {index}".center(width),
        rule,
        f"  OOMs: {stats['num_ooms']:<12d} | cudaMalloc retries: {stats['num_alloc_retries']:<8d}".ljust(width),
        double,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
    ]

    def row(label, prefix, formatter, reference_prefix):
        cells = []
        for field in ("current", "peak", "allocated", "freed"):
            cells.append(formatter(stats[prefix + field], stats[reference_prefix + field]))
        return f" {label:<21} | " + " | ".join(cells) + " "

    for key, label, formatter in _SUMMARY_ROWS:
        lines.append(rule)
        lines.append(row(label, f"{key}.all.", formatter, f"{key}.all."))
        if not abbreviated:
            lines.append(row("      from large pool", f"{key}.large_pool.", formatter, f"{key}.all."))
            lines.append(row("      from small pool", f"{key}.small_pool.", formatter, f"{key}.all."))
    for key, label in (("oversize_allocations", "Oversize allocations"), ("oversize_segments", "Oversize GPU segments")):
        lines.append(rule)
        lines.append(row(label, f"{key}.", _format_count, f"{key}."))
    lines.append(double)
    return "".join(f"|{line}|\n" for line in lines)
