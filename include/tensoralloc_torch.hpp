// tensoralloc as PyTorch's CUDA allocator, with every hook of PyTorch's pluggable allocator.
//
// Header-only, C++17. Include it in a libtorch program (or a PyTorch C++ extension) and call
// `tensoralloc::torch::install()` before anything touches CUDA:
//
//     #include <tensoralloc_torch.hpp>
//     int main() {
//       tensoralloc::torch::install();
//       auto x = torch::ones({1024}, torch::kCUDA);  // allocated by tensoralloc
//     }
//
// Build with PyTorch's include directories, the CUDA runtime headers, and link against
// libtorch_cuda, libc10_cuda and libtensoralloc. The Python package `tensoralloc` compiles
// this same header (`tensoralloc.torch.install()`).
//
// What each of PyTorch's allocator entry points reaches:
//   allocation / free      tensoralloc_malloc / tensoralloc_free; a failed allocation raises
//                          c10::OutOfMemoryError (Python: torch.OutOfMemoryError) when
//                          tensoralloc ran out of memory, c10::Error otherwise
//   init                   tensoralloc_init
//   emptyCache             tensoralloc_empty_cache (all of tensoralloc's cache: PyTorch's
//                          per-pool argument is not passed on by the pluggable allocator)
//   setMemoryFraction      tensoralloc_set_memory_fraction
//   getMemoryFraction      tensoralloc_get_memory_fraction
//   getBaseAllocation      tensoralloc_get_base_allocation
//   recordStream           tensoralloc_record_stream
//   begin/endAllocateToPool, releasePool
//                          tensoralloc_begin_allocate_to_pool (PyTorch's stream filter
//                          becomes a C callback whose context lives until the matching end),
//                          tensoralloc_end_allocate_to_pool, tensoralloc_release_pool
//   getDeviceStats, resetPeakStats, resetAccumulatedStats
//                          tensoralloc_get_device_stats, tensoralloc_reset_peak_stats,
//                          tensoralloc_reset_accumulated_stats, so torch.cuda.memory_stats()
//                          and the functions built on it report tensoralloc's statistics
//   getCheckpointState     a token (tensoralloc keeps no restorable state of a graph pool);
//   setCheckpointPoolState raises an error naming the way around it (no CUDA-graph trees)
// Everything else (memory snapshots, memory history, IPC handles) behaves as in PyTorch's
// CUDAPluggableAllocator, which raises "does not yet support".
#pragma once

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "tensoralloc.h"

namespace tensoralloc::torch {

namespace detail {

/// tensoralloc's last error, never NULL.
inline const char* last_error() {
  const char* e = tensoralloc_last_error();
  return (e != nullptr && e[0] != '\0') ? e : "no reason given";
}

/// Raises the C++ exception PyTorch expects for a failed call whose status is `status`.
inline void check(tensoralloc_status status, const char* what) {
  if (status == TENSORALLOC_ERR_OUT_OF_MEMORY) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "tensoralloc: ", what, ": ", last_error());
  }
  TORCH_CHECK(status == 0, "tensoralloc: ", what, ": ", last_error());
}

/// The allocation hook: tensoralloc_malloc, with failures turned into exceptions (PyTorch's
/// pluggable allocator would otherwise hand a NULL tensor to the caller).
inline void* allocate(size_t size, int device, cudaStream_t stream) {
  void* ptr = tensoralloc_malloc(size, device, stream);
  if (ptr == nullptr && size != 0) {
    const char* why = last_error();
    static constexpr char kOom[] = "out of memory";
    if (std::strncmp(why, kOom, sizeof(kOom) - 1) == 0) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA ", why);
    }
    TORCH_CHECK(false, "tensoralloc could not allocate ", size, " bytes on device ", device,
                ": ", why);
  }
  return ptr;
}

using StreamFilter = std::function<bool(cudaStream_t)>;

/// The C callback that tensoralloc calls with a PyTorch stream filter as its context.
inline int call_stream_filter(void* ctx, struct CUstream_st* stream) noexcept {
  try {
    return (*static_cast<const StreamFilter*>(ctx))(stream) ? 1 : 0;
  } catch (...) {
    // An exception must not cross into the library; a stream we cannot judge stays out.
    return 0;
  }
}

/// The stream filters of the pools being allocated to, kept alive while tensoralloc may call
/// them: from tensoralloc_begin_allocate_to_pool until the matching end has returned. When
/// several captures allocate to the same pool at once, their filters live until the last of
/// them ends, whichever end tensoralloc matches with which begin.
class PoolFilters {
 public:
  using Key = std::tuple<int, uint64_t, uint64_t>;

  void begin(int device, c10::cuda::MempoolId_t pool, StreamFilter filter) {
    auto owned = std::make_unique<StreamFilter>(std::move(filter));
    void* ctx = owned.get();
    Key key{device, pool.first, pool.second};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      entries_[key].push_back(std::move(owned));
    }
    tensoralloc_status status = tensoralloc_begin_allocate_to_pool(
        device, pool.first, pool.second, &call_stream_filter, ctx);
    if (status != 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      forget(key, ctx);
    }
    check(status, "begin allocating to a graph pool");
  }

  void end(int device, c10::cuda::MempoolId_t pool) {
    tensoralloc_status status =
        tensoralloc_end_allocate_to_pool(device, pool.first, pool.second);
    // A failed end ended nothing: every filter may still be called.
    if (status == 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      Key key{device, pool.first, pool.second};
      auto it = entries_.find(key);
      if (it != entries_.end() && ++ended_[key] >= it->second.size()) {
        entries_.erase(it);
        ended_.erase(key);
      }
    }
    check(status, "end allocating to a graph pool");
  }

 private:
  void forget(const Key& key, void* ctx) {
    auto it = entries_.find(key);
    if (it == entries_.end()) return;
    auto& list = it->second;
    for (auto e = list.begin(); e != list.end(); ++e) {
      if (e->get() == ctx) {
        list.erase(e);
        break;
      }
    }
    if (list.empty()) entries_.erase(it);
  }

  std::mutex mutex_;
  std::map<Key, std::vector<std::unique_ptr<StreamFilter>>> entries_;
  std::map<Key, size_t> ended_;
};

inline c10::CachingDeviceAllocator::Stat to_stat(const tensoralloc_stat& s) {
  c10::CachingDeviceAllocator::Stat out;
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
  return out;
}

inline c10::CachingDeviceAllocator::StatArray to_stat_array(const tensoralloc_stat (&s)[3]) {
  c10::CachingDeviceAllocator::StatArray out;
  // Both index their pools as all, small, large.
  static_assert(static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE) ==
                TENSORALLOC_STAT_AGGREGATE);
  static_assert(static_cast<size_t>(c10::CachingDeviceAllocator::StatType::SMALL_POOL) ==
                TENSORALLOC_STAT_SMALL_POOL);
  static_assert(static_cast<size_t>(c10::CachingDeviceAllocator::StatType::LARGE_POOL) ==
                TENSORALLOC_STAT_LARGE_POOL);
  for (size_t i = 0; i < out.size(); ++i) out[i] = to_stat(s[i]);
  return out;
}

}  // namespace detail

/// PyTorch's pluggable allocator with all hooks wired to tensoralloc, and tensoralloc's
/// statistics and memory fraction behind the entry points the pluggable allocator leaves
/// unsupported.
class Allocator final : public ::torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  /// What getCheckpointState returns: tensoralloc keeps no restorable pool state.
  struct UnrestorableState final : c10::cuda::CUDACachingAllocator::AllocatorState {};

  using Base = ::torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

  Allocator() : Base(&detail::allocate, &tensoralloc_free) {
    set_init_fn(&tensoralloc_init);
    set_reset_fn(&tensoralloc_empty_cache);
    set_memory_fraction_fn(&tensoralloc_set_memory_fraction);
    set_base_alloc_fn(&tensoralloc_get_base_allocation);
    set_record_stream_fn(&tensoralloc_record_stream);
    // The filters outlive every call: this object owns them and is the current allocator
    // until the process ends.
    auto filters = filters_;
    set_begin_allocate_to_pool(
        [filters](int device, c10::cuda::MempoolId_t pool, detail::StreamFilter filter) {
          filters->begin(device, pool, std::move(filter));
        });
    set_end_allocate_to_pool_fn([filters](int device, c10::cuda::MempoolId_t pool) {
      filters->end(device, pool);
    });
    // PyTorch releases pools from destructors (CUDAGraph, MemPool), where an exception would
    // terminate the process: a failure is a warning.
    set_release_pool([](int device, c10::cuda::MempoolId_t pool) {
      if (tensoralloc_release_pool(device, pool.first, pool.second) != 0) {
        TORCH_WARN("tensoralloc: release a graph pool: ", detail::last_error());
      }
    });
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    tensoralloc_device_stats s;
    detail::check(tensoralloc_get_device_stats(device, &s), "read device statistics");
    c10::CachingDeviceAllocator::DeviceStats out;
    out.allocation = detail::to_stat_array(s.allocation);
    out.segment = detail::to_stat_array(s.segment);
    out.active = detail::to_stat_array(s.active);
    out.inactive_split = detail::to_stat_array(s.inactive_split);
    out.allocated_bytes = detail::to_stat_array(s.allocated_bytes);
    out.reserved_bytes = detail::to_stat_array(s.reserved_bytes);
    out.active_bytes = detail::to_stat_array(s.active_bytes);
    out.inactive_split_bytes = detail::to_stat_array(s.inactive_split_bytes);
    out.requested_bytes = detail::to_stat_array(s.requested_bytes);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.oversize_allocations = detail::to_stat(s.oversize_allocations);
    out.oversize_segments = detail::to_stat(s.oversize_segments);
    out.num_sync_all_streams = s.num_sync_all_streams;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    // Both say "no limit" with -1 (PyTorch: the largest size_t, seen through int64_t).
    out.max_split_size = s.max_split_size;
    return out;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    detail::check(tensoralloc_reset_peak_stats(device), "reset peak statistics");
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    detail::check(tensoralloc_reset_accumulated_stats(device), "reset accumulated statistics");
  }

  // torch.compile's CUDA-graph trees take a checkpoint of the graph pool after each
  // recording, and restore one only when they record again in the middle of replaying a path
  // (setCheckpointPoolState). tensoralloc cannot move a pool back to an earlier state, so the
  // checkpoint is a token that only says so, and restoring it raises an error that names the
  // way around it.
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex /*device*/, c10::cuda::MempoolId_t /*id*/) override {
    return std::make_shared<UnrestorableState>();
  }

  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex /*device*/,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> /*pps*/) override {
    TORCH_CHECK(false,
                "tensoralloc cannot restore a CUDA graph pool to a checkpoint, which "
                "torch.compile's CUDA-graph trees need to record a graph while replaying "
                "others: set torch._inductor.config.triton.cudagraph_trees = False (one "
                "CUDA graph per compiled function, no checkpoints), or compile without "
                "mode=\"reduce-overhead\"");
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    double fraction = 1.0;
    detail::check(tensoralloc_get_memory_fraction(device, &fraction), "read the memory fraction");
    return fraction;
  }

 private:
  std::shared_ptr<detail::PoolFilters> filters_ = std::make_shared<detail::PoolFilters>();
};

/// Makes tensoralloc PyTorch's CUDA allocator, with every hook, and returns it. Call it before
/// the first CUDA allocation of the process: PyTorch refuses to swap an allocator that has
/// been initialized (c10::Error "Can't swap an already initialized allocator").
inline std::shared_ptr<Allocator> install() {
  auto allocator = std::make_shared<Allocator>();
  ::torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  return allocator;
}

}  // namespace tensoralloc::torch
