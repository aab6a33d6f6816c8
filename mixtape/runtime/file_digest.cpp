// mixtape/runtime/file_digest.cpp -- streams a file through XXH3-64.
#include "mixtape/runtime/file_digest.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "mixtape/dsl/error.h"

namespace mixtape {

FileDigest digest_file(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), std::fclose);
  if (!file) fail("{}: cannot open: {}", path, std::strerror(errno));
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(),
                                                                        XXH3_freeState);
  if (!state || XXH3_64bits_reset(state.get()) != XXH_OK) fail("{}: out of memory", path);
  std::vector<char> chunk(1 << 16);
  FileDigest digest;
  while (size_t n = std::fread(chunk.data(), 1, chunk.size(), file.get())) {
    XXH3_64bits_update(state.get(), chunk.data(), n);
    digest.bytes += static_cast<int64_t>(n);
  }
  if (std::ferror(file.get())) fail("{}: read error: {}", path, std::strerror(errno));
  digest.xxh3_64 = fmt::format("{:016x}", XXH3_64bits_digest(state.get()));
  return digest;
}

}  // namespace mixtape

namespace mixtape {

FileDigest digest_bytes(std::string_view bytes) {
  return {static_cast<int64_t>(bytes.size()),
          fmt::format("{:016x}", XXH3_64bits(bytes.data(), bytes.size()))};
}

}  // namespace mixtape
