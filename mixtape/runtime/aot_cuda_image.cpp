// mixtape/runtime/aot_cuda_image.cpp -- which of an artifact's CUDA images a GPU runs.
#include "mixtape/runtime/aot_cuda_image.h"

#include <charconv>

#include "mixtape/dsl/error.h"

namespace mixtape::aot {

int cuda_image_for(const std::vector<std::string>& archs, int compute_capability) {
  int chosen = -1, chosen_number = 0;
  bool chosen_cubin = false;
  for (size_t i = 0; i < archs.size(); ++i) {
    const std::string& arch = archs[i];
    bool cubin = arch.starts_with("sm_");
    if (!cubin && !arch.starts_with("compute_"))
      fail("the manifest names an arch '{}' (sm_NN or compute_NN)", arch);
    std::string digits = arch.substr(arch.find('_') + 1);
    int number = 0;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), number);
    if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size())
      fail("the manifest names an arch '{}' (sm_NN or compute_NN)", arch);
    // A CUBIN runs on its major version from its minor one up; PTX on every newer GPU.
    bool runs = number <= compute_capability && (!cubin || number / 10 == compute_capability / 10);
    // A CUBIN beats PTX (nothing to compile at open); the newest of a kind beats older ones.
    if (runs && (chosen < 0 || (cubin && !chosen_cubin) ||
                 (cubin == chosen_cubin && number > chosen_number))) {
      chosen = static_cast<int>(i);
      chosen_number = number;
      chosen_cubin = cubin;
    }
  }
  return chosen;
}

}  // namespace mixtape::aot
