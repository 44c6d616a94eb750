"""PyTorch checks of `tensoralloc.torch.install()` on a machine with an NVIDIA GPU: every hook of
PyTorch's pluggable allocator reaches tensoralloc and means what it means in PyTorch.

Each check runs in its own child process (the allocator must be chosen before CUDA starts):
  record_stream   a block freed while another stream still reads it is not handed out again
                  before that work completes, and is after; a 4-stream producer/consumer
                  reserves about as much as PyTorch's own allocator
  empty_cache     torch.cuda.empty_cache() returns the cached segments (reserved bytes drop)
  fraction        torch.cuda.set_per_process_memory_fraction() limits allocations
                  (torch.OutOfMemoryError), and get_per_process_memory_fraction reads it back
  graph           torch.cuda.graph capture and replay give the right results, and memory
                  allocated outside the graph never overlaps its private pool
  compile         torch.compile(mode="reduce-overhead") (CUDA graphs) matches eager results
  stats           torch.cuda.memory_stats() and tensoralloc.torch.memory_stats() have exactly
                  the keys of PyTorch's own allocator, and the same values as each other

Needs PyTorch with CUDA, a C++ compiler and ninja, and the `tensoralloc` package installed
(tests/gpu/run-pytorch-suite.sh does that). Usage: python3 tests/gpu/pytorch_hooks.py [CHECK...]
"""

import json
import os
import subprocess
import sys

MiB = 1 << 20


def install():
    import tensoralloc.torch

    tensoralloc.torch.install()
    import torch

    return torch


# ---- checks, each run in a fresh child process -------------------------------------------


def check_record_stream():
    torch = install()
    main = torch.cuda.current_stream()
    reader = torch.cuda.Stream()

    x = torch.ones(4 * MiB, device="cuda")
    address = x.data_ptr()
    reader.wait_stream(main)
    with torch.cuda.stream(reader):
        torch.cuda._sleep(200_000_000)  # keeps the reader busy for a while
        total = x.sum()
    x.record_stream(reader)
    del x
    # The reader may still be reading the block: it must not come back yet.
    y = torch.empty(4 * MiB, device="cuda")
    assert y.data_ptr() != address, "a block was reused while another stream could still read it"
    torch.cuda.synchronize()
    assert total.item() == 4 * MiB
    del y
    # Once the reader is done, the block is free for the allocating stream again.
    z = torch.empty(4 * MiB, device="cuda")
    w = torch.empty(4 * MiB, device="cuda")
    assert address in (z.data_ptr(), w.data_ptr()), "the block was not reused after the reader finished"
    del z, w
    torch.cuda.synchronize()
    return {"max_reserved": producer_consumer(torch)}


def producer_consumer(torch):
    """A producer on the current stream hands each tensor to 4 consumer streams; returns the
    peak of reserved bytes."""
    torch.manual_seed(0)
    main = torch.cuda.current_stream()
    consumers = [torch.cuda.Stream() for _ in range(4)]
    torch.cuda.reset_peak_memory_stats()
    results = []
    for step in range(100):
        x = torch.randn(4 * MiB, device="cuda")
        for stream in consumers:
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(1_000_000)
                out = (x * 2).sum()
            x.record_stream(stream)
            out.record_stream(main)
            results.append(out)
        del x
        if step % 10 == 9:
            for stream in consumers:
                main.wait_stream(stream)
            torch.stack(results).sum().item()
            results.clear()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved()


def check_producer_consumer_native():
    import torch

    return {"max_reserved": producer_consumer(torch)}


def check_empty_cache():
    torch = install()
    import tensoralloc.torch as ta

    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    del x
    before = torch.cuda.memory_reserved()
    assert before >= 256 * MiB, before
    assert ta.memory_reserved() == before
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    assert after < before and after < 256 * MiB, (before, after)
    return {"reserved_before": before, "reserved_after": after}


def check_fraction():
    torch = install()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.01)
    assert abs(torch.cuda.get_per_process_memory_fraction() - 0.01) < 1e-12
    try:
        torch.empty(total // 10, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        message = str(e)
    else:
        raise AssertionError("an allocation of 10% of the device succeeded under a 1% fraction")
    small = torch.empty(total // 1000, dtype=torch.uint8, device="cuda")
    del small
    torch.cuda.set_per_process_memory_fraction(1.0)
    big = torch.empty(total // 10, dtype=torch.uint8, device="cuda")
    del big
    return {"oom_message": message.splitlines()[0]}


def check_graph():
    torch = install()
    static_in = torch.zeros(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside the capture, as PyTorch recommends
            (static_in * 2 + 1).relu()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # Freed inside the capture: its block stays in the graph's private pool, because every
        # replay writes it again.
        scratch = static_in * 3
        scratch_span = (scratch.data_ptr(), scratch.data_ptr() + scratch.numel() * scratch.element_size())
        hidden = static_in * 2 + 1 + scratch * 0
        del scratch
        static_out = hidden.relu() - hidden.mean()

    # Memory allocated outside the graph never comes from its pool, even while it is idle.
    outside = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(8)]
    for t in outside:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert end <= scratch_span[0] or start >= scratch_span[1], "a block of the graph's pool was handed out"

    for seed in range(5):
        value = torch.randn(1 << 20, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        static_in.copy_(value)
        graph.replay()
        expected_hidden = value * 2 + 1
        expected = expected_hidden.relu() - expected_hidden.mean()
        torch.cuda.synchronize()
        assert torch.allclose(static_out, expected, atol=1e-5), f"replay {seed} is wrong"
    assert all(bool((t == 7.0).all()) for t in outside), "a replay wrote into memory outside its pool"
    del graph, static_out, hidden
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"replays": 5}


def check_compile():
    torch = install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256), torch.nn.LayerNorm(256)
    ).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for step in range(6):  # the first calls warm up, later ones replay CUDA graphs
            x = torch.randn(64, 256, device="cuda")
            got = compiled(x).clone()
            want = model(x)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"step {step} differs"
    torch.cuda.synchronize()
    return {"steps": 6}


def check_stats():
    torch = install()
    import tensoralloc.torch as ta

    x = torch.empty(3 * MiB, device="cuda")
    ours = ta.memory_stats()
    theirs = torch.cuda.memory_stats()
    assert ours == theirs, "torch.cuda.memory_stats() does not report tensoralloc's statistics"
    assert ours["allocated_bytes.all.current"] >= 12 * MiB
    assert torch.cuda.memory_allocated() == ta.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert ta.max_memory_allocated() == ta.memory_allocated()
    assert "Allocated memory" in torch.cuda.memory_summary()
    del x
    return {"keys": sorted(ours)}


def check_stats_native():
    import torch

    x = torch.empty(3 * MiB, device="cuda")
    keys = sorted(torch.cuda.memory_stats())
    del x
    return {"keys": keys}


CHECKS = {
    "record_stream": check_record_stream,
    "producer_consumer_native": check_producer_consumer_native,
    "empty_cache": check_empty_cache,
    "fraction": check_fraction,
    "graph": check_graph,
    "compile": check_compile,
    "stats": check_stats,
    "stats_native": check_stats_native,
}


def run_child(name):
    env = dict(os.environ)
    env.pop("TENSORALLOC_DRIVER", None)  # the real driver
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", name],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if out.returncode != 0:
        raise AssertionError(f"check {name} failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
    if len(argv) >= 3 and argv[1] == "--child":
        print(json.dumps(CHECKS[argv[2]]()))
        return
    wanted = argv[1:] or ["record_stream", "empty_cache", "fraction", "graph", "compile", "stats"]
    failed = []
    for name in wanted:
        try:
            result = run_child(name)
            if name == "record_stream":
                native = run_child("producer_consumer_native")["max_reserved"]
                ratio = result["max_reserved"] / native
                result["native_max_reserved"] = native
                assert 0.5 <= ratio <= 2.0, f"reserved {ratio:.2f}x PyTorch's own allocator"
            if name == "stats":
                native = run_child("stats_native")["keys"]
                assert result["keys"] == native, set(result["keys"]) ^ set(native)
                result = {"keys": len(native)}
            print(f"-- {name}: ok {json.dumps(result)}")
        except AssertionError as e:
            print(f"-- {name}: FAILED {e}")
            failed.append(name)
    if failed:
        raise SystemExit(f"PyTorch hook checks failed: {', '.join(failed)}")
    print("PyTorch hook checks passed")


if __name__ == "__main__":
    main(sys.argv)
