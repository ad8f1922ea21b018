// torch's intra-op thread pool, seen from torch-free kernel files (defined in bindings.cpp).
#pragma once
#include <cstdint>
#include <functional>

namespace kvr {

// Runs body(begin, end) over [0, n) split across torch's threads (like at::parallel_for).
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

// How many threads parallel_for splits over from here (1 inside a parallel region).
int num_threads();

}  // namespace kvr
