// Binds each thread of the calling thread's parallel team (torch's OpenMP team: the engine
// thread and its helpers) to one CPU of its own, as vLLM's CPU backend binds its threads. A
// GEMM thread that the OS moves to another core leaves its caches behind; bound, a lone
// 270-token prefill of llama-100m took 0.93-0.95x as long on 2 cores (AMD EPYC, AVX-512).
#include "tensor.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <vector>

// cpus[i] for the team's thread i (i < the team's size); returns the CPU each thread was
// bound to, -1 where the OS refused.
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus) {
  const int64_t n = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(cpus.size()));
  std::vector<int64_t> bound(n, -1);
  // Grain 1 over as many items as threads: thread i of the region takes item i alone.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i]), &set);
      if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0) bound[i] = cpus[i];
    }
  });
  return bound;
}
