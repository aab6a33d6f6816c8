// mixtape/dsl/json.cpp -- the strict reader: nlohmann's lexer and parser, driving a SAX handler
// that builds the tree and enforces what nlohmann does not (duplicate keys, depth, value counts).
#include "mixtape/dsl/json.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "mixtape/dsl/error.h"

namespace mixtape::json {
namespace {

using Members = Value::object_t::Container;  // the vector under ordered_json's objects

/// nlohmann's message without its "[json.exception.parse_error.101] parse error at line 1,
/// column 4: " prefix: the caller adds the byte offset.
std::string_view message_of(const nlohmann::json::exception& e) {
  std::string_view text = e.what();
  if (size_t tag = text.find("] "); tag != std::string_view::npos) text.remove_prefix(tag + 2);
  if (text.starts_with("parse error"))
    if (size_t colon = text.find(": "); colon != std::string_view::npos)
      text.remove_prefix(colon + 2);
  return text;
}

/// Builds the tree as nlohmann's own DOM parser does, but appends members without its linear
/// search for the key and checks for duplicates once per object, by sorting (hostile text may
/// hold millions of keys). With a visitor, the top-level object's members are handed over one
/// by one instead of kept.
class StrictBuilder {
 public:
  StrictBuilder(size_t max_values, const MemberVisitor* visit)
      : max_values_(max_values), visit_(visit) {}

  Value take_root() { return std::move(root_); }

  bool null() { return scalar(nullptr); }
  bool boolean(bool b) { return scalar(b); }
  bool number_integer(int64_t n) { return scalar(n); }
  bool number_unsigned(uint64_t n) {
    if (n <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return scalar(static_cast<int64_t>(n));
    return scalar(static_cast<double>(n));
  }
  bool number_float(double d, const std::string& /*text*/) { return scalar(d); }
  bool string(std::string& s) { return scalar(std::move(s)); }
  bool binary(Value::binary_t& /*bytes*/) { return false; }  // not in JSON text

  bool start_object(size_t /*elements*/) {
    if (visit_ && depth_ == 0) {  // the streamed object: its members are not kept
      ++depth_;
      return true;
    }
    return open(Value::object());
  }
  bool start_array(size_t /*elements*/) { return open(Value::array()); }
  bool key(std::string& key) {
    key_ = std::move(key);
    return true;
  }
  bool end_object() {
    if (open_.empty()) {  // the streamed object
      --depth_;
      return true;
    }
    check_unique_keys(open_.back()->get_ref<const Value::object_t&>());
    return close();
  }
  bool end_array() { return close(); }

  bool parse_error(size_t position, const std::string& /*token*/,
                   const nlohmann::json::exception& e) {
    fail("json: {} at byte {}", message_of(e), position);
  }

 private:
  bool streaming_member() const { return visit_ && depth_ == 1; }

  void count() {
    if (visit_ && depth_ == 0) fail("json: expected an object");
    if (streaming_member()) {
      values_ = 0;
      member_ = key_;
    }
    if (++values_ <= max_values_) return;
    if (visit_)
      fail("json: member \"{}\" holds more than {} values, the limit", member_, max_values_);
    fail("json: more than {} values, the limit", max_values_);
  }

  /// Places a value in the open container (or as the root); returns where it now lives.
  Value* place(Value value) {
    if (open_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Value& parent = *open_.back();
    if (parent.is_array()) {
      auto& array = parent.get_ref<Value::array_t&>();
      array.push_back(std::move(value));
      return &array.back();
    }
    auto& members = static_cast<Members&>(parent.get_ref<Value::object_t&>());
    members.emplace_back(std::move(key_), std::move(value));
    return &members.back().second;
  }

  bool scalar(Value value) {
    count();
    bool member = streaming_member();
    place(std::move(value));
    if (member) (*visit_)(std::move(member_), take_root());
    return true;
  }

  bool open(Value container) {
    count();
    if (++depth_ > max_depth) fail("json: nesting deeper than {}", max_depth);
    open_.push_back(place(std::move(container)));
    return true;
  }

  bool close() {
    open_.pop_back();
    --depth_;
    if (streaming_member()) (*visit_)(std::move(member_), take_root());
    return true;
  }

  static void check_unique_keys(const Members& object) {
    std::vector<size_t> order(object.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return object[a].first < object[b].first; });
    for (size_t i = 1; i < order.size(); ++i)
      if (object[order[i]].first == object[order[i - 1]].first)
        fail("json: duplicate key \"{}\"", object[order[i]].first);
  }

  size_t max_values_;
  const MemberVisitor* visit_;
  Value root_;
  std::vector<Value*> open_;  // the containers being filled, innermost last
  std::string key_;           // the key of the member being read
  std::string member_;        // the top-level member being streamed
  int depth_ = 0;
  size_t values_ = 0;
};

void run(std::string_view text, StrictBuilder& builder) {
  // nlohmann's lexer takes a NUL byte for the end of the input, so whatever followed one would
  // be ignored. JSON holds no raw NUL, not even in strings.
  if (size_t nul = text.find('\0'); nul != std::string_view::npos)
    fail("json: a NUL byte at byte {}", nul);
  Value::sax_parse(text.data(), text.data() + text.size(), &builder);
}

}  // namespace

Value parse(std::string_view text, size_t max_values) {
  StrictBuilder builder(max_values, nullptr);
  run(text, builder);
  return builder.take_root();
}

void parse_members(std::string_view text, size_t max_values, const MemberVisitor& visit) {
  StrictBuilder builder(max_values, &visit);
  run(text, builder);
}

std::string dump(const Value& value) {
  try {
    return value.dump();
  } catch (const nlohmann::json::exception& e) {
    fail("json: cannot dump: {}", message_of(e));
  }
}

void append(Value& object, std::string key, Value value) {
  if (object.is_null()) object = Value::object();
  static_cast<Members&>(object.get_ref<Value::object_t&>())
      .emplace_back(std::move(key), std::move(value));
}

int64_t as_int(const Value& value) {
  if (value.is_number_integer() &&
      (!value.is_number_unsigned() ||
       value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())))
    return value.get<int64_t>();
  fail("json: expected an integer, got {}", value.is_number() ? value.dump() : value.type_name());
}

const Value* find(const Value& object, std::string_view key) {
  if (!object.is_object()) return nullptr;
  auto found = object.find(key);
  return found == object.end() ? nullptr : &*found;
}

}  // namespace mixtape::json
