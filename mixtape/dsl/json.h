// mixtape/dsl/json.h -- nlohmann's JSON, with the strict reader untrusted files need. For the
// library's own sources: not installed and in no installed header, so consumers need no JSON.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace mixtape::json {

/// Objects keep their keys in the order they were added or read, so reports, checkpoint headers
/// and artifact files dump stable and diffable.
using Value = nlohmann::ordered_json;

/// Deeper documents are rejected so that hostile input cannot claim unbounded memory.
inline constexpr int max_depth = 64;

/// Parses exactly one JSON document (RFC 8259). Throws mt::Error for anything malformed (with
/// the byte offset nlohmann's lexer gives: invalid UTF-8, lone surrogates, numbers too large for
/// a double, trailing text) and for what nlohmann itself would accept: duplicate keys, nesting
/// deeper than max_depth, and more than max_values values (every array element, member value
/// and the root count one: the tree costs tens of bytes a value, so this bounds the memory
/// hostile text can claim). Integers beyond int64 read as doubles, so every integer is an int64.
Value parse(std::string_view text, size_t max_values = SIZE_MAX);

/// Called with each member of a top-level object.
using MemberVisitor = std::function<void(std::string key, Value value)>;

/// Parses a document that must be one object, handing each member to `visit` as soon as it is
/// read and then dropping it, so memory is bounded by the largest member, not the document; each
/// member may hold at most max_values values. Duplicate top-level keys are left to the visitor,
/// which sees every member; nested objects are checked as by parse().
void parse_members(std::string_view text, size_t max_values, const MemberVisitor& visit);

/// Compact JSON. Throws mt::Error for a string that is not valid UTF-8 (NaN and infinities,
/// which JSON cannot hold, dump as null).
std::string dump(const Value& value);

/// Appends a member without the search for an equal key that ordered_json's insertion does (a
/// linear one): for objects of many members whose keys the caller knows are distinct.
void append(Value& object, std::string key, Value value);

/// The integer `value` holds; mt::Error for anything else (1.5 or "1", which nlohmann's
/// get<int64_t>() would truncate or refuse with its own exception).
int64_t as_int(const Value& value);

/// The member `key` of an object; nullptr when absent or `object` is no object.
const Value* find(const Value& object, std::string_view key);

}  // namespace mixtape::json
