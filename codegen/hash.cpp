// codegen/hash.cpp -- the 128-bit hash: two multiply-rotate lanes over 8-byte words, then mixed.
#include "codegen/hash.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include <fmt/format.h>

namespace mixtape {

namespace {

// Odd 64-bit constants with well-spread bits. Multiplying by an odd constant, rotating and
// xor-shifting are all invertible, so no step below throws information away.
constexpr uint64_t multiplier_a = 0x9E3779B97F4A7C15ull;
constexpr uint64_t multiplier_b = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t multiplier_c = 0x165667B19E3779F9ull;
constexpr uint64_t multiplier_d = 0xD6E8FEB86659FD93ull;
constexpr uint64_t multiplier_e = 0xFF51AFD7ED558CCDull;
constexpr uint64_t initial_lane_a = 0x6D69787461706531ull;  // "mixtape1"
constexpr uint64_t initial_lane_b = multiplier_b;

constexpr std::byte tag_string{'s'};
constexpr std::byte tag_integer{'i'};
constexpr std::byte tag_double{'d'};

// Spreads every input bit over the whole word; a bijection, so distinct states stay distinct.
uint64_t scramble(uint64_t x) {
  x ^= x >> 31;
  x *= multiplier_d;
  x ^= x >> 29;
  x *= multiplier_b;
  x ^= x >> 32;
  return x;
}

// Bytes are read little-endian whatever the host, so the digest (and the cache file names built
// from it) are the same on every machine.
uint64_t load_little_endian(const std::byte* bytes) {
  uint64_t word;
  std::memcpy(&word, bytes, sizeof word);
  if constexpr (std::endian::native == std::endian::big) word = __builtin_bswap64(word);
  return word;
}

std::array<std::byte, 8> little_endian_bytes(uint64_t value) {
  std::array<std::byte, 8> bytes;
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::byte((value >> (8 * i)) & 0xFF);
  return bytes;
}

}  // namespace

std::string Hash128::hex() const { return fmt::format("{:016x}{:016x}", hi, lo); }

Hasher::Hasher() : lane_a_(initial_lane_a), lane_b_(initial_lane_b) {}

// For a fixed word the update is a bijection of the (a, b) state, and for a fixed state lane a is
// a bijection of the word: two inputs of equal length that differ in one word never meet.
void Hasher::absorb_word(uint64_t word) {
  uint64_t a = std::rotl((lane_a_ ^ word) * multiplier_a, 31) + lane_b_;
  uint64_t b = std::rotl((lane_b_ + word) * multiplier_c, 27) ^ a;
  lane_a_ = a;
  lane_b_ = b;
}

Hasher& Hasher::update_bytes(std::span<const std::byte> bytes) {
  total_bytes_ += bytes.size();
  size_t used = 0;
  if (pending_count_ > 0) {
    size_t take = std::min(bytes.size(), pending_.size() - pending_count_);
    std::memcpy(pending_.data() + pending_count_, bytes.data(), take);
    pending_count_ += take;
    used = take;
    if (pending_count_ < pending_.size()) return *this;
    absorb_word(load_little_endian(pending_.data()));
    pending_count_ = 0;
  }
  for (; used + 8 <= bytes.size(); used += 8) absorb_word(load_little_endian(bytes.data() + used));
  pending_count_ = bytes.size() - used;
  if (pending_count_ > 0) std::memcpy(pending_.data(), bytes.data() + used, pending_count_);
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

Hash128 Hasher::finish() const {
  Hasher last = *this;
  // The tail is padded with a 0x80 byte after the data, so "" and "\0" (and any two inputs that
  // differ only by trailing zero bytes) end in different words; the length is mixed in as well.
  std::array<std::byte, 8> tail{};
  std::memcpy(tail.data(), pending_.data(), pending_count_);
  tail[pending_count_] = std::byte{0x80};
  last.absorb_word(load_little_endian(tail.data()));
  last.absorb_word(total_bytes_ * multiplier_e);
  Hash128 digest;
  digest.lo = scramble(last.lane_a_ + std::rotl(last.lane_b_, 23));
  digest.hi = scramble(last.lane_b_ ^ digest.lo);
  return digest;
}

Hash128 hash_bytes(std::span<const std::byte> bytes) {
  return Hasher().update_bytes(bytes).finish();
}

Hash128 hash_string(std::string_view text) {
  return hash_bytes(std::as_bytes(std::span(text.data(), text.size())));
}

}  // namespace mixtape
