"""Checks a tensoralloc memory snapshot the way PyTorch users read one.

usage: snapshot_check.py SNAPSHOT [DIR_WITH__memory_viz.py]

The file must load with an unpickler that refuses every global (it holds only dicts, lists,
tuples, strings and numbers) and have the layout of torch.cuda.memory._dump_snapshot(). When a
directory holding PyTorch's torch/cuda/_memory_viz.py is given, its text and HTML views must
accept the snapshot too (that module needs no GPU and, for these functions, no torch).
"""

import gzip
import importlib.util
import io
import pickle
import sys


class Refusing(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return Refusing(io.BytesIO(data)).load()


STATES = {"active_allocated", "active_pending_free", "inactive"}
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom", "snapshot"}


def check_layout(snap):
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}, sorted(snap)
    assert snap["segments"], "no segments"
    for seg in snap["segments"]:
        for key in ("device", "address", "total_size", "allocated_size", "active_size",
                    "requested_size", "stream", "segment_type", "blocks", "frames"):
            assert key in seg, key
        assert seg["segment_type"] in ("small", "large")
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr, "blocks must tile their segment"
            assert b["state"] in STATES, b["state"]
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]
        allocated = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        assert allocated == seg["allocated_size"]
    events = [e for t in snap["device_traces"] for e in t]
    assert events, "no recorded events"
    for e in events:
        assert e["action"] in ACTIONS, e["action"]
        for key in ("addr", "size", "stream", "time_us", "frames"):
            assert key in e, key
    assert "max_split_size" in snap["allocator_settings"]
    return events


def check_with_memory_viz(snap, directory):
    spec = importlib.util.spec_from_file_location("_memory_viz", directory + "/_memory_viz.py")
    viz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(viz)
    no_flamegraph = lambda lines, *args, **kwargs: lines  # the default downloads a script
    out = {
        "segsum": viz.segsum(snap),
        "trace": viz.trace(snap),
        "segments": viz.segments(snap, format_flamegraph=no_flamegraph),
        "memory": viz.memory(snap, format_flamegraph=no_flamegraph),
        "trace_plot": viz.trace_plot(snap),
        "segment_plot": viz.segment_plot(snap),
    }
    for name, text in out.items():
        assert isinstance(text, str) and text, f"{name} produced nothing"
    assert "alloc" in out["trace"], out["trace"][:500]
    assert "<html" in out["trace_plot"].lower()
    return sorted(out)


def main():
    snap = load(sys.argv[1])
    events = check_layout(snap)
    print(f"layout ok: {len(snap['segments'])} segments, {len(events)} events")
    if len(sys.argv) > 2:
        names = check_with_memory_viz(snap, sys.argv[2])
        print("torch.cuda._memory_viz accepts it: " + ", ".join(names))


if __name__ == "__main__":
    main()
