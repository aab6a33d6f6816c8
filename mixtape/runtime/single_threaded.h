// mixtape/runtime/single_threaded.h -- a scope that runs the library calls made inside it (oneDNN
// primitives) on the calling thread alone, for problems too small to gain from the OpenMP team.
#pragma once

#include <omp.h>

namespace mixtape {

// Limits the calling thread's OpenMP team to one thread while it lives. oneDNN reads the limit
// when it creates a primitive and runs a one-thread primitive without a parallel region.
class SingleThreaded {
 public:
  explicit SingleThreaded(bool active) : saved_(active ? omp_get_max_threads() : 0) {
    if (active) omp_set_num_threads(1);
  }
  SingleThreaded(const SingleThreaded&) = delete;
  SingleThreaded& operator=(const SingleThreaded&) = delete;
  ~SingleThreaded() {
    if (saved_ > 0) omp_set_num_threads(saved_);
  }

 private:
  int saved_;
};

}  // namespace mixtape
