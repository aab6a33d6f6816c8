// mixtape/dsl/json.h -- a small JSON value with a strict parser and a deterministic serializer.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "mixtape/dsl/error.h"

namespace mixtape::json {

class Value;
using Array = std::vector<Value>;
/// A vector rather than a map: dumps then follow the order keys were added (or read), which keeps
/// reports and checkpoint headers stable and diffable.
using Object = std::vector<std::pair<std::string, Value>>;

enum class Kind { null, boolean, number, string, array, object };
std::string_view kind_name(Kind kind);

/// Deeper documents are rejected so hostile input cannot exhaust the stack.
inline constexpr int max_depth = 64;

class Value {
 public:
  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : data_(b) {}
  Value(double d) : data_(d) {}
  template <std::integral T>
  requires(!std::same_as<T, bool>) Value(T n) {
    if (!std::in_range<int64_t>(n)) fail("json: integer {} does not fit in int64", n);
    data_ = static_cast<int64_t>(n);
  }
  Value(std::string s) : data_(std::move(s)) {}
  Value(std::string_view s) : data_(std::string(s)) {}
  // Without this a string literal would silently pick the bool constructor.
  Value(const char* s) : data_(std::string(s)) {}
  Value(Array a) : data_(std::move(a)) {}
  Value(Object o) : data_(std::move(o)) {}

  Kind kind() const;
  bool is_null() const { return kind() == Kind::null; }
  bool is_bool() const { return kind() == Kind::boolean; }
  bool is_number() const { return kind() == Kind::number; }
  /// True only for numbers held exactly as int64 (integer text, or built from an integer).
  bool is_integer() const { return std::holds_alternative<int64_t>(data_); }
  bool is_string() const { return kind() == Kind::string; }
  bool is_array() const { return kind() == Kind::array; }
  bool is_object() const { return kind() == Kind::object; }

  // Each throws mt::Error naming the expected and the actual kind.
  bool as_bool() const;
  double as_double() const;  // any number
  int64_t as_int() const;    // exact integers only; 1.0 or 1e3 are refused
  const std::string& as_string() const;
  const Array& as_array() const;
  Array& as_array();
  const Object& as_object() const;
  Object& as_object();

  /// Object lookup: nullptr when the key is absent.
  const Value* find(std::string_view key) const;
  /// Object lookup that throws mt::Error naming the key when it is absent.
  const Value& at(std::string_view key) const;
  const Value& at(size_t index) const;
  /// Replaces the value of an existing key in place (keeping its position), else appends.
  Value& set(std::string key, Value value);
  void push_back(Value value);
  /// Element count of an array or object.
  size_t size() const;

  bool operator==(const Value& other) const = default;

 private:
  std::variant<std::nullptr_t, bool, int64_t, double, std::string, Array, Object> data_;
};

/// Parses exactly one JSON document (RFC 8259) with surrounding whitespace. Throws mt::Error with
/// the byte offset for anything malformed, including duplicate keys, invalid UTF-8, lone
/// surrogates, numbers too large for a double and nesting deeper than max_depth. Integer text
/// that fits int64 is kept exact; larger integers become doubles.
Value parse(std::string_view text);

/// As parse(), but a document of more than max_values values (every array element, object
/// member value and the root count one) is an error, raised as soon as the count is passed: the
/// parsed tree costs tens of bytes per value, so this bounds the memory hostile text can claim.
Value parse(std::string_view text, size_t max_values);

/// Called with each member of a top-level object, its key and the key's byte offset.
using MemberVisitor = std::function<void(std::string key, Value value, size_t key_offset)>;

/// Parses a document that must be one object, handing each member to visit as soon as it is
/// read and then dropping it, so memory is bounded by the largest member rather than the whole
/// document; each member may hold at most max_values values. Duplicate top-level keys are not
/// detected here (the visitor sees every member); nested objects are checked as by parse().
void parse_members(std::string_view text, size_t max_values, const MemberVisitor& visit);

/// Compact, deterministic JSON. Doubles use the shortest text that reads back to the same bits
/// and always carry a '.' or exponent so they read back as doubles. Throws mt::Error for NaN,
/// infinities and strings that are not valid UTF-8, none of which JSON can carry.
std::string dump(const Value& value);

}  // namespace mixtape::json
