"""Trains a small model for a few steps with tensoralloc installed as PyTorch's CUDA allocator
(torch.cuda.memory.CUDAPluggableAllocator) and checks that every loss equals the one obtained
with PyTorch's own caching allocator. Part of each step runs on a side stream whose output is
used on the main stream (record_stream). Prints tensoralloc's statistics at the end.

Needs a GPU and PyTorch with CUDA. Each allocator runs in its own child process, because the
allocator must be chosen before the first CUDA allocation of a process.

Usage: python3 tests/gpu/pytorch_train.py /path/to/libtensoralloc.so [steps]
"""

import ctypes
import json
import os
import subprocess
import sys


class Stat(ctypes.Structure):
    """tensoralloc_stat (include/tensoralloc.h)."""

    _fields_ = [(name, ctypes.c_int64) for name in ("current", "peak", "allocated", "freed")]


class DeviceStats(ctypes.Structure):
    """tensoralloc_device_stats (include/tensoralloc.h); arrays are [all, small pool, large pool]."""

    _fields_ = [
        (name, Stat * 3)
        for name in (
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
    ] + [
        ("num_alloc_retries", ctypes.c_int64),
        ("num_ooms", ctypes.c_int64),
        ("oversize_allocations", Stat),
        ("oversize_segments", Stat),
        ("num_sync_all_streams", ctypes.c_int64),
        ("num_device_alloc", ctypes.c_int64),
        ("num_device_free", ctypes.c_int64),
        ("max_split_size", ctypes.c_int64),
        ("num_invalid_frees", ctypes.c_int64),
    ]


def read_stats(lib, device):
    """tensoralloc's statistics of `device` as a dict."""
    stats = DeviceStats()
    lib.tensoralloc_last_error.restype = ctypes.c_char_p
    status = lib.tensoralloc_get_device_stats(ctypes.c_int(device), ctypes.byref(stats))
    if status != 0:
        raise RuntimeError("tensoralloc_get_device_stats: %r" % lib.tensoralloc_last_error())
    return {
        "allocated_bytes": stats.allocated_bytes[0].current,
        "peak_allocated_bytes": stats.allocated_bytes[0].peak,
        "reserved_bytes": stats.reserved_bytes[0].current,
        "allocations": stats.allocation[0].allocated,
        "segments": stats.segment[0].current,
        "num_device_alloc": stats.num_device_alloc,
        "num_device_free": stats.num_device_free,
        "num_alloc_retries": stats.num_alloc_retries,
        "num_ooms": stats.num_ooms,
        "num_sync_all_streams": stats.num_sync_all_streams,
        "num_invalid_frees": stats.num_invalid_frees,
    }


def train(mode, lib_path, steps):
    """One training run; prints a JSON line with the losses (and tensoralloc's statistics)."""
    import torch

    lib = None
    if mode == "tensoralloc":
        allocator = torch.cuda.memory.CUDAPluggableAllocator(lib_path, "tensoralloc_malloc", "tensoralloc_free")
        torch.cuda.memory.change_current_allocator(allocator)
        lib = ctypes.CDLL(lib_path)  # the same library instance PyTorch loaded
        lib.tensoralloc_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.tensoralloc_record_stream.restype = None

    def record_stream(tensor, stream):
        tensor.record_stream(stream)
        if lib is not None:
            # PyTorch's Python API does not expose the pluggable allocator's record-stream hook,
            # so tell tensoralloc directly, with the storage's start as tensoralloc_malloc gave it.
            lib.tensoralloc_record_stream(tensor.untyped_storage().data_ptr(), stream.cuda_stream)

    torch.manual_seed(0)
    # Same kernels in both runs, so the losses can be compared exactly: deterministic cuDNN
    # choices, and no pooling layers (their CUDA backward passes add with atomics).
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda", 0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    data = torch.Generator().manual_seed(1)
    side = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 3, 32, 32, generator=data).to(device, non_blocking=False)
        y = torch.randint(0, 10, (64,), generator=data).to(device)
        # Normalize the batch on a side stream; the result is allocated there and used on main.
        side.wait_stream(main)
        with torch.cuda.stream(side):
            x_side = (x - x.mean()) / (x.std() + 1e-5)
        main.wait_stream(side)
        record_stream(x_side, main)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x_side), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        del x, y, x_side, loss
    torch.cuda.synchronize()
    result = {"mode": mode, "losses": losses}
    if lib is not None:
        result["stats"] = read_stats(lib, 0)
    print(json.dumps(result))


def run_child(mode, lib_path, steps):
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    env.pop("TENSORALLOC_DRIVER", None)  # the real driver
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, lib_path, str(steps)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit("%s run failed:\n%s%s" % (mode, out.stdout, out.stderr))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
    if len(argv) >= 2 and argv[1] == "--child":
        train(argv[2], argv[3], int(argv[4]))
        return
    if len(argv) < 2:
        raise SystemExit(__doc__)
    lib_path = os.path.abspath(argv[1])
    steps = int(argv[2]) if len(argv) > 2 else 20
    ours = run_child("tensoralloc", lib_path, steps)
    theirs = run_child("pytorch", lib_path, steps)
    for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
        print("step %2d: loss %.6f (tensoralloc) %.6f (PyTorch allocator)" % (step, a, b))
    assert len(ours["losses"]) == steps and ours["losses"] == theirs["losses"], "losses differ"
    stats = ours["stats"]
    print("tensoralloc statistics:", json.dumps(stats, indent=2))
    assert stats["num_device_alloc"] > 0, "tensoralloc served no allocation"
    assert stats["num_invalid_frees"] == 0, "PyTorch freed memory tensoralloc did not own"
    assert stats["num_ooms"] == 0
    print("PyTorch trained %d steps on tensoralloc with the same losses as on its own allocator" % steps)


if __name__ == "__main__":
    main(sys.argv)
