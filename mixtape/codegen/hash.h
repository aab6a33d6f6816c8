// mixtape/codegen/hash.h -- a stable 128-bit non-cryptographic hash (XXH3-128) for cache keys, with
// framing.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace mixtape {

/// A 128-bit digest: XXH3-128 of the bytes fed (xxHash's specified, stable output). Names files in
/// the on-disk kernel cache, so its value for a given input is part of the cache's on-disk format:
/// it must never change between builds or machines.
struct Hash128 {
  uint64_t lo = 0;
  uint64_t hi = 0;

  /// 32 lowercase hex digits, `hi` first.
  std::string hex() const;

  friend bool operator==(const Hash128&, const Hash128&) = default;
};

/// Accumulates input piece by piece (the keys hashed are kernel texts of a few kilobytes, so the
/// bytes are kept and hashed at once by finish()). Raw bytes fed through update_bytes() hash
/// exactly like the same bytes given to hash_bytes() in one piece, however they are split. The
/// typed update() overloads frame each value with a type tag (and strings with their length), so
/// sequences of fields cannot run into each other: ("ab", "c") and ("a", "bc") hash differently.
/// Not resistant to deliberate collisions; do not use it where an attacker chooses the input.
class Hasher {
 public:
  /// Raw bytes, without framing.
  Hasher& update_bytes(std::span<const std::byte> bytes);

  /// A string, framed by its length.
  Hasher& update(std::string_view text);

  /// An integer, as its 64-bit two's complement value: equal values of any width and signedness
  /// hash the same (so -1 and UINT64_MAX collide).
  template <std::integral Integer>
  Hasher& update(Integer value) {
    if constexpr (std::is_signed_v<Integer>)
      return update_integer(static_cast<uint64_t>(static_cast<int64_t>(value)));
    else
      return update_integer(static_cast<uint64_t>(value));
  }

  /// An enumerator, as its underlying integer.
  template <typename Enum>
  requires std::is_enum_v<Enum> Hasher& update(Enum value) {
    return update(static_cast<std::underlying_type_t<Enum>>(value));
  }

  /// A floating-point value by its bits: 0.0 and -0.0 differ, as do NaNs with different payloads.
  Hasher& update(double value);

  /// The digest of everything fed so far; the Hasher can keep going afterwards.
  Hash128 finish() const;

 private:
  Hasher& update_integer(uint64_t value);

  std::vector<std::byte> bytes_;
};

Hash128 hash_bytes(std::span<const std::byte> bytes);
Hash128 hash_string(std::string_view text);

}  // namespace mixtape

template <>
struct std::hash<mixtape::Hash128> {
  size_t operator()(const mixtape::Hash128& hash) const noexcept {
    return static_cast<size_t>(hash.lo);
  }
};
