// mixtape/dsl/json.cpp -- JSON value accessors, the strict parser and the serializer.
#include "mixtape/dsl/json.h"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace mixtape::json {

std::string_view kind_name(Kind kind) {
  switch (kind) {
    case Kind::null:
      return "null";
    case Kind::boolean:
      return "bool";
    case Kind::number:
      return "number";
    case Kind::string:
      return "string";
    case Kind::array:
      return "array";
    case Kind::object:
      return "object";
  }
  return "?";
}

Kind Value::kind() const {
  switch (data_.index()) {
    case 0:
      return Kind::null;
    case 1:
      return Kind::boolean;
    case 2:
    case 3:
      return Kind::number;
    case 4:
      return Kind::string;
    case 5:
      return Kind::array;
    default:
      return Kind::object;
  }
}

namespace {

[[noreturn]] void wrong_kind(Kind expected, Kind actual) {
  fail("json: expected {}, got {}", kind_name(expected), kind_name(actual));
}

template <typename T, typename Variant>
auto& get_or_fail(Variant& data, Kind expected, Kind actual) {
  if (auto* held = std::get_if<T>(&data)) return *held;
  wrong_kind(expected, actual);
}

}  // namespace

bool Value::as_bool() const { return get_or_fail<bool>(data_, Kind::boolean, kind()); }

double Value::as_double() const {
  if (auto* i = std::get_if<int64_t>(&data_)) return static_cast<double>(*i);
  return get_or_fail<double>(data_, Kind::number, kind());
}

int64_t Value::as_int() const {
  if (std::holds_alternative<double>(data_))
    fail("json: expected an integer, got a fractional number");
  return get_or_fail<int64_t>(data_, Kind::number, kind());
}

const std::string& Value::as_string() const {
  return get_or_fail<std::string>(data_, Kind::string, kind());
}
const Array& Value::as_array() const { return get_or_fail<Array>(data_, Kind::array, kind()); }
Array& Value::as_array() { return get_or_fail<Array>(data_, Kind::array, kind()); }
const Object& Value::as_object() const { return get_or_fail<Object>(data_, Kind::object, kind()); }
Object& Value::as_object() { return get_or_fail<Object>(data_, Kind::object, kind()); }

const Value* Value::find(std::string_view key) const {
  for (const auto& [k, v] : as_object())
    if (k == key) return &v;
  return nullptr;
}

const Value& Value::at(std::string_view key) const {
  if (const Value* v = find(key)) return *v;
  fail("json: missing key \"{}\"", key);
}

const Value& Value::at(size_t index) const {
  const Array& array = as_array();
  if (index >= array.size())
    fail("json: index {} out of range for array of {}", index, array.size());
  return array[index];
}

Value& Value::set(std::string key, Value value) {
  Object& object = as_object();
  for (auto& [k, v] : object)
    if (k == key) return v = std::move(value);
  return object.emplace_back(std::move(key), std::move(value)).second;
}

void Value::push_back(Value value) { as_array().push_back(std::move(value)); }

size_t Value::size() const {
  if (is_array()) return as_array().size();
  if (is_object()) return as_object().size();
  fail("json: size() needs an array or object, got {}", kind_name(kind()));
}

namespace {

/// Length of the well-formed UTF-8 sequence starting at pos, or 0. Rejects overlong forms,
/// encoded surrogates and code points above U+10FFFF, as RFC 3629 requires.
size_t utf8_sequence_length(std::string_view s, size_t pos) {
  auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  unsigned char lead = byte(pos);
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char second_lo = 0x80, second_hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF)
    length = 2;
  else if (lead >= 0xE0 && lead <= 0xEF)
    length = 3;
  else if (lead >= 0xF0 && lead <= 0xF4)
    length = 4;
  else
    return 0;
  if (lead == 0xE0) second_lo = 0xA0;
  if (lead == 0xED) second_hi = 0x9F;
  if (lead == 0xF0) second_lo = 0x90;
  if (lead == 0xF4) second_hi = 0x8F;
  if (pos + length > s.size()) return 0;
  if (byte(pos + 1) < second_lo || byte(pos + 1) > second_hi) return 0;
  for (size_t i = 2; i < length; ++i)
    if ((byte(pos + i) & 0xC0) != 0x80) return 0;
  return length;
}

void append_utf8(std::string& out, uint32_t code_point) {
  auto put = [&](uint32_t bits) { out.push_back(static_cast<char>(bits)); };
  if (code_point < 0x80) {
    put(code_point);
  } else if (code_point < 0x800) {
    put(0xC0 | (code_point >> 6));
    put(0x80 | (code_point & 0x3F));
  } else if (code_point < 0x10000) {
    put(0xE0 | (code_point >> 12));
    put(0x80 | ((code_point >> 6) & 0x3F));
    put(0x80 | (code_point & 0x3F));
  } else {
    put(0xF0 | (code_point >> 18));
    put(0x80 | ((code_point >> 12) & 0x3F));
    put(0x80 | ((code_point >> 6) & 0x3F));
    put(0x80 | (code_point & 0x3F));
  }
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

/// from_chars reports underflow and overflow alike, but only overflow is an error: tiny numbers
/// read as zero, as every mainstream JSON reader does. Tell them apart by the decimal exponent of
/// the first significant digit, which is positive for anything that can overflow a double.
bool overflows_double(std::string_view number) {
  size_t i = number[0] == '-' ? 1 : 0;
  int64_t magnitude = 0;
  if (number[i] != '0') {
    while (i < number.size() && is_digit(number[i])) ++magnitude, ++i;
    magnitude -= 1;
  } else {
    ++i;
    if (i < number.size() && number[i] == '.') {
      ++i;
      while (i < number.size() && number[i] == '0') --magnitude, ++i;
      magnitude -= 1;
    }
  }
  size_t e = number.find_first_of("eE");
  if (e == std::string_view::npos) return magnitude > 0;
  bool negative = number[e + 1] == '-';
  int64_t exponent = 0;
  for (size_t j = e + 1; j < number.size(); ++j)
    if (is_digit(number[j]) && exponent < 1'000'000'000)
      exponent = exponent * 10 + (number[j] - '0');
  return magnitude + (negative ? -exponent : exponent) > 0;
}

class Parser {
 public:
  explicit Parser(std::string_view text, size_t max_values = SIZE_MAX)
      : text_(text), max_values_(max_values) {}

  Value parse_document() {
    skip_whitespace();
    Value value = parse_value(0);
    skip_whitespace();
    if (pos_ != text_.size()) error("unexpected trailing characters");
    return value;
  }

  // Each member's count of values starts afresh; only one member is alive at a time.
  void parse_members(const MemberVisitor& visit) {
    skip_whitespace();
    if (peek() != '{') error("expected an object");
    ++pos_;
    skip_whitespace();
    if (peek() != '}') {
      while (true) {
        skip_whitespace();
        if (peek() != '"') error("expected a string key");
        size_t key_offset = pos_;
        std::string key = parse_string();
        skip_whitespace();
        expect(':', "expected ':' after object key");
        skip_whitespace();
        values_ = 0;
        member_ = &key;
        Value value = parse_value(1);
        member_ = nullptr;
        visit(std::move(key), std::move(value), key_offset);
        skip_whitespace();
        if (peek() == '}') break;
        expect(',', "expected ',' or '}' in object");
      }
    }
    ++pos_;
    skip_whitespace();
    if (pos_ != text_.size()) error("unexpected trailing characters");
  }

 private:
  [[noreturn]] void error(std::string_view what) const { error_at(pos_, what); }
  [[noreturn]] void error_at(size_t pos, std::string_view what) const {
    if (pos >= text_.size()) fail("json: {} at byte {} (end of input)", what, pos);
    auto c = static_cast<unsigned char>(text_[pos]);
    if (c >= 0x20 && c < 0x7F) fail("json: {} at byte {} ('{}')", what, pos, static_cast<char>(c));
    fail("json: {} at byte {} (0x{:02x})", what, pos, c);
  }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }

  void skip_whitespace() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r'))
      ++pos_;
  }

  void expect(char c, std::string_view what) {
    if (at_end() || peek() != c) error(what);
    ++pos_;
  }

  Value parse_value(int depth) {
    if (++values_ > max_values_) {
      if (member_)
        error(fmt::format("member \"{}\" holds more than {} values, the limit", *member_,
                          max_values_));
      error(fmt::format("more than {} values, the limit", max_values_));
    }
    switch (peek()) {
      case '{':
        return parse_object(depth + 1);
      case '[':
        return parse_array(depth + 1);
      case '"':
        return parse_string();
      case 't':
        return parse_literal("true", true);
      case 'f':
        return parse_literal("false", false);
      case 'n':
        return parse_literal("null", nullptr);
      default:
        if (peek() == '-' || is_digit(peek())) return parse_number();
        error(at_end() ? "unexpected end of input" : "expected a value");
    }
  }

  Value parse_literal(std::string_view word, Value value) {
    if (text_.substr(pos_, word.size()) != word) error("invalid literal");
    pos_ += word.size();
    return value;
  }

  void check_depth(int depth) const {
    if (depth > max_depth) error(fmt::format("nesting deeper than {}", max_depth));
  }

  Value parse_array(int depth) {
    check_depth(depth);
    ++pos_;
    Array array;
    skip_whitespace();
    if (peek() != ']') {
      while (true) {
        skip_whitespace();
        array.push_back(parse_value(depth));
        skip_whitespace();
        if (peek() == ']') break;
        expect(',', "expected ',' or ']' in array");
      }
    }
    ++pos_;
    return array;
  }

  Value parse_object(int depth) {
    check_depth(depth);
    ++pos_;
    Object object;
    std::vector<size_t> key_offsets;
    skip_whitespace();
    if (peek() != '}') {
      while (true) {
        skip_whitespace();
        if (peek() != '"') error("expected a string key");
        key_offsets.push_back(pos_);
        std::string key = parse_string();
        skip_whitespace();
        expect(':', "expected ':' after object key");
        skip_whitespace();
        object.emplace_back(std::move(key), parse_value(depth));
        skip_whitespace();
        if (peek() == '}') break;
        expect(',', "expected ',' or '}' in object");
      }
    }
    ++pos_;
    check_duplicate_keys(object, key_offsets);
    return object;
  }

  // Sorting indices keeps this O(n log n): a hostile header may hold millions of keys.
  void check_duplicate_keys(const Object& object, const std::vector<size_t>& key_offsets) const {
    std::vector<size_t> order(object.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return object[a].first != object[b].first ? object[a].first < object[b].first : a < b;
    });
    for (size_t i = 1; i < order.size(); ++i) {
      if (object[order[i]].first == object[order[i - 1]].first)
        error_at(key_offsets[order[i]],
                 fmt::format("duplicate key \"{}\"", object[order[i]].first));
    }
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      if (at_end()) error("unterminated string");
      auto c = static_cast<unsigned char>(peek());
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c == '\\') {
        parse_escape(out);
      } else if (c < 0x20) {
        error("unescaped control character in string");
      } else {
        size_t length = utf8_sequence_length(text_, pos_);
        if (length == 0) error("invalid UTF-8 in string");
        out.append(text_.substr(pos_, length));
        pos_ += length;
      }
    }
  }

  void parse_escape(std::string& out) {
    size_t start = pos_;
    ++pos_;
    char c = peek();
    ++pos_;
    switch (c) {
      case '"':
        out += '"';
        return;
      case '\\':
        out += '\\';
        return;
      case '/':
        out += '/';
        return;
      case 'b':
        out += '\b';
        return;
      case 'f':
        out += '\f';
        return;
      case 'n':
        out += '\n';
        return;
      case 'r':
        out += '\r';
        return;
      case 't':
        out += '\t';
        return;
      case 'u':
        break;
      default:
        error_at(start, "invalid escape sequence");
    }
    uint32_t code_point = parse_hex4(start);
    if (code_point >= 0xDC00 && code_point <= 0xDFFF) error_at(start, "unpaired low surrogate");
    if (code_point >= 0xD800 && code_point <= 0xDBFF) {
      size_t low_start = pos_;
      if (text_.substr(pos_, 2) != "\\u") error_at(start, "high surrogate without a low surrogate");
      pos_ += 2;
      uint32_t low = parse_hex4(low_start);
      if (low < 0xDC00 || low > 0xDFFF) error_at(start, "high surrogate without a low surrogate");
      code_point = 0x10000 + ((code_point - 0xD800) << 10) + (low - 0xDC00);
    }
    append_utf8(out, code_point);
  }

  uint32_t parse_hex4(size_t escape_start) {
    std::string_view digits = text_.substr(pos_, 4);
    const char* last = digits.data() + digits.size();
    uint32_t value = 0;
    auto [end, ec] = std::from_chars(digits.data(), last, value, 16);
    if (digits.size() != 4 || ec != std::errc() || end != last)
      error_at(escape_start, "\\u escape needs four hex digits");
    pos_ += 4;
    return value;
  }

  Value parse_number() {
    size_t start = pos_;
    bool integral = true;
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
      if (is_digit(peek())) error("leading zeros are not allowed");
    } else if (is_digit(peek())) {
      while (is_digit(peek())) ++pos_;
    } else {
      error("expected a digit");
    }
    if (peek() == '.') {
      integral = false;
      ++pos_;
      if (!is_digit(peek())) error("expected a digit after '.'");
      while (is_digit(peek())) ++pos_;
    }
    if (peek() == 'e' || peek() == 'E') {
      integral = false;
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (!is_digit(peek())) error("expected a digit in exponent");
      while (is_digit(peek())) ++pos_;
    }
    std::string_view number = text_.substr(start, pos_ - start);
    const char* first = number.data();
    const char* last = first + number.size();
    if (integral) {
      int64_t n = 0;
      if (std::from_chars(first, last, n).ec == std::errc()) return n;
    }
    double d = 0;
    auto [end, ec] = std::from_chars(first, last, d);
    if (ec == std::errc::result_out_of_range) {
      if (overflows_double(number)) error_at(start, "number out of range");
      d = number[0] == '-' ? -0.0 : 0.0;
    } else if (ec != std::errc() || end != last) {
      error_at(start, "malformed number");
    }
    return d;
  }

  std::string_view text_;
  size_t pos_ = 0;
  size_t max_values_;
  size_t values_ = 0;
  const std::string* member_ = nullptr;  // the top-level member parse_members is reading
};

void dump_string(std::string& out, std::string_view s) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          size_t length = utf8_sequence_length(s, i);
          if (length == 0) fail("json: cannot dump string with invalid UTF-8 at byte {}", i);
          out.append(s.substr(i, length));
          i += length;
          continue;
        }
    }
    ++i;
  }
  out += '"';
}

void dump_double(std::string& out, double d) {
  if (!std::isfinite(d)) fail("json: cannot represent {} in JSON", d);
  char buffer[32];
  auto [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, d);
  std::string_view text(buffer, end - buffer);
  out += text;
  if (text.find_first_of(".e") == std::string_view::npos) out += ".0";
}

void dump_value(std::string& out, const Value& value) {
  switch (value.kind()) {
    case Kind::null:
      out += "null";
      return;
    case Kind::boolean:
      out += value.as_bool() ? "true" : "false";
      return;
    case Kind::number:
      if (value.is_integer())
        out += std::to_string(value.as_int());
      else
        dump_double(out, value.as_double());
      return;
    case Kind::string:
      dump_string(out, value.as_string());
      return;
    case Kind::array: {
      out += '[';
      bool first = true;
      for (const Value& element : value.as_array()) {
        if (!first) out += ',';
        first = false;
        dump_value(out, element);
      }
      out += ']';
      return;
    }
    case Kind::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, element] : value.as_object()) {
        if (!first) out += ',';
        first = false;
        dump_string(out, key);
        out += ':';
        dump_value(out, element);
      }
      out += '}';
      return;
    }
  }
}

}  // namespace

Value parse(std::string_view text) { return Parser(text).parse_document(); }

Value parse(std::string_view text, size_t max_values) {
  return Parser(text, max_values).parse_document();
}

void parse_members(std::string_view text, size_t max_values, const MemberVisitor& visit) {
  Parser(text, max_values).parse_members(visit);
}

std::string dump(const Value& value) {
  std::string out;
  dump_value(out, value);
  return out;
}

}  // namespace mixtape::json
