// mixtape/runtime/cuda_values.h -- device memory of graph values, for the CUDA executor's own steps
// (runtime/cuda_executor.cpp defines these; runtime/cuda_fixed_kernels.cpp uses them).
#pragma once

#include <cstdint>
#include <memory>

#include "mixtape/dsl/node.h"
#include "mixtape/runtime/cuda_driver.h"

namespace mixtape {

/// The device address of a value, uploading a host value the first time a GPU step reads it.
cuda::CUdeviceptr device_address(Storage& storage);
/// A fresh device value of `count` elements (its host bytes are fetched when first read).
std::shared_ptr<Storage> device_value(DType dtype, int64_t count);
/// A GPU copy of `value` in a buffer of its own, queued on the compute stream (no wait).
std::shared_ptr<Storage> copy_on_device(Storage& value);
/// A GPU copy of `value` converted to `dtype` (both f32, f16 or bf16), rounded as the CPU
/// back end's conversions round (RNE).
std::shared_ptr<Storage> convert_on_device(Storage& value, DType dtype);
/// Input i's value in the node's storage dtype, converted on the GPU where it must be, or null
/// when that takes a conversion the GPU does not do (runtime/cuda_fixed_kernels.cpp defines it).
std::shared_ptr<Storage> input_on_device(const Node& node, size_t i);

}  // namespace mixtape
