// mixtape/codegen/hash.cpp -- Hasher: typed framing of fields over XXH3-128 (xxHash, header-only).
#include "mixtape/codegen/hash.h"

#include <bit>

#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace mixtape {

namespace {

constexpr std::byte tag_string{'s'};
constexpr std::byte tag_integer{'i'};
constexpr std::byte tag_double{'d'};

// Numbers are framed little-endian whatever the host, so the digest (and the cache file names
// built from it) are the same on every machine.
std::array<std::byte, 8> little_endian_bytes(uint64_t value) {
  std::array<std::byte, 8> bytes;
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::byte((value >> (8 * i)) & 0xFF);
  return bytes;
}

}  // namespace

std::string Hash128::hex() const { return fmt::format("{:016x}{:016x}", hi, lo); }

Hasher& Hasher::update_bytes(std::span<const std::byte> bytes) {
  bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
  return *this;
}

Hasher& Hasher::update(std::string_view text) {
  update_bytes(std::span(&tag_string, 1));
  update_bytes(little_endian_bytes(text.size()));
  return update_bytes(std::as_bytes(std::span(text.data(), text.size())));
}

Hasher& Hasher::update_integer(uint64_t value) {
  update_bytes(std::span(&tag_integer, 1));
  return update_bytes(little_endian_bytes(value));
}

Hasher& Hasher::update(double value) {
  update_bytes(std::span(&tag_double, 1));
  return update_bytes(little_endian_bytes(std::bit_cast<uint64_t>(value)));
}

Hash128 Hasher::finish() const { return hash_bytes(bytes_); }

Hash128 hash_bytes(std::span<const std::byte> bytes) {
  XXH128_hash_t digest = XXH3_128bits(bytes.data(), bytes.size());
  return {digest.low64, digest.high64};
}

Hash128 hash_string(std::string_view text) {
  return hash_bytes(std::as_bytes(std::span(text.data(), text.size())));
}

}  // namespace mixtape
