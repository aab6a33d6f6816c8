// runtime/safetensors.h -- reading and writing checkpoints in the safetensors format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dsl/dtype.h"

// Layout, compatible with Python's `safetensors` package: an 8-byte little-endian header length N,
// N bytes of JSON mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (plus an optional "__metadata__" object of strings), then the data section, which the tensors
// cover exactly, without gaps or overlaps. Offsets count from the start of the data section.
namespace mixtape::safetensors {

struct TensorData {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;    // empty for a 0-d tensor
  std::vector<std::byte> bytes;  // row-major, little-endian
};

struct File {
  std::vector<TensorData> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;

  /// nullptr when there is no tensor of that name.
  const TensorData* find(std::string_view name) const;
};

/// Hostile headers can cost parse time and memory proportional to their length, so, like the
/// reference implementation, longer ones are refused.
inline constexpr uint64_t max_header_bytes = 100'000'000;

/// Writes "<path>.tmp.<pid>", syncs it and renames it over path, so readers never see a partial
/// checkpoint. Throws mt::Error naming path if the file is invalid (a byte count that does not
/// match dtype and shape, an empty, duplicate or reserved name, a duplicate metadata key) or on
/// any I/O failure; no temporary file is left behind either way.
void write(const std::string& path, const File& file);

/// Reads and fully validates a file; tensors come back in data-section order, which for files
/// from write() is the order they were written in. Throws mt::Error naming path on failure.
File read(const std::string& path);

/// As read(), from bytes in memory; origin names the source in error messages.
File parse(std::span<const std::byte> bytes, std::string_view origin);

/// The exact bytes write() puts on disk.
std::vector<std::byte> serialize(const File& file);

}  // namespace mixtape::safetensors
