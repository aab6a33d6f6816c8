// mixtape/runtime/file_digest.h -- the size and XXH3-64 of a file, as an artifact's manifest
// records them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace mixtape {

struct FileDigest {
  int64_t bytes = 0;
  std::string xxh3_64;  // 16 lowercase hex digits
};

/// Reads `path` whole (streamed); an mt::Error naming it when it cannot be read.
FileDigest digest_file(const std::string& path);
/// The same for bytes in memory.
FileDigest digest_bytes(std::string_view bytes);

}  // namespace mixtape
