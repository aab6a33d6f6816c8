// tests/mpi/stalled_rank.cpp -- run by tests/mpi/stalled_rank_test.sh under mpirun -np 2: rank 1
// never joins an all_reduce, and rank 0 must fail with an mt::Error after the timeout (1 s here)
// instead of waiting forever.
#include <chrono>
#include <cstdio>
#include <thread>

#include <mixtape/mixtape.h>

namespace mt = mixtape;

int main() {
  mt::dist::World world = mt::dist::init();
  if (world.size != 2) {
    std::printf("skipped: needs mpirun -np 2 (%s)\n", world.single_reason.c_str());
    return 0;
  }
  mt::dist::set_timeout(1.0);
  if (world.rank == 1) {  // stalls, then leaves without joining
    std::this_thread::sleep_for(std::chrono::seconds(4));
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    mt::all_reduce(mt::ones({4})).to_vector<float>();
    std::printf("rank 0: the all_reduce completed without rank 1\n");
  } catch (const mt::Error& e) {
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("rank 0: mt::Error after %.1f s: %s\n", waited, e.what());
    try {
      mt::all_reduce(mt::ones({4})).to_vector<float>();
    } catch (const mt::Error& again) {
      std::printf("rank 0: then: %s\n", again.what());
    }
  }
  std::fflush(stdout);
  return 3;  // as a program would that gives up; mpirun then ends the job
}
