// mixtape/runtime/aot_cuda_image.h -- which of an artifact's CUDA images (CUBINs, PTX) a GPU runs.
#pragma once

#include <string>
#include <vector>

namespace mixtape::aot {

/// The index in `archs` (the manifest's images: "sm_80", "sm_90", "compute_80") of the image a
/// GPU of `compute_capability` (86 for 8.6) runs: the newest CUBIN of its major version at or
/// below it (an sm_80 CUBIN runs on every 8.x, not on 9.0), else the newest PTX at or below it,
/// which the driver compiles; -1 when none runs. An mt::Error for a name that is neither sm_NN
/// nor compute_NN.
int cuda_image_for(const std::vector<std::string>& archs, int compute_capability);

}  // namespace mixtape::aot
