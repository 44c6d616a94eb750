// Replays allocator call lists through PyTorch's own CUDA caching allocator (libc10_cuda.so
// from the torch wheel, on the stand-in runtime in fake_cudart.c) and through tensoralloc's C
// functions, in one process, alternating rounds.
//
// Usage: replay OPS_FILE...   (environment: ROUNDS, default 5; EXACT=0 skips the statistics
// comparison, for tensoralloc settings that are not PyTorch's; FRACTION sets both allocators'
// memory fraction of device 0, as torch.cuda.set_per_process_memory_fraction does. Both read their
// settings from the environment: PYTORCH_CUDA_ALLOC_CONF, and TENSORALLOC_CONF before it.)
// An ops file (written by tests/pytorch_native/harness.rs) holds `# events N`, then one line
// per call: `a SLOT SIZE STREAM` allocates SIZE bytes on STREAM into SLOT, `f SLOT` frees it,
// `b POOL STREAM` begins allocating STREAM's requests to private pool POOL (PyTorch's
// beginAllocateToPool, as for a CUDA graph or a torch.cuda.MemPool), `e POOL` ends that, and
// `r POOL` releases the pool.
//
// A request either allocator cannot serve fails (PyTorch's OutOfMemoryError, tensoralloc's
// NULL) and the replay goes on, skipping that allocation's free.
//
// Prints per trace the thread CPU time per call and per trace event of each allocator (best
// round), their ratio, and each one's peak reserved bytes. After every trace it compares all
// of PyTorch's device statistics with tensoralloc's (every counter of every pool) and reports
// each difference; the exit status is 1 when any statistic differs, 2 on bad input.
// Peak reserved bytes are also printed on lines `peak NAME TORCH OURS` for scripts.
#include <c10/cuda/CUDACachingAllocator.h>
#include <tensoralloc.h>

#include <time.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;
using TorchStats = c10::CachingDeviceAllocator::DeviceStats;

struct Op {
  // 'a' allocate, 'f' free, 'b' begin allocating to a pool, 'e' end it, 'r' release it.
  char kind;
  // The allocation's slot, or the pool's number.
  uint32_t slot;
  uint64_t size;
  uint64_t stream;
};

struct Trace {
  std::string name;
  uint64_t events = 0;
  uint32_t slots = 0;
  std::vector<Op> ops;
};

Trace load(const char* path) {
  Trace t;
  t.name = path;
  if (auto cut = t.name.find_last_of('/'); cut != std::string::npos) t.name.erase(0, cut + 1);
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path);
    std::exit(2);
  }
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string kind;
    fields >> kind;
    Op op{kind.empty() ? ' ' : kind[0], 0, 0, 0};
    if (kind == "#") {
      std::string word;
      fields >> word >> t.events;
      continue;
    } else if (kind == "a") {
      fields >> op.slot >> op.size >> op.stream;
    } else if (kind == "b") {
      fields >> op.slot >> op.stream;
    } else if (kind == "f" || kind == "e" || kind == "r") {
      fields >> op.slot;
    } else {
      continue;
    }
    if (!fields) {
      std::fprintf(stderr, "%s: bad line: %s\n", path, line.c_str());
      std::exit(2);
    }
    if (op.kind == 'a' || op.kind == 'f') t.slots = std::max(t.slots, op.slot + 1);
    t.ops.push_back(op);
  }
  return t;
}

double thread_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

cudaStream_t as_stream(uint64_t s) { return reinterpret_cast<cudaStream_t>(s); }

// A pool's id: its number, made unique to the round (a released pool may outlive it).
uint64_t pool_id(uint64_t base, uint32_t pool) { return (base >> 32) * 1000 + pool + 1; }

double run_pytorch(const Trace& t, uint64_t base, std::vector<void*>& ptrs) {
  double start = thread_ns();
  for (const Op& op : t.ops) {
    if (op.kind == 'a') {
      try {
        ptrs[op.slot] = alloc::raw_alloc_with_stream(op.size, as_stream(base + op.stream));
      } catch (const c10::OutOfMemoryError&) {
        // Counted in PyTorch's num_ooms; the call fails as tensoralloc's returns NULL.
        ptrs[op.slot] = nullptr;
      }
    } else if (op.kind == 'f') {
      if (ptrs[op.slot]) alloc::raw_delete(ptrs[op.slot]);
      ptrs[op.slot] = nullptr;
    } else if (op.kind == 'b') {
      cudaStream_t only = as_stream(base + op.stream);
      alloc::beginAllocateToPool(0, {0, pool_id(base, op.slot)},
                                 [only](cudaStream_t s) { return s == only; });
    } else if (op.kind == 'e') {
      alloc::endAllocateToPool(0, {0, pool_id(base, op.slot)});
    } else if (op.kind == 'r') {
      alloc::releasePool(0, {0, pool_id(base, op.slot)});
    }
  }
  double spent = thread_ns() - start;
  for (void*& p : ptrs) {
    if (p) alloc::raw_delete(p);
    p = nullptr;
  }
  return spent;
}

double run_tensoralloc(const Trace& t, uint64_t base, std::vector<void*>& ptrs,
                       std::vector<uint64_t>& streams) {
  // The stream each begun pool accepts (the filter's context), kept until the run ends.
  std::vector<std::unique_ptr<uint64_t>> filters;
  auto accepts = [](void* ctx, CUstream_st* s) {
    return static_cast<int>(reinterpret_cast<uint64_t>(s) == *static_cast<uint64_t*>(ctx));
  };
  double start = thread_ns();
  for (const Op& op : t.ops) {
    if (op.kind == 'a') {
      uint64_t s = base + op.stream;
      // An out-of-memory failure returns NULL (and counts in num_ooms), as PyTorch's throws.
      ptrs[op.slot] = tensoralloc_malloc(op.size, 0, as_stream(s));
      streams[op.slot] = s;
    } else if (op.kind == 'f') {
      if (ptrs[op.slot]) tensoralloc_free(ptrs[op.slot], 0, 0, as_stream(streams[op.slot]));
      ptrs[op.slot] = nullptr;
    } else if (op.kind == 'b') {
      filters.push_back(std::make_unique<uint64_t>(base + op.stream));
      if (tensoralloc_begin_allocate_to_pool(0, 0, pool_id(base, op.slot), accepts,
                                             filters.back().get()) != 0) {
        std::fprintf(stderr, "begin_allocate_to_pool: %s\n", tensoralloc_last_error());
        std::exit(1);
      }
    } else if (op.kind == 'e') {
      tensoralloc_end_allocate_to_pool(0, 0, pool_id(base, op.slot));
    } else if (op.kind == 'r') {
      tensoralloc_release_pool(0, 0, pool_id(base, op.slot));
    }
  }
  double spent = thread_ns() - start;
  for (size_t i = 0; i < ptrs.size(); i++) {
    if (ptrs[i]) tensoralloc_free(ptrs[i], 0, 0, as_stream(streams[i]));
    ptrs[i] = nullptr;
  }
  return spent;
}

// Compares one statistic; prints and counts a difference.
int same(const char* trace, const char* what, int64_t torch, int64_t ours) {
  if (torch == ours) return 0;
  std::printf("  %s: %s differs: PyTorch %" PRId64 ", tensoralloc %" PRId64 "\n", trace, what,
              torch, ours);
  return 1;
}

int compare_stats(const char* trace, const TorchStats& t, const tensoralloc_device_stats& o) {
  static const char* pools[3] = {"all", "small_pool", "large_pool"};
  struct Pair {
    const char* name;
    const c10::CachingAllocator::StatArray& torch;
    const tensoralloc_stat* ours;
  } arrays[] = {
      {"allocation", t.allocation, o.allocation},
      {"segment", t.segment, o.segment},
      {"active", t.active, o.active},
      {"inactive_split", t.inactive_split, o.inactive_split},
      {"allocated_bytes", t.allocated_bytes, o.allocated_bytes},
      {"reserved_bytes", t.reserved_bytes, o.reserved_bytes},
      {"active_bytes", t.active_bytes, o.active_bytes},
      {"inactive_split_bytes", t.inactive_split_bytes, o.inactive_split_bytes},
      {"requested_bytes", t.requested_bytes, o.requested_bytes},
  };
  int differences = 0;
  char what[96];
  for (const Pair& a : arrays) {
    for (int p = 0; p < 3; p++) {
      const auto& ts = a.torch[p];
      const auto& os = a.ours[p];
      const int64_t torch_fields[4] = {ts.current, ts.peak, ts.allocated, ts.freed};
      const int64_t our_fields[4] = {os.current, os.peak, os.allocated, os.freed};
      static const char* fields[4] = {"current", "peak", "allocated", "freed"};
      for (int f = 0; f < 4; f++) {
        std::snprintf(what, sizeof what, "%s.%s.%s", a.name, pools[p], fields[f]);
        differences += same(trace, what, torch_fields[f], our_fields[f]);
      }
    }
  }
  differences += same(trace, "num_alloc_retries", t.num_alloc_retries, o.num_alloc_retries);
  differences += same(trace, "num_ooms", t.num_ooms, o.num_ooms);
  differences += same(trace, "num_sync_all_streams", t.num_sync_all_streams, o.num_sync_all_streams);
  differences += same(trace, "num_device_alloc", t.num_device_alloc, o.num_device_alloc);
  differences += same(trace, "num_device_free", t.num_device_free, o.num_device_free);
  differences += same(trace, "oversize_allocations.current", t.oversize_allocations.current,
                      o.oversize_allocations.current);
  differences += same(trace, "oversize_segments.current", t.oversize_segments.current,
                      o.oversize_segments.current);
  return differences;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OPS_FILE...\n", argv[0]);
    return 2;
  }
  const char* rounds_env = std::getenv("ROUNDS");
  int rounds = rounds_env ? std::max(1, std::atoi(rounds_env)) : 5;
  const char* exact_env = std::getenv("EXACT");
  bool exact = !exact_env || std::string(exact_env) != "0";
  alloc::init(1);
  if (const char* fraction = std::getenv("FRACTION")) {
    alloc::setMemoryFraction(std::atof(fraction), 0);
    tensoralloc_set_memory_fraction(std::atof(fraction), 0);
  }
  std::printf("%-28s %7s %7s %10s %10s %10s %10s %6s %15s %15s\n", "trace", "events", "calls",
              "torch/call", "ours/call", "torch/evt", "ours/evt", "ratio", "torch peak res",
              "ours peak res");
  double log_sum = 0;
  int differences = 0;
  for (int i = 1; i < argc; i++) {
    Trace t = load(argv[i]);
    std::vector<void*> torch_ptrs(t.slots, nullptr), our_ptrs(t.slots, nullptr);
    std::vector<uint64_t> our_streams(t.slots, 0);
    double torch_best = 1e300, ours_best = 1e300;
    alloc::resetPeakStats(0);
    tensoralloc_reset_peak_stats(0);
    for (int round = 0; round < rounds; round++) {
      // Streams of their own per round, so no earlier round's cache serves this one.
      uint64_t base = static_cast<uint64_t>(i * rounds + round + 1) << 32;
      torch_best = std::min(torch_best, run_pytorch(t, base, torch_ptrs));
      alloc::emptyCache();
      ours_best = std::min(ours_best, run_tensoralloc(t, base, our_ptrs, our_streams));
      tensoralloc_empty_cache();
    }
    TorchStats torch_stats = alloc::getDeviceStats(0);
    tensoralloc_device_stats ours{};
    if (tensoralloc_get_device_stats(0, &ours) != 0) {
      std::fprintf(stderr, "tensoralloc_get_device_stats: %s\n", tensoralloc_last_error());
      return 1;
    }
    double calls = static_cast<double>(std::max<size_t>(t.ops.size(), 1));
    double events = t.events ? static_cast<double>(t.events) : calls;
    double ratio = ours_best / torch_best;
    log_sum += std::log(ratio);
    std::printf("%-28s %7" PRIu64 " %7zu %10.1f %10.1f %10.1f %10.1f %6.3f %15" PRId64
                " %15" PRId64 "\n",
                t.name.c_str(), t.events, t.ops.size(), torch_best / calls, ours_best / calls,
                torch_best / events, ours_best / events, ratio,
                torch_stats.reserved_bytes[0].peak,
                ours.reserved_bytes[TENSORALLOC_STAT_AGGREGATE].peak);
    std::printf("peak %s %" PRId64 " %" PRId64 "\n", t.name.c_str(),
                torch_stats.reserved_bytes[0].peak,
                ours.reserved_bytes[TENSORALLOC_STAT_AGGREGATE].peak);
    if (exact) differences += compare_stats(t.name.c_str(), torch_stats, ours);
  }
  std::printf("geometric mean of tensoralloc / PyTorch time: %.3f over %d traces\n",
              std::exp(log_sum / (argc - 1)), argc - 1);
  if (exact) std::printf("%d statistics differ\n", differences);
  std::fflush(stdout);
  return differences ? 1 : 0;
}
