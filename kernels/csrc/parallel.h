// Work shared out in chunks that the threads take in turn, for cores the engine does not have
// to itself. A serving worker's cores also run its frontend, the master, the cache service,
// its own event loop: each time the OS runs one of them on a core, the engine thread there
// stops. With a static split (at::parallel_for) its whole share waits for it, and the other
// threads wait at the region's end: on 2 cores a competitor using 5% of one core cost a
// decode step 6-17% (bench/interference.py). Here a thread holds up only the chunk it is on;
// the others take the rest.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace rtp {

// The chunks of [0, n), handed out in order to whichever thread asks first.
class Chunks {
 public:
  Chunks(int64_t n, int64_t chunk) : n_(n), chunk_(std::max<int64_t>(1, chunk)) {}
  // The next chunk [begin, end); false when none is left.
  bool next(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (begin >= n_) return false;
    end = std::min(n_, begin + chunk_);
    return true;
  }
  int64_t count() const { return (n_ + chunk_ - 1) / chunk_; }

 private:
  const int64_t n_, chunk_;
  std::atomic<int64_t> next_{0};
};

// Runs body(chunks) once on each thread of a parallel region (no more threads than chunks);
// the bodies take chunks of [0, n) until none is left. Per-thread scratch belongs in the body,
// before its loop over chunks. Nested in a parallel region, one body takes them all.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& body) {
  if (n <= 0) return;
  Chunks chunks(n, chunk);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks.count());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(chunks); });
}

// A chunk size giving each thread about `per_thread` chunks of n: enough for the others to
// take a stalled thread's share, few enough that taking one costs nothing.
inline int64_t chunk_for(int64_t n, int64_t per_thread = 8) {
  return std::max<int64_t>(1, n / (per_thread * std::max<int64_t>(1, at::get_num_threads())));
}

// The driver of a GEMM over column panels (packed_gemm, int8_gemm): threads take panels of
// NR output columns in chunks; each panel's rows go in tiles of up to MR, computed by
// tile(panel, row, rows, c) into c [MR][NR] (per-thread scratch of acc_t), each row of
// which store(row, first column, columns, c row) finishes into the output (the last panel
// may be narrower than NR).
template <int64_t MR, int64_t NR, typename acc_t, typename Tile, typename Store>
void over_panels(int64_t M, int64_t N, const Tile& tile, const Store& store) {
  const int64_t P = (N + NR - 1) / NR;
  parallel_chunks(P, chunk_for(P), [&](Chunks& chunks) {
    alignas(64) acc_t c[MR * NR];
    for (int64_t p0, p1; chunks.next(p0, p1);) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
        for (int64_t m = 0; m < M; m += MR) {
          const int64_t mr = std::min(MR, M - m);
          tile(p, m, mr, c);
          for (int64_t r = 0; r < mr; ++r) store(m + r, n0, cols, c + r * NR);
        }
      }
    }
  });
}

}  // namespace rtp
