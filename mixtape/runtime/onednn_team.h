// mixtape/runtime/onednn_team.h -- a scope that fixes the OpenMP team the oneDNN calls made inside
// it plan for and run on.
#pragma once

#include <omp.h>

#include <algorithm>

namespace mixtape {

// While one lives, the calling thread's OpenMP team for oneDNN: one thread when `single` (problems
// too small to gain from the team), else the caller's threads but at most OMP_THREAD_LIMIT; in
// both, no dynamic adjustment. oneDNN plans a primitive's work for omp_get_max_threads() threads
// when it makes it (a one-thread primitive runs without a parallel region) and hands each thread
// of the team it gets its share of that plan: a team that OMP_DYNAMIC or a thread limit below
// OMP_NUM_THREADS made smaller left shares uncomputed, wrong sums without an error (test_gemm and
// test_conv under OMP_THREAD_LIMIT=1 OMP_NUM_THREADS=2).
class OnednnTeam {
 public:
  explicit OnednnTeam(bool single)
      : saved_threads_(omp_get_max_threads()), saved_dynamic_(omp_get_dynamic() != 0) {
    const int threads = single ? 1 : std::min(saved_threads_, omp_get_thread_limit());
    if (threads != saved_threads_) omp_set_num_threads(threads);
    if (saved_dynamic_) omp_set_dynamic(0);
  }
  OnednnTeam(const OnednnTeam&) = delete;
  OnednnTeam& operator=(const OnednnTeam&) = delete;
  ~OnednnTeam() {
    if (omp_get_max_threads() != saved_threads_) omp_set_num_threads(saved_threads_);
    if (saved_dynamic_) omp_set_dynamic(1);
  }

 private:
  int saved_threads_;
  bool saved_dynamic_;
};

}  // namespace mixtape
