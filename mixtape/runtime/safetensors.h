// mixtape/runtime/safetensors.h -- reading and writing checkpoints in the safetensors format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixtape/dsl/dtype.h"

// Layout, compatible with Python's `safetensors` package: an 8-byte little-endian header length N,
// N bytes of JSON mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (plus an optional "__metadata__" object of strings), then the data section, which the tensors
// cover exactly, without gaps or overlaps. Offsets count from the start of the data section.
//
// Integrity: write() stores the XXH3-64 of each tensor's bytes in the metadata entry
// "mixtape.checksum.xxh3_64", whose value is the text of a JSON object {"<tensor>": "<16 hex
// digits>"}; a string, so every safetensors reader still reads the file. read() and parse()
// verify it (a mismatch is an mt::Error naming the tensor and the file) and take it out of
// File::metadata; files without it, from other writers, load unverified. The entry
// "mixtape.checksum.header_xxh3_64" (16 hex digits) covers the rest of the header: the other
// metadata sorted by key, then each tensor's name, dtype tag and shape sorted by name, each
// string as its u64 LE length and bytes and each count and dim as a u64 LE. A damaged metadata
// value (a step count, a generator offset) or shape is an error, not a silently different load.
// Files written before it existed lack it and load with the tensors' checksums alone.
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

/// Limits on what a header may hold, so that a hostile one costs time and memory of a small
/// multiple of its length (the reader parses it member by member, checking as it goes), and
/// each is a clear mt::Error. Like the reference implementation, longer headers are refused.
inline constexpr uint64_t max_header_bytes = 100'000'000;
inline constexpr size_t max_tensors = size_t{1} << 18;
inline constexpr size_t max_metadata_entries = size_t{1} << 16;
/// Metadata keys starting with this are mixtape's own; write() refuses them in File::metadata.
inline constexpr std::string_view reserved_metadata_prefix = "mixtape.checksum.";

/// Writes the file atomically through write_file_atomically (runtime/atomic_file.h): a unique
/// temporary in path's folder, synced and renamed over path, so readers and a crash never see a
/// partial or mixed checkpoint, even with two writers at once; a symbolic link at path is written
/// through to its target, an existing file keeps its mode, and dead writers' leftover temporaries
/// are removed. Throws mt::Error naming path if the file is invalid (a byte count that does not
/// match dtype and shape, an empty, duplicate or reserved name, a duplicate or reserved metadata
/// key, more than the limits) or on any I/O failure; no temporary file is left behind either way.
void write(const std::string& path, const File& file);

/// A tensor to write whose bytes live elsewhere (a Storage's), so that a save holds no second
/// copy of a checkpoint in memory.
struct TensorView {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
};
struct FileView {
  std::vector<TensorView> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;
};
/// As write(path, File), from bytes the caller keeps alive until it returns.
void write(const std::string& path, const FileView& file);

/// Reads and fully validates a file; tensors come back in data-section order, which for files
/// from write() is the order they were written in. Throws mt::Error naming path on failure: a
/// file that is not safetensors says "not a safetensors file: <path> (...)"; every size the
/// header declares is checked against the real file size before anything is allocated by it;
/// a corrupt tensor (checksum mismatch) names the tensor; running out of memory names the bytes.
File read(const std::string& path);

/// As read(), from bytes in memory; origin names the source in error messages.
File parse(std::span<const std::byte> bytes, std::string_view origin);

/// The exact bytes write() puts on disk.
std::vector<std::byte> serialize(const File& file);

}  // namespace mixtape::safetensors
