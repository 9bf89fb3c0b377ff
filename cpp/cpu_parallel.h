// Splitting a CPU kernel's work over XLA's intra-op thread pool.
//
// The FFI handler runs synchronously, so it must not return before every
// piece of its work is done, and it must never wait on a task that the pool
// has not started: the pool may be busy (other thunks of the same program,
// or the very thread running this handler). So the work is cut into more
// chunks than workers, every worker (the calling thread included) claims
// chunks from a shared counter until none is left, and the caller waits only
// for chunks that another worker has already claimed. A task that starts
// after all chunks are claimed returns at once; the shared state it touches
// lives as long as the last task that holds it.
//
// Chunks are disjoint ranges of the caller's output units, so what a chunk
// computes does not depend on which thread runs it or on how many threads
// there are.
#ifndef JAX_AVGPOOL_CPU_PARALLEL_H_
#define JAX_AVGPOOL_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jax_avgpool {

// Below this many element operations per worker (some microseconds of
// work), handing work to another thread costs more than it saves: waking a
// pool thread takes microseconds too.
inline constexpr int64_t kMinWorkPerThread = int64_t{1} << 15;

// Chunks per worker: enough that a worker which starts late, or a slower
// core, does not leave the others idle at the end.
inline constexpr int64_t kChunksPerWorker = 4;

namespace internal {

struct ParallelState {
  int64_t units = 0;
  int64_t chunks = 0;
  // The caller's body, type-erased; only called for a claimed chunk, while
  // the caller is still waiting, so the pointee is alive.
  void (*run)(const void* body, int64_t begin, int64_t end) = nullptr;
  const void* body = nullptr;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  // Claims and runs chunks until none is left.
  void Drain() {
    for (int64_t k;
         (k = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      run(body, k * units / chunks, (k + 1) * units / chunks);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) {
        // Taking the lock orders this notification after the waiter's check
        // of `done`, so the wake-up cannot be lost.
        {
          std::lock_guard<std::mutex> lock(mu);
        }
        all_done.notify_all();
      }
    }
  }
};

}  // namespace internal

// Runs body(begin, end) over disjoint ranges covering [0, units), on the
// calling thread and, when the work is large enough, on `pool` too.
// `work_per_unit` estimates the element operations of one unit.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool* pool, int64_t units,
                 int64_t work_per_unit, const Body& body) {
  if (units <= 0) return;
  const int64_t threads = pool ? pool->num_threads() : 0;
  const int64_t work = units * std::max<int64_t>(work_per_unit, 1);
  const int64_t workers = std::min({threads, units, work / kMinWorkPerThread});
  if (workers <= 1) {
    body(int64_t{0}, units);
    return;
  }
  auto state = std::make_shared<internal::ParallelState>();
  state->units = units;
  state->chunks = std::min(units, workers * kChunksPerWorker);
  state->body = &body;
  state->run = [](const void* b, int64_t begin, int64_t end) {
    (*static_cast<const Body*>(b))(begin, end);
  };
  for (int64_t i = 1; i < workers; ++i) {
    pool->Schedule([state] { state->Drain(); });
  }
  state->Drain();
  std::unique_lock<std::mutex> lock(state->mu);
  state->all_done.wait(lock, [&] {
    return state->done.load(std::memory_order_acquire) == state->chunks;
  });
}

}  // namespace jax_avgpool

#endif  // JAX_AVGPOOL_CPU_PARALLEL_H_
