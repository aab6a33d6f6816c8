// tests/test_safetensors.cpp -- JSON parsing and dumping, safetensors round trips, corruption
// handling, atomic writes and interop with an independent Python reader and writer.
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/half.h"
#include "mixtape/dsl/json.h"
#include "mixtape/runtime/safetensors.h"

#include "tests/test_util.h"

namespace mt = mixtape;

namespace {

namespace fs = std::filesystem;
namespace st = mt::safetensors;
using mt::DType;
using mt::json::Value;

static_assert(std::endian::native == std::endian::little, "tests build tensor bytes natively");

// Runs the statement and expects an mt::Error whose message contains the fragment. Any other
// exception escapes and fails the test, which is the point: readers may only throw mt::Error.

template <typename T>
std::vector<std::byte> to_bytes(const std::vector<T>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

template <typename T>
std::vector<T> from_bytes(const std::vector<std::byte>& bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

uint16_t bf16_bits(float value) {
  return static_cast<uint16_t>(std::bit_cast<uint32_t>(value) >> 16);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

void write_bytes(const fs::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir))
    names.insert(entry.path().filename().string());
  return names;
}

// ---- JSON: what dsl/json.h adds to nlohmann's parser ----

TEST(Json, KeepsIntegersExactAndOrderAndReadsWideOnesAsDoubles) {
  EXPECT_EQ(mt::json::parse("9007199254740993").get<int64_t>(), 9007199254740993);  // no double
  EXPECT_EQ(mt::json::parse("-9223372036854775808").get<int64_t>(),
            std::numeric_limits<int64_t>::min());
  EXPECT_EQ(mt::json::as_int(mt::json::parse("9223372036854775807")),
            std::numeric_limits<int64_t>::max());
  // Beyond int64 a number is a double, so get<int64_t>() can never wrap an unsigned.
  Value beyond_int64 = mt::json::parse("9223372036854775808");
  EXPECT_TRUE(beyond_int64.is_number_float());
  EXPECT_MT_ERROR(mt::json::as_int(beyond_int64), "expected an integer");
  EXPECT_MT_ERROR(mt::json::as_int(mt::json::parse("1.0")), "expected an integer, got 1.0");
  EXPECT_MT_ERROR(mt::json::as_int(mt::json::parse("\"1\"")), "got string");
  EXPECT_EQ(mt::json::parse("1e-400").get<double>(), 0.0);  // underflow is not an error

  Value v = mt::json::parse(R"( {"z": [1, 2.5, "x", {}], "a": {"n": null}, "m": []} )");
  EXPECT_EQ(v.begin().key(), "z");
  EXPECT_EQ(mt::json::find(v, "missing"), nullptr);
  EXPECT_EQ(mt::json::find(v.at("z"), "z"), nullptr);  // not an object
  EXPECT_TRUE(mt::json::find(v, "a")->at("n").is_null());
  EXPECT_EQ(mt::json::dump(v), R"({"z":[1,2.5,"x",{}],"a":{"n":null},"m":[]})");
}

TEST(Json, DumpsCompactlyAndRoundTripsDoublesBitExactly) {
  Value report = Value::object();
  mt::json::append(report, "name", "quote\" back\\ nl\n ctl\x01 \u00e9");
  mt::json::append(report, "whole", 2.0);
  mt::json::append(report, "flags", {true, false, nullptr});
  EXPECT_EQ(mt::json::dump(report),
            "{\"name\":\"quote\\\" back\\\\ nl\\n ctl\\u0001 \u00e9\","
            "\"whole\":2.0,\"flags\":[true,false,null]}");
  EXPECT_EQ(mt::json::parse(mt::json::dump(report)), report);
  for (double d : {0.1, 1.0 / 3.0, -1e300, 5e-324, 2.2250738585072014e-308, 1e21, -0.0,
                   std::numeric_limits<double>::max()}) {
    std::string text = mt::json::dump(d);
    Value back = mt::json::parse(text);
    EXPECT_TRUE(back.is_number_float()) << text;
    EXPECT_EQ(std::bit_cast<uint64_t>(back.get<double>()), std::bit_cast<uint64_t>(d)) << text;
  }
  EXPECT_EQ(mt::json::dump(std::nan("")), "null");  // JSON has no NaN
  EXPECT_MT_ERROR(mt::json::dump("bad \xFF utf8"), "invalid UTF-8");
}

// Malformed text is an mt::Error with a byte offset, never nlohmann's own exception.
TEST(Json, RejectsMalformedInputWithOffset) {
  for (const std::string& text : std::vector<std::string>{
           "", "   ", "tru", "[1,]", "[1 2]", "{\"a\":1,}", "{\"a\" 1}", "{1:2}", "01", "1.", ".5",
           "+1", "-", "1e", "NaN", "-Infinity", "1e400", "-1e400", "1" + std::string(400, '0'),
           "\"abc", "\"\\x\"", "\"\\u12G4\"", "\"\\ud800\"", "\"\\ud800\\u0041\"", "\"\\udc00\"",
           "\"a\tb\"", std::string("\"a\0b\"", 5), "\"\xFF\"", "\"\xC0\xAF\"" /* overlong '/' */,
           "\"\xED\xA0\x80\"" /* encoded surrogate */, "\"\xF4\x90\x80\x80\"" /* > U+10FFFF */,
           "\"\xE2\x82\"" /* truncated */, "[1] x", "{} {}", "[true false]",
           // what follows a NUL must not be ignored
           std::string("{\"a\":1}\0garbage{{{", 18), std::string("{}\0", 3)}) {
    SCOPED_TRACE(text);
    EXPECT_MT_ERROR(mt::json::parse(text), "json: ");
    EXPECT_MT_ERROR(mt::json::parse(text), " at byte ");
  }
}

TEST(Json, RejectsDuplicateKeysAtAnyDepth) {
  EXPECT_MT_ERROR(mt::json::parse(R"({"a":1,"b":2,"a":3})"), "duplicate key \"a\"");
  EXPECT_MT_ERROR(mt::json::parse(R"([{"x":{"k":1,"k":1}}])"), "duplicate key \"k\"");
  EXPECT_NO_THROW(mt::json::parse(R"({"a":{"a":1},"b":{"a":2}})"));
  // Sorted, not searched: many keys stay fast.
  std::string many = "{";
  for (int i = 0; i < 100000; ++i) many += fmt::format("\"k{}\":{},", i, i);
  EXPECT_EQ(mt::json::parse(many + "\"end\":0}").size(), 100001u);
  EXPECT_MT_ERROR(mt::json::parse(many + "\"k7\":0}"), "duplicate key \"k7\"");
}

TEST(Json, LimitsNestingDepth) {
  auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  EXPECT_NO_THROW(mt::json::parse(nested(mt::json::max_depth)));
  EXPECT_MT_ERROR(mt::json::parse(nested(mt::json::max_depth + 1)), "nesting deeper than 64");
  std::string objects;
  for (int i = 0; i <= mt::json::max_depth; ++i) objects += "{\"k\":";
  EXPECT_MT_ERROR(mt::json::parse(objects + "1" + std::string(65, '}')), "nesting deeper");
  EXPECT_MT_ERROR(mt::json::parse(std::string(1'000'000, '[')), "nesting deeper");
}

TEST(Json, LimitsValuesAndParsesMemberByMember) {
  EXPECT_EQ(mt::json::parse("[1,[2,3]]", 5).size(), 2u);  // root, 1, [..], 2, 3
  EXPECT_MT_ERROR(mt::json::parse("[1,[2,3]]", 4), "more than 4 values");
  EXPECT_MT_ERROR(mt::json::parse(std::string(100, '[') + "]", 3), "more than 3 values");

  std::vector<std::pair<std::string, Value>> seen;
  auto visit = [&](std::string key, Value value) { seen.emplace_back(key, std::move(value)); };
  mt::json::parse_members(R"( {"a": [1, 2], "b": {"c": null}, "d": 3} )", 3, visit);
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].first, "a");
  EXPECT_EQ(mt::json::dump(seen[0].second), "[1,2]");
  EXPECT_EQ(seen[1].first, "b");
  EXPECT_EQ(mt::json::dump(seen[1].second), R"({"c":null})");
  EXPECT_EQ(seen[2].second, 3);
  // The limit is per member; the first members have been visited when a later one fails.
  seen.clear();
  EXPECT_MT_ERROR(mt::json::parse_members(R"({"a":[1],"b":[1,2,3]})", 3, visit),
                  "member \"b\" holds more than 3 values");
  EXPECT_EQ(seen.size(), 1u);
  EXPECT_MT_ERROR(mt::json::parse_members("[]", 3, visit), "expected an object");
  EXPECT_MT_ERROR(mt::json::parse_members("3", 3, visit), "expected an object");
  EXPECT_MT_ERROR(mt::json::parse_members("{} x", 3, visit), "byte");
  EXPECT_MT_ERROR(mt::json::parse_members(R"({"a":{"b":1,"b":2}})", 9, visit), "duplicate key");
}

// ---- safetensors ----

struct Expected {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  Value values;
};

st::TensorData tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                      std::vector<std::byte> bytes) {
  return {std::move(name), dtype, std::move(shape), std::move(bytes)};
}

// Every dtype, a 0-d tensor, empty tensors and metadata that needs escaping.
st::File sample_file() {
  st::File file;
  file.tensors.push_back(tensor("layer.0.weight", DType::f32, {2, 3},
                                to_bytes<float>({1.5f, -2.25f, 0.0f, 1024.0f, 0.125f, -7.0f})));
  file.tensors.push_back(tensor("stats", DType::f64, {3}, to_bytes<double>({0.1, -1e300, 5e-324})));
  file.tensors.push_back(tensor("scale", DType::f16, {}, to_bytes<uint16_t>({0x3E00})));  // 1.5
  file.tensors.push_back(tensor("bf", DType::bf16, {2, 2},
                                to_bytes<uint16_t>({bf16_bits(1.0f), bf16_bits(-0.5f),
                                                    bf16_bits(256.0f), bf16_bits(3.140625f)})));
  file.tensors.push_back(tensor("empty_i32", DType::i32, {0}, {}));
  file.tensors.push_back(
      tensor("steps", DType::i64, {3},
             to_bytes<int64_t>({9007199254740993, -5, std::numeric_limits<int64_t>::min()})));
  file.tensors.push_back(tensor("empty_f64", DType::f64, {0, 3}, {}));
  file.tensors.push_back(tensor("mask", DType::boolean, {2, 1}, to_bytes<uint8_t>({1, 0})));
  file.metadata = {{"format", "pt"}, {"note", "\u00fcn\u00efc\u00f6d\u00e9 \"quoted\"\n"}};
  return file;
}

// What an independent reader should find in sample_file(), values decoded to plain numbers.
std::vector<Expected> sample_expectations() {
  return {
      {"layer.0.weight", "F32", {2, 3}, Value::array({1.5, -2.25, 0.0, 1024.0, 0.125, -7.0})},
      {"stats", "F64", {3}, Value::array({0.1, -1e300, 5e-324})},
      {"scale", "F16", {}, Value::array({1.5})},
      {"bf", "BF16", {2, 2}, Value::array({1.0, -0.5, 256.0, 3.140625})},
      {"empty_i32", "I32", {0}, Value::array({})},
      {"steps",
       "I64",
       {3},
       Value::array({9007199254740993, -5, std::numeric_limits<int64_t>::min()})},
      {"empty_f64", "F64", {0, 3}, Value::array({})},
      {"mask", "BOOL", {2, 1}, Value::array({true, false})},
  };
}

void expect_same(const st::File& actual, const st::File& expected) {
  ASSERT_EQ(actual.tensors.size(), expected.tensors.size());
  for (size_t i = 0; i < expected.tensors.size(); ++i) {
    SCOPED_TRACE(expected.tensors[i].name);
    EXPECT_EQ(actual.tensors[i].name, expected.tensors[i].name);
    EXPECT_EQ(actual.tensors[i].dtype, expected.tensors[i].dtype);
    EXPECT_EQ(actual.tensors[i].shape, expected.tensors[i].shape);
    EXPECT_EQ(actual.tensors[i].bytes, expected.tensors[i].bytes);
  }
  EXPECT_EQ(actual.metadata, expected.metadata);
}

class SafetensorsFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("mixtape_st_{}_{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  fs::path dir_;
};

TEST(Safetensors, RoundTripsEveryDtypeInMemory) {
  st::File file = sample_file();
  std::vector<std::byte> bytes = st::serialize(file);
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  EXPECT_EQ(header_length % 8, 0u) << "header must be padded to 8 bytes";
  EXPECT_EQ(static_cast<char>(bytes[8]), '{');
  expect_same(st::parse(bytes, "memory"), file);

  const st::TensorData* scale = file.find("scale");
  ASSERT_NE(scale, nullptr);
  EXPECT_TRUE(scale->shape.empty());
  EXPECT_EQ(file.find("nope"), nullptr);
}

TEST(Safetensors, EmptyFileAndNoMetadata) {
  st::File empty;
  std::vector<std::byte> bytes = st::serialize(empty);
  EXPECT_EQ(bytes.size(), 16u);  // "{}" padded to 8
  st::File back = st::parse(bytes, "memory");
  EXPECT_TRUE(back.tensors.empty());
  EXPECT_TRUE(back.metadata.empty());
}

TEST_F(SafetensorsFiles, RoundTripsThroughDiskAndOverwrites) {
  std::string path = dir_ / "model.safetensors";
  st::File file = sample_file();
  st::write(path, file);
  expect_same(st::read(path), file);
  EXPECT_EQ(listing(dir_), std::set<std::string>{"model.safetensors"});

  file.tensors.resize(1);
  file.metadata.clear();
  st::write(path, file);
  expect_same(st::read(path), file);
  EXPECT_EQ(listing(dir_), std::set<std::string>{"model.safetensors"});
}

TEST_F(SafetensorsFiles, WriterRejectsInvalidFilesWithoutTouchingDisk) {
  std::string path = dir_ / "bad.safetensors";
  auto with = [](auto edit) {
    st::File file = sample_file();
    edit(file);
    return file;
  };
  EXPECT_MT_ERROR(st::write(path, with([](st::File& f) { f.tensors[0].bytes.pop_back(); })),
                  "needs 24");
  EXPECT_MT_ERROR(st::write(path, with([](st::File& f) { f.tensors[1].name = "scale"; })),
                  "duplicate tensor name 'scale'");
  EXPECT_MT_ERROR(st::write(path, with([](st::File& f) { f.tensors[1].name = ""; })), "empty");
  EXPECT_MT_ERROR(st::write(path, with([](st::File& f) { f.tensors[1].name = "__metadata__"; })),
                  "reserved");
  // The name, in the checksum entry first, is checked as the metadata are (the message once
  // lacked the path: "invalid UTF-8" from the JSON writer alone).
  EXPECT_MT_ERROR(st::write(path, with([](st::File& f) { f.tensors[1].name = "bad\xFF"; })), path,
                  "tensor names and metadata must be valid UTF-8");
  EXPECT_MT_ERROR(st::write(path, with([](st::File& f) { f.metadata[0].second = "\xC0\xAF"; })),
                  "valid UTF-8");
  EXPECT_MT_ERROR(st::write(path, with([](st::File& f) { f.tensors[4].shape = {-1}; })),
                  "negative");
  EXPECT_MT_ERROR(st::write(path, with([](st::File& f) {
                              f.metadata.push_back({"format", "x"});
                            })),
                  "duplicate metadata key");
  EXPECT_MT_ERROR(st::write(path, with([](st::File& f) {
                              f.tensors[0].shape = {int64_t{1} << 40, int64_t{1} << 40};
                            })),
                  "too large");
  EXPECT_MT_ERROR(st::serialize(with([](st::File& f) { f.tensors[2].shape = {2}; })), "needs 4");
  EXPECT_MT_ERROR(st::write(path, with([](st::File& f) { f.tensors[2].shape = {2}; })), path);
  EXPECT_TRUE(listing(dir_).empty());
}

// A header and data section assembled by hand, so each reader rule can be broken in isolation.
std::vector<std::byte> hand_made(std::string_view header, size_t data_bytes) {
  std::vector<std::byte> bytes(8 + header.size() + data_bytes, std::byte{0x11});
  uint64_t length = header.size();
  std::memcpy(bytes.data(), &length, 8);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}

TEST(Safetensors, ReaderValidatesEveryHeaderRule) {
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_EQ(st::parse(hand_made(good, 8), "hand").tensors.size(), 1u);
  ASSERT_EQ(st::parse(hand_made(good + "    ", 8), "hand").tensors.size(), 1u);

  struct Case {
    std::string header;
    size_t data_bytes;
    std::string fragment;
  };
  auto entry = [](std::string body) { return "{\"a\":{" + body + "}}"; };
  // Two entries, "a" and `second` (a duplicate key where it is "a"), and an F32 entry's body.
  auto two = [](std::string a, std::string second, std::string body) {
    return "{\"a\":{" + a + "},\"" + second + "\":{" + body + "}}";
  };
  auto f32 = [](int size, int begin, int end) {
    return fmt::format(R"("dtype":"F32","shape":[{}],"data_offsets":[{},{}])", size, begin, end);
  };
  const std::vector<Case> cases = {
      {"not json", 8, "not a safetensors file: hand-edited.st (its header is not a JSON object)"},
      {"{not json", 8, "hand-edited.st: header is not valid JSON"},
      {good + "x", 8, "expected end of input"},
      {"", 0, "not a safetensors file"},
      {" {}", 0, "not a safetensors file"},
      {"[]", 0, "not a safetensors file"},
      {"\"a\"", 0, "not a safetensors file"},
      {R"({"a":[1]})", 0, "tensor 'a': expected an object"},
      {entry(R"("shape":[2],"data_offsets":[0,8])"), 8, "missing field 'dtype'"},
      {entry(R"("dtype":"F32","data_offsets":[0,8])"), 8, "missing field 'shape'"},
      {entry(R"("dtype":"F32","shape":[2])"), 8, "missing field 'data_offsets'"},
      {entry(R"("dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1)"), 8,
       "unexpected field 'extra'"},
      {entry(R"("dtype":32,"shape":[2],"data_offsets":[0,8])"), 8, "'dtype' must be a string"},
      {entry(R"("dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2])"), 2,
       "dtype 'F8_E4M3' is not one mixtape reads (F32, F64, F16, BF16, I32, I64, BOOL)"},
      {entry(R"("dtype":"f32","shape":[2],"data_offsets":[0,8])"), 8,
       "dtype 'f32' is not one mixtape reads"},
      {entry(R"("dtype":"F32","shape":2,"data_offsets":[0,8])"), 8, "'shape' must be"},
      {entry(R"("dtype":"F32","shape":[-2],"data_offsets":[0,8])"), 8, "'shape' must be"},
      {entry(R"("dtype":"F32","shape":[2.5],"data_offsets":[0,8])"), 8, "'shape' must be"},
      {entry(R"("dtype":"F32","shape":[2.0],"data_offsets":[0,8])"), 8, "'shape' must be"},
      {entry(R"("dtype":"F32","shape":["2"],"data_offsets":[0,8])"), 8, "'shape' must be"},
      {entry(R"("dtype":"F32","shape":[1e30],"data_offsets":[0,8])"), 8, "'shape' must be"},
      {entry(R"("dtype":"F32","shape":[2],"data_offsets":[8])"), 8, "'data_offsets' must be"},
      {entry(R"("dtype":"F32","shape":[2],"data_offsets":[0,8,8])"), 8, "'data_offsets' must be"},
      {entry(R"("dtype":"F32","shape":[2],"data_offsets":[-1,7])"), 8, "'data_offsets' must be"},
      {entry(R"("dtype":"F32","shape":[2],"data_offsets":[0,8.0])"), 8, "'data_offsets' must be"},
      {entry(R"("dtype":"F32","shape":[2],"data_offsets":{"0":8})"), 8, "'data_offsets' must be"},
      {entry(R"("dtype":"F32","shape":[0],"data_offsets":[8,0])"), 8, "begin 8 is after end 0"},
      {entry(R"("dtype":"F32","shape":[2],"data_offsets":[0,8])"), 4, "beyond the 4-byte data"},
      {entry(R"("dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615])"), 8,
       "'data_offsets' must be"},
      {entry(R"("dtype":"F32","shape":[3],"data_offsets":[0,8])"), 8,
       "span 8 bytes but F32 with shape [3] needs 12"},
      {entry(R"("dtype":"F64","shape":[2],"data_offsets":[0,8])"), 8, "needs 16"},
      {entry(R"("dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8])"), 8,
       "too large"},
      {entry(R"("dtype":"I64","shape":[9223372036854775807,3],"data_offsets":[0,8])"), 8,
       "too large"},
      // No elements, but a count no tensor can hold before the zero (the reference refuses it).
      {entry(
           R"("dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0])"),
       0, "too large"},
      {two(f32(2, 0, 8), "b", f32(2, 4, 12)), 12, "tensors 'a' [0, 8) and 'b' [4, 12) overlap"},
      {two(f32(2, 0, 8), "b", f32(2, 0, 8)), 8, "overlap"},
      {two(f32(2, 0, 8), "b", f32(0, 4, 4)), 8, "overlap"},
      {two(f32(1, 0, 4), "b", f32(1, 8, 12)), 12, "bytes [4, 8) belong to no tensor"},
      {entry(f32(1, 4, 8)), 8, "bytes [0, 4) belong to no tensor"},
      {good, 12, "bytes [8, 12) belong to no tensor"},
      {"{}", 4, "bytes [0, 4) belong to no tensor"},
      {two(f32(1, 0, 4), "a", f32(1, 4, 8)), 8, "duplicate key \"a\" in the header"},
      {R"({"__metadata__":{},"__metadata__":{}})", 0, "duplicate key \"__metadata__\""},
      {R"({"":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "empty tensor name"},
      {R"({"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8,
       "metadata 'k' must be a string, got number"},
      {R"({"__metadata__":{"k":null},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8,
       "metadata 'k' must be a string"},
      {R"({"__metadata__":["k"],"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8,
       "'__metadata__' must be an object"},
      {R"({"__metadata__":{"k":"v","k":"w"}})", 0, "duplicate key"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.header);
    EXPECT_MT_ERROR(st::parse(hand_made(c.header, c.data_bytes), "hand-edited.st"), c.fragment);
    EXPECT_MT_ERROR(st::parse(hand_made(c.header, c.data_bytes), "hand-edited.st"),
                    "hand-edited.st");
  }

  // A zero dim makes a tensor empty however large the other dims are.
  std::string huge_but_empty =
      entry(R"("dtype":"F64","shape":[9223372036854775807,0,9223372036854775807],)"
            R"("data_offsets":[0,0])");
  EXPECT_EQ(st::parse(hand_made(huge_but_empty, 0), "hand").tensors.at(0).bytes.size(), 0u);
  // A null metadata entry is no metadata, as for the reference reader (an Option in Rust).
  std::string null_metadata =
      R"({"__metadata__":null,"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  st::File read_back = st::parse(hand_made(null_metadata, 8), "hand");
  EXPECT_TRUE(read_back.metadata.empty());
  EXPECT_EQ(read_back.tensors.at(0).name, "a");
}

TEST(Safetensors, ReaderRejectsBadHeaderLengths) {
  std::vector<std::byte> bytes = st::serialize(sample_file());
  auto with_length = [&](uint64_t length) {
    std::vector<std::byte> edited = bytes;
    std::memcpy(edited.data(), &length, 8);
    return edited;
  };
  // What a file of some other kind gives (here the text "PK\x03\x04" of a zip, read as a
  // length) says so, rather than quoting an absurd header length.
  EXPECT_MT_ERROR(st::parse(with_length(~uint64_t{0}), "huge.st"),
                  "not a safetensors file: huge.st (its header length field says "
                  "18446744073709551615 bytes, but the file has");
  EXPECT_MT_ERROR(st::parse(with_length(0x0000000004034b50), "zip.st"),
                  "not a safetensors file: zip.st");
  EXPECT_MT_ERROR(st::parse(with_length(uint64_t{1} << 63), "huge.st"), "not a safetensors file");
  EXPECT_MT_ERROR(st::parse(with_length(bytes.size() - 7), "long.st"), "not a safetensors file");
  EXPECT_MT_ERROR(st::parse(with_length(0), "zero.st"), "not a safetensors file");
  EXPECT_MT_ERROR(st::parse(with_length(16), "short.st"), "not valid JSON");
  EXPECT_MT_ERROR(st::parse(std::vector<std::byte>(7), "tiny.st"),
                  "not a safetensors file: tiny.st (7 bytes, too short");
  std::vector<std::byte> big(st::max_header_bytes + 16);
  uint64_t too_long = st::max_header_bytes + 1;
  std::memcpy(big.data(), &too_long, 8);
  EXPECT_MT_ERROR(st::parse(big, "big.st"), "header length 100000001 exceeds the limit");
}

TEST_F(SafetensorsFiles, EveryTruncationIsAnError) {
  st::File file;
  file.tensors.push_back(tensor("w", DType::f32, {3}, to_bytes<float>({1, 2, 3})));
  file.tensors.push_back(tensor("b", DType::i64, {}, to_bytes<int64_t>({7})));
  file.metadata = {{"k", "v"}};
  std::vector<std::byte> bytes = st::serialize(file);
  std::string path = dir_ / "cut.safetensors";
  for (size_t length = 0; length < bytes.size(); ++length) {
    SCOPED_TRACE(length);
    std::span<const std::byte> prefix(bytes.data(), length);
    EXPECT_MT_ERROR(st::parse(prefix, "cut.st"), "cut.st");
    write_bytes(path, prefix);
    EXPECT_MT_ERROR(st::read(path), path);
  }
  write_bytes(path, bytes);
  expect_same(st::read(path), file);
}

// Random byte corruption anywhere in the file must end in a clean mt::Error or a valid File.
TEST(Safetensors, RandomCorruptionNeverCrashes) {
  std::vector<std::byte> bytes = st::serialize(sample_file());
  std::mt19937 rng(1234);
  std::uniform_int_distribution<size_t> position(0, bytes.size() - 1);
  std::uniform_int_distribution<int> value(0, 255);
  int rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<std::byte> corrupt = bytes;
    for (int flips = 1 + trial % 3; flips > 0; --flips)
      corrupt[position(rng)] = static_cast<std::byte>(value(rng));
    try {
      st::parse(corrupt, "fuzz");
    } catch (const mt::Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 1000);
}

TEST_F(SafetensorsFiles, ReadReportsMissingAndNonRegularFiles) {
  std::string missing = dir_ / "missing.safetensors";
  EXPECT_MT_ERROR(st::read(missing), missing);
  EXPECT_MT_ERROR(st::read(dir_.string()), "not a regular file");
  std::string fifo = dir_ / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_MT_ERROR(st::read(fifo), "not a regular file");  // and must not block
}

TEST_F(SafetensorsFiles, WriteFailuresLeaveNothingBehind) {
  st::File file = sample_file();

  // A regular file where a directory should be: creating the temporary fails.
  write_bytes(dir_ / "blocker", std::vector<std::byte>(3));
  std::string under_file = dir_ / "blocker" / "model.safetensors";
  EXPECT_MT_ERROR(st::write(under_file, file), under_file);
  EXPECT_EQ(listing(dir_), std::set<std::string>{"blocker"});

  // /proc refuses new files even for root.
  std::string in_proc = "/proc/mixtape_cannot_write.safetensors";
  EXPECT_MT_ERROR(st::write(in_proc, file), in_proc);
  EXPECT_FALSE(fs::exists(in_proc));
  EXPECT_FALSE(fs::exists(in_proc + ".tmp." + std::to_string(::getpid())));

  // A directory at the path is refused before a temporary is made (the rename over it failed).
  fs::create_directories(dir_ / "occupied" / "inside");
  std::string onto_dir = dir_ / "occupied";
  EXPECT_MT_ERROR(st::write(onto_dir, file), "not a regular file");
  EXPECT_EQ(listing(dir_), (std::set<std::string>{"blocker", "occupied"}));
  EXPECT_TRUE(fs::is_directory(onto_dir));
}

// ---- atomic saves: concurrency, leftovers, modes, symbolic links ----

// A file whose every part says which generation wrote it: a metadata entry and two tensors
// filled with that number, big enough that two writers' writes interleave.
st::File generation_file(int generation) {
  st::File file;
  file.tensors.push_back(
      tensor("w", DType::i32, {16384}, to_bytes(std::vector<int32_t>(16384, generation))));
  file.tensors.push_back(tensor("b", DType::i64, {1}, to_bytes<int64_t>({generation})));
  file.metadata = {{"generation", std::to_string(generation)}};
  return file;
}

// The generation a loaded file is, checking that all its parts agree.
int generation_of(const st::File& file) {
  int generation = std::stoi(file.metadata.at(0).second);
  for (int32_t v : from_bytes<int32_t>(file.tensors.at(0).bytes)) EXPECT_EQ(v, generation);
  EXPECT_EQ(from_bytes<int64_t>(file.tensors.at(1).bytes).at(0), generation);
  return generation;
}

// Two threads saving to one path at once: none may fail, and what is on disk after each round
// (and whatever a reader sees meanwhile) is one generation whole.
TEST_F(SafetensorsFiles, ConcurrentSavesNeverFailNorTear) {
  std::string path = dir_ / "shared.safetensors";
  st::write(path, generation_file(0));
  std::atomic<int> failures{0};
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done) {
      try {
        generation_of(st::read(path));
      } catch (const mt::Error& e) {
        ADD_FAILURE() << "reader: " << e.what();
        ++failures;
      }
    }
  });
  for (int round = 1; round <= 60; ++round) {
    std::vector<std::thread> writers;
    for (int w = 0; w < 2; ++w)
      writers.emplace_back([&, w] {
        try {
          st::write(path, generation_file(2 * round + w));
        } catch (const mt::Error& e) {
          ADD_FAILURE() << "writer: " << e.what();
          ++failures;
        }
      });
    for (std::thread& t : writers) t.join();
    int generation = generation_of(st::read(path));
    EXPECT_TRUE(generation == 2 * round || generation == 2 * round + 1) << generation;
  }
  done = true;
  reader.join();
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(listing(dir_), std::set<std::string>{"shared.safetensors"});
}

// The pid of a process that has exited and been reaped: certainly not a live writer.
pid_t dead_pid() {
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

TEST_F(SafetensorsFiles, SaveRemovesDeadWritersTemporariesOnly) {
  std::string name = "model.safetensors";
  std::string dead = std::to_string(dead_pid());
  std::vector<std::string> stale = {
      name + ".tmp." + dead,                          // as earlier versions named them
      name + ".tmp." + dead + ".7.0123456789abcdef",  // as this one does
  };
  std::vector<std::string> kept = {
      name + ".tmp.1.0.0123456789abcdef",                                    // pid 1 is alive
      name + ".tmp." + std::to_string(::getpid()) + ".99.fedcba9876543210",  // this process's
      name + ".tmp." + dead + ".x",                                          // not our naming
      name + ".tmp." + dead + ".7.0123456789ABCDEF",                         // not our naming
      name + ".tmp.notapid",                                                 // not our naming
      "other.safetensors.tmp." + dead,                                       // another target's
  };
  for (const std::string& file : stale) write_bytes(dir_ / file, std::vector<std::byte>(5));
  for (const std::string& file : kept) write_bytes(dir_ / file, std::vector<std::byte>(5));
  st::write(dir_ / name, sample_file());
  std::set<std::string> expected(kept.begin(), kept.end());
  expected.insert(name);
  EXPECT_EQ(listing(dir_), expected);
  // A writer whose pid looks dead from here (another pid namespace, another host on a shared
  // folder) but that still holds the lock on its temporary keeps it.
  std::string elsewhere = name + ".tmp." + dead + ".8.0123456789abcdef";
  write_bytes(dir_ / elsewhere, std::vector<std::byte>(5));
  int held = ::open((dir_ / elsewhere).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX), 0);
  st::write(dir_ / name, sample_file());
  expected.insert(elsewhere);
  EXPECT_EQ(listing(dir_), expected);
  ::close(held);  // the writer is gone: the next save cleans up after it
  st::write(dir_ / name, sample_file());
  expected.erase(elsewhere);
  EXPECT_EQ(listing(dir_), expected);
}

mode_t mode_of(const fs::path& path) {
  struct stat info {};
  EXPECT_EQ(::stat(path.c_str(), &info), 0) << path;
  return info.st_mode & 07777;
}

TEST_F(SafetensorsFiles, SaveKeepsTheModeOfAnExistingFile) {
  std::string path = dir_ / "private.safetensors";
  mode_t old_umask = ::umask(027);
  st::write(path, sample_file());
  EXPECT_EQ(mode_of(path), 0640u);  // a new file: 0666 less the umask
  ::umask(old_umask);
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  st::write(path, sample_file());
  EXPECT_EQ(mode_of(path), 0600u);
  ASSERT_EQ(::chmod(path.c_str(), 0604), 0);
  st::write(path, sample_file());
  EXPECT_EQ(mode_of(path), 0604u);
}

TEST_F(SafetensorsFiles, SaveWritesThroughSymbolicLinks) {
  fs::create_directories(dir_ / "real");
  fs::create_directories(dir_ / "links");
  fs::path target = dir_ / "real" / "model.safetensors";
  st::write(target, generation_file(1));
  ASSERT_EQ(::chmod(target.c_str(), 0600), 0);
  // A relative link to a relative link: each resolves against its own folder.
  fs::create_symlink("../real/model.safetensors", dir_ / "links" / "first");
  fs::create_symlink("first", dir_ / "links" / "second");
  st::write(dir_ / "links" / "second", generation_file(2));
  EXPECT_TRUE(fs::is_symlink(dir_ / "links" / "second"));
  EXPECT_TRUE(fs::is_symlink(dir_ / "links" / "first"));
  EXPECT_EQ(generation_of(st::read(target)), 2);
  EXPECT_EQ(mode_of(target), 0600u);
  EXPECT_EQ(listing(dir_ / "links"), (std::set<std::string>{"first", "second"}));
  EXPECT_EQ(listing(dir_ / "real"), std::set<std::string>{"model.safetensors"});

  // A dangling link creates its target, as a shell's '>' does.
  fs::create_symlink(dir_ / "real" / "new.safetensors", dir_ / "links" / "dangling");
  st::write(dir_ / "links" / "dangling", generation_file(3));
  EXPECT_TRUE(fs::is_symlink(dir_ / "links" / "dangling"));
  EXPECT_EQ(generation_of(st::read(dir_ / "real" / "new.safetensors")), 3);

  // A loop is an error, not a hang.
  fs::create_symlink("loop_b", dir_ / "links" / "loop_a");
  fs::create_symlink("loop_a", dir_ / "links" / "loop_b");
  EXPECT_MT_ERROR(st::write(dir_ / "links" / "loop_a", generation_file(4)), "symbolic links");
}

// A folder anyone may write and only owners may delete from, as /tmp: dir/shared.
fs::path sticky_folder(const fs::path& dir) {
  fs::path shared = dir / "shared";
  fs::create_directories(shared);
  EXPECT_EQ(::chmod(shared.c_str(), 01777), 0);
  return shared;
}

// A link another user planted in a shared sticky folder such as /tmp is not followed: writing
// through it would let them point a victim's save at any file the victim may replace. The kernel
// refuses such links too (fs.protected_symlinks); following them by hand must not bypass that.
TEST_F(SafetensorsFiles, SaveRefusesLinksPlantedByOthersInStickyFolders) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a link to another user";
  const fs::path shared = sticky_folder(dir_);
  fs::path victim = dir_ / "victim.txt";
  std::ofstream(victim) << "precious";
  fs::path planted = shared / "model.safetensors";
  fs::create_symlink(victim, planted);
  ASSERT_EQ(::lchown(planted.c_str(), 65534, 65534), 0);  // as if nobody had made it
  EXPECT_MT_ERROR(st::write(planted, generation_file(1)), "symbolic link");
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "precious");
  // The user's own links there are still written through.
  fs::path own = shared / "own.safetensors";
  fs::create_symlink(dir_ / "real.safetensors", own);
  st::write(own, generation_file(2));
  EXPECT_EQ(generation_of(st::read(dir_ / "real.safetensors")), 2);
}

// A device, a pipe or a folder at the path is refused, and left as it was: the temporary renamed
// over it made a save to /dev/null, run as root, replace the system's /dev/null with a file.
TEST_F(SafetensorsFiles, SaveRefusesDevicesPipesAndFolders) {
  fs::path pipe = dir_ / "pipe", folder = dir_ / "folder", device = dir_ / "null";
  ASSERT_EQ(::mkfifo(pipe.c_str(), 0600), 0);
  fs::create_directories(folder);
  EXPECT_MT_ERROR(st::write(pipe, generation_file(1)), "not a regular file");
  EXPECT_MT_ERROR(st::write(folder, generation_file(1)), "not a regular file");
  EXPECT_TRUE(fs::is_fifo(pipe));
  EXPECT_TRUE(fs::is_directory(folder));
  std::set<std::string> expected{"folder", "pipe"};
  if (::geteuid() == 0 && ::mknod(device.c_str(), S_IFCHR | 0666, ::makedev(1, 3)) == 0) {
    EXPECT_MT_ERROR(st::write(device, generation_file(1)), "not a regular file");
    EXPECT_TRUE(fs::is_character_file(device));
    expected.insert("null");
  }
  EXPECT_EQ(listing(dir_), expected);  // no temporaries left
}

// A file another user made in a shared sticky folder does not lend root's save its owner and
// mode: root's checkpoint would be theirs to change before root loads it again.
TEST_F(SafetensorsFiles, SaveTakesNoOwnerFromAFilePlantedInAStickyFolder) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  const fs::path shared = sticky_folder(dir_);
  fs::path planted = shared / "model.safetensors";
  st::write(planted, generation_file(1));
  ASSERT_EQ(::chown(planted.c_str(), 65534, 65534), 0);
  ASSERT_EQ(::chmod(planted.c_str(), 0666), 0);
  mode_t old_umask = ::umask(022);
  st::write(planted, generation_file(2));
  ::umask(old_umask);
  struct stat info {};
  ASSERT_EQ(::stat(planted.c_str(), &info), 0);
  EXPECT_EQ(info.st_uid, 0u);
  EXPECT_EQ(info.st_mode & 07777, 0644u);
  EXPECT_EQ(generation_of(st::read(planted)), 2);
}

// ---- checksums ----

// Where a tensor's bytes start in a serialized file.
size_t data_start(std::span<const std::byte> bytes, const st::File& file, std::string_view name) {
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  size_t offset = 8 + header_length;
  for (const st::TensorData& t : file.tensors) {
    if (t.name == name) return offset;
    offset += t.bytes.size();
  }
  ADD_FAILURE() << "no tensor " << name;
  return 0;
}

TEST_F(SafetensorsFiles, ChecksumsCatchAFlippedDataByte) {
  st::File file;
  file.tensors.push_back(
      tensor("fc1.weight", DType::f32, {2, 2}, to_bytes<float>({-0.0809f, 0.5f, 0.25f, -1.0f})));
  file.tensors.push_back(tensor("fc1.bias", DType::f32, {2}, to_bytes<float>({0.125f, 2.0f})));
  file.metadata = {{"format", "pt"}};
  std::string path = dir_ / "model.safetensors";
  st::write(path, file);
  expect_same(st::read(path), file);  // the checksum entry is not user metadata

  std::vector<std::byte> bytes = st::serialize(file);
  for (const char* name : {"fc1.weight", "fc1.bias"}) {
    SCOPED_TRACE(name);
    std::vector<std::byte> corrupt = bytes;
    // The top byte of the first float: -0.0809 becomes about -2.75e37, still a finite float.
    corrupt[data_start(bytes, file, name) + 3] ^= std::byte{0x7c};
    write_bytes(path, corrupt);
    std::string fragment = fmt::format("tensor '{}' is corrupt", name);
    EXPECT_MT_ERROR(st::read(path), path, fragment, "xxh3_64");
    EXPECT_MT_ERROR(st::parse(corrupt, "memory.st"), "memory.st", fragment);
  }
}

TEST(Safetensors, ChecksumMetadataIsCheckedAndReserved) {
  st::File file = sample_file();
  std::vector<std::byte> bytes = st::serialize(file);
  std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  EXPECT_NE(text.find("\"mixtape.checksum.xxh3_64\":\"{"), std::string::npos);

  // User metadata may not use the prefix, so a user's entry is never taken for ours.
  st::File reserved = file;
  reserved.metadata.push_back({"mixtape.checksum.crc32c", "x"});
  EXPECT_MT_ERROR(st::serialize(reserved), "'mixtape.checksum.crc32c'", "reserved");

  // A checksum entry that does not match the tensors means a tool rewrote the file.
  const std::string data = R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  auto with_sums = [&](std::string sums) {
    return hand_made(R"({"__metadata__":{"mixtape.checksum.xxh3_64":)" + sums + "}," + data + "}",
                     4);
  };
  EXPECT_MT_ERROR(st::parse(with_sums(R"("{}")"), "m.st"), "lists 0 tensors, the file holds 1");
  EXPECT_MT_ERROR(st::parse(with_sums(R"("{\"b\":\"0000000000000000\"}")"), "m.st"),
                  "no checksum for tensor 'a'");
  EXPECT_MT_ERROR(st::parse(with_sums(R"("{\"a\":\"12\"}")"), "m.st"), "not 16 hex digits");
  EXPECT_MT_ERROR(st::parse(with_sums(R"("[1]")"), "m.st"), "must hold a JSON object");
  EXPECT_MT_ERROR(st::parse(with_sums(R"("{")"), "m.st"), "is not a JSON object");
  EXPECT_MT_ERROR(st::parse(with_sums(R"("{\"a\":\"0000000000000000\"}")"), "m.st"),
                  "tensor 'a' is corrupt");
  // Without the entry (another writer's file) the data loads unverified.
  EXPECT_EQ(st::parse(hand_made("{" + data + "}", 4), "m.st").tensors.size(), 1u);
  // One damaged byte in the entry's name must not turn verification off.
  std::string renamed = R"({"__metadata__":{"mixtape.checksum.xxh3_65":"{\"a\":\"0\"}"},)";
  EXPECT_MT_ERROR(st::parse(hand_made(renamed + data + "}", 4), "m.st"),
                  "'mixtape.checksum.xxh3_65'", "reserved for checksums");
}

// Replaces the one occurrence of `from` in a serialized file's header by `to`, of equal length.
std::vector<std::byte> with_header_edit(std::vector<std::byte> bytes, std::string_view from,
                                        std::string_view to) {
  EXPECT_EQ(from.size(), to.size());
  std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(text.find(from, at + 1), std::string::npos) << from;
  if (at != std::string::npos) std::memcpy(bytes.data() + at, to.data(), to.size());
  return bytes;
}

TEST(Safetensors, HeaderChecksumCatchesDamagedMetadataAndShapes) {
  st::File file;
  file.tensors.push_back(tensor("w", DType::f32, {1, 4}, to_bytes<float>({1, 2, 3, 4})));
  file.tensors.push_back(tensor("b", DType::f32, {2}, to_bytes<float>({5, 6})));
  file.metadata = {{"step", "1200"}, {"generator.offset", "4096"}};
  std::vector<std::byte> bytes = st::serialize(file);
  expect_same(st::parse(bytes, "m.st"), file);

  // Each edit leaves valid JSON and every tensor's bytes as they were, so only the header
  // checksum can tell: a digit of a metadata value, a shape with the same element count, a
  // dtype of the same width, a renamed tensor.
  for (auto [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"1200\"", "\"1208\""},
           {"\"4096\"", "\"4097\""},
           {"[1,4]", "[4,1]"},
           {"\"w\":{", "\"v\":{"},
           {"\"b\":{\"dtype\":\"F32\"", "\"b\":{\"dtype\":\"I32\""}}) {
    SCOPED_TRACE(from);
    EXPECT_MT_ERROR(st::parse(with_header_edit(bytes, from, to), "m.st"),
                    "m.st: the header is corrupt", "xxh3_64");
  }

  // The recorded checksum itself: damaged, or not 16 hex digits.
  std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  std::string key = "\"mixtape.checksum.header_xxh3_64\":\"";
  size_t at = text.find(key);
  ASSERT_NE(at, std::string::npos);
  std::string recorded = text.substr(at + key.size(), 16);
  std::string flipped = recorded;
  flipped[0] = flipped[0] == '0' ? '1' : '0';
  EXPECT_MT_ERROR(st::parse(with_header_edit(bytes, recorded, flipped), "m.st"),
                  "the header is corrupt");
  EXPECT_MT_ERROR(st::parse(with_header_edit(bytes, recorded, "0x" + recorded.substr(2)), "m.st"),
                  "'mixtape.checksum.header_xxh3_64' is not 16 hex digits");

  // The checksums cannot cover their own keys: a key one byte from one is a damaged one, in
  // the reserved prefix or not, and no user key may be one.
  EXPECT_MT_ERROR(st::parse(with_header_edit(bytes, "\"mixtape.checksum.header_xxh3_64\"",
                                             "\"mixtape_checksum.header_xxh3_64\""),
                            "m.st"),
                  "'mixtape_checksum.header_xxh3_64' is one byte from "
                  "'mixtape.checksum.header_xxh3_64': the file is damaged");
  EXPECT_MT_ERROR(st::parse(with_header_edit(bytes, "\"mixtape.checksum.xxh3_64\"",
                                             "\"mixtape.checksum_xxh3_64\""),
                            "m.st"),
                  "one byte from 'mixtape.checksum.xxh3_64'");
  st::File near = file;
  near.metadata.push_back({"mixtape-checksum.xxh3_64", "x"});
  EXPECT_MT_ERROR(st::serialize(near), "'mixtape-checksum.xxh3_64' is one byte from", "reserved");

  // Metadata alone, with no tensors, is covered too.
  st::File metadata_only;
  metadata_only.metadata = {{"epoch", "3"}};
  std::vector<std::byte> only = st::serialize(metadata_only);
  expect_same(st::parse(only, "m.st"), metadata_only);
  EXPECT_MT_ERROR(st::parse(with_header_edit(only, "\"3\"", "\"4\""), "m.st"),
                  "the header is corrupt");

  // A file from before the header checksum (tensor checksums only) still loads.
  std::string old_header = R"({"__metadata__":{"step":"7","mixtape.checksum.xxh3_64":"{\"a\":\")" +
                           fmt::format("{:016x}", XXH3_64bits("\x11\x11\x11\x11", 4)) +
                           R"(\"}"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  st::File old = st::parse(hand_made(old_header, 4), "old.st");
  EXPECT_EQ(old.metadata, (std::vector<std::pair<std::string, std::string>>{{"step", "7"}}));
}

// ---- hostile headers and sizes ----

// Bytes the process has held at most so far, from the kernel's high-water mark.
int64_t peak_rss_bytes() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return int64_t{usage.ru_maxrss} * 1024;
}

// Headers just under the size cap that cost 1.2-2.7 GB and 15-28 s each before parsing became
// bounded: each must now be refused quickly with a clear message and little memory.
TEST(Safetensors, HostileHeadersCostBoundedTimeAndMemory) {
  // A header of `head`, then `before`, a distinct key (unless `before` is empty) and `after`
  // repeated while it fits, then `tail`.
  // Written straight into one buffer: appending ~7M pieces to strings takes seconds under ASan.
  auto header = [](std::string_view head, std::string_view before, std::string_view after,
                   std::string_view tail) {
    std::vector<std::byte> bytes(8 + st::max_header_bytes);
    char* const start = reinterpret_cast<char*>(bytes.data()) + 8;
    char* const budget_end = start + st::max_header_bytes - tail.size() - 64;
    char* out = std::copy(head.begin(), head.end(), start);
    for (size_t i = 0; out < budget_end; ++i) {
      if (!before.empty()) {
        out = std::copy(before.begin(), before.end(), out);
        out = std::to_chars(out, out + 32, i, 36).ptr;
      }
      out = std::copy(after.begin(), after.end(), out);
    }
    out = std::copy(tail.begin(), tail.end(), out - 1);  // over the last ','
    uint64_t length = static_cast<uint64_t>(out - start);
    std::memcpy(bytes.data(), &length, 8);
    bytes.resize(8 + length);
    return bytes;
  };
  struct Case {
    std::function<std::vector<std::byte>()> make;
    std::string fragment;
  };
  const Case cases[] = {
      {[&] {  // a 50M-element shape
         return header(R"({"a":{"dtype":"F32","data_offsets":[0,0],"shape":[)", "", "0,", "]}}");
       },
       "member \"a\" holds more than"},
      {[&] {  // millions of metadata keys
         return header(R"({"__metadata__":{)", "\"", R"(":"",)", "}}");
       },
       "member \"__metadata__\" holds more than"},
      {[&] {  // millions of empty tensors
         return header("{", "\"", R"(":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)", "}");
       },
       fmt::format("more than {} tensors, the limit", st::max_tensors)},
  };
  // 0.02-0.4 s a case in a release build, where a full parse took 10-15 s; sanitizers are slower
  // (a case took up to 11.7 s beside another test on 2 cores, where a full parse would take
  // minutes).
#if defined(__SANITIZE_ADDRESS__)
  const double time_limit = 25;
#else
  const double time_limit = 3;
#endif
  int64_t rss_before = peak_rss_bytes();
  for (const Case& c : cases) {
    std::vector<std::byte> bytes = c.make();
    ASSERT_GT(bytes.size(), st::max_header_bytes - 200);
    ASSERT_LE(bytes.size(), st::max_header_bytes + 8);
    auto start = std::chrono::steady_clock::now();
    EXPECT_MT_ERROR(st::parse(bytes, "hostile.st"), "hostile.st", c.fragment);
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, time_limit) << c.fragment;
  }
  // A case's bytes are ~100 MB; the parse may add a small multiple of the header's size, not the
  // 1.2-2.7 GB a full parse tree took.
  EXPECT_LT(peak_rss_bytes() - rss_before, int64_t{500} << 20);
}

TEST_F(SafetensorsFiles, DeclaredSizesBeyondTheFileAreRejectedBeforeAllocating) {
  // 64 GiB declared, 16 bytes present: an mt::Error from the header check, never bad_alloc.
  std::string header =
      R"({"huge":{"dtype":"F32","shape":[16,1073741824],"data_offsets":[0,68719476736]}})";
  std::string path = dir_ / "sparse_claim.safetensors";
  write_bytes(path, hand_made(header, 16));
  EXPECT_MT_ERROR(st::read(path), path, "tensor 'huge'", "beyond the 16-byte data section");
}

// A file of one F32 tensor "huge" of `tensor_bytes` that it really holds, as a hole (no disk
// space used); false where the file system cannot hold such a file.
bool write_sparse_f32_file(const std::string& path, uint64_t tensor_bytes) {
  std::string header =
      fmt::format(R"({{"huge":{{"dtype":"F32","shape":[{}],"data_offsets":[0,{}]}}}})",
                  tensor_bytes / 4, tensor_bytes);
  header.append((8 - header.size() % 8) % 8, ' ');
  write_bytes(path, hand_made(header, 0));
  std::error_code error;
  fs::resize_file(path, 8 + header.size() + tensor_bytes, error);
  return !error;
}

// A 1 GiB tensor the file really holds (sparse), read where memory is short: an mt::Error naming
// the bytes and the tensor, not std::bad_alloc. In a child process, whose address space is
// limited; ASan reserves terabytes of shadow memory, so it cannot run under such a limit.
TEST_F(SafetensorsFiles, RunningOutOfMemoryWhileReadingIsAnMtError) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "an address-space limit cannot be combined with AddressSanitizer";
#endif
  constexpr uint64_t tensor_bytes = uint64_t{1} << 30;
  std::string path = dir_ / "sparse.safetensors";
  ASSERT_TRUE(write_sparse_f32_file(path, tensor_bytes));

  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    long pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    uint64_t limit = static_cast<uint64_t>(pages) * ::sysconf(_SC_PAGESIZE) + (uint64_t{256} << 20);
    struct rlimit rl {
      limit, limit
    };
    if (::setrlimit(RLIMIT_AS, &rl) != 0) ::_exit(3);
    try {
      st::read(path);
      ::_exit(1);
    } catch (const mt::Error& e) {
      std::string message = e.what();
      bool named = message.find("out of memory allocating 1073741824 bytes for tensor 'huge'") !=
                       std::string::npos &&
                   message.find(path) != std::string::npos;
      ::_exit(named ? 0 : 2);
    } catch (...) {
      ::_exit(4);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: no error, 2: unclear message, 3: setrlimit failed, "
                                       "4: an exception other than mt::Error";
}

// A file larger than the machine's memory and swap (sparse here) is refused before any of it is
// allocated, with no memory limit set: jemalloc hands out such a block, and filling it had the
// process killed by the OS.
TEST_F(SafetensorsFiles, AFileLargerThanTheMachineIsRefusedWithoutALimit) {
  struct sysinfo info {};
  ASSERT_EQ(::sysinfo(&info), 0);
  const uint64_t machine = (static_cast<uint64_t>(info.totalram) + info.totalswap) * info.mem_unit;
  const uint64_t tensor_bytes = (machine / 4 + (uint64_t{1} << 28)) * 4;
  std::string path = dir_ / "larger_than_memory.safetensors";
  if (!write_sparse_f32_file(path, tensor_bytes))
    GTEST_SKIP() << "this file system holds no such sparse file";
  EXPECT_MT_ERROR(st::read(path), "out of memory", path, "more than this machine's");
}

// ---- interop with independent implementations of the format ----

// Debian's Python decodes files with nothing but struct and json (PythonInterop); PyPI's
// safetensors, the format's reference implementation, reads and writes them in the venv
// tools/reference_venv.sh makes (ReferenceSafetensors).
constexpr const char* python = "/usr/bin/python3";

// Decodes a file with nothing but struct and json, and compares it with what the C++ side
// says it wrote, checksums recomputed with Python's xxhash.
constexpr const char* python_reader = R"PY(
import json, math, struct, sys
import xxhash

path, expected_path = sys.argv[1], sys.argv[2]
data = open(path, 'rb').read()
expected = json.load(open(expected_path, encoding='utf-8'))
(n,) = struct.unpack('<Q', data[:8])
assert n % 8 == 0, 'header length %d not a multiple of 8' % n
header = json.loads(data[8:8 + n].decode('utf-8'))
body = data[8 + n:]
metadata = header.pop('__metadata__')
checksums = json.loads(metadata.pop('mixtape.checksum.xxh3_64'))
header_checksum = metadata.pop('mixtape.checksum.header_xxh3_64')
assert metadata == expected['metadata'], 'metadata differs'

# The header checksum, recomputed from the layout safetensors.h documents: the metadata sorted by
# key, then each tensor's name, dtype and shape sorted by name; strings as a u64 LE length and
# UTF-8 bytes, counts and dims as u64 LE.
def text(value):
    raw = value.encode('utf-8')
    return struct.pack('<Q', len(raw)) + raw
def sorted_by_utf8(keys):
    return sorted(keys, key=lambda k: k.encode('utf-8'))
encoding = struct.pack('<Q', len(metadata))
for key in sorted_by_utf8(metadata):
    encoding += text(key) + text(metadata[key])
encoding += struct.pack('<Q', len(header))
for name in sorted_by_utf8(header):
    shape = header[name]['shape']
    encoding += text(name) + text(header[name]['dtype']) + struct.pack('<Q', len(shape))
    encoding += b''.join(struct.pack('<Q', dim) for dim in shape)
assert header_checksum == xxhash.xxh3_64_hexdigest(encoding), 'header checksum'
names = [t['name'] for t in expected['tensors']]
assert list(header) == names, ('names', list(header), names)
formats = {'F32': 'f', 'F64': 'd', 'F16': 'e', 'BF16': 'H', 'I32': 'i', 'I64': 'q', 'BOOL': '?'}
cursor = 0
for t in expected['tensors']:
    entry = header[t['name']]
    assert sorted(entry) == ['data_offsets', 'dtype', 'shape'], entry
    assert entry['dtype'] == t['dtype'], (entry, t)
    assert entry['shape'] == t['shape'], (entry, t)
    begin, end = entry['data_offsets']
    assert begin == cursor, ('gap or overlap before', t['name'])
    cursor = end
    code = formats[entry['dtype']]
    count = math.prod(entry['shape'])
    assert end - begin == count * struct.calcsize(code), ('size', t['name'])
    values = list(struct.unpack('<%d%s' % (count, code), body[begin:end]))
    if entry['dtype'] == 'BF16':
        values = [struct.unpack('<f', struct.pack('<I', v << 16))[0] for v in values]
    assert values == t['values'], (t['name'], values, t['values'])
    # The checksum, recomputed by an independent XXH3 implementation.
    assert checksums.pop(t['name']) == xxhash.xxh3_64_hexdigest(body[begin:end]), t['name']
assert cursor == len(body), 'data section not fully covered'
assert not checksums, ('checksums for unknown tensors', checksums)
print('ok')
)PY";

// Writes a file byte by byte per the spec, keys sorted (unlike the data order) and non-ASCII
// metadata escaped as \uXXXX, as Python's json module does by default.
constexpr const char* python_writer = R"PY(
import json, struct, sys

bf16 = b''.join(struct.pack('<f', v)[2:] for v in [1.0, -0.5, 256.0, 3.140625, 0.0, -2.0])
tensors = [
    ('weight.bf16', 'BF16', [2, 3], bf16),
    ('counts', 'I64', [4], struct.pack('<4q', 1, -2, 2**62, -2**63)),
    ('scale', 'F16', [], struct.pack('<e', -0.25)),
    ('mask', 'BOOL', [0, 5], b''),
]
header = {'__metadata__': {'format': 'pt', 'author': 'python \u00fc \U0001F600'}}
body = b''
for name, dtype, shape, raw in tensors:
    offsets = [len(body), len(body) + len(raw)]
    header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': offsets}
    body += raw
text = json.dumps(header, sort_keys=True).encode('ascii')
text += b' ' * (-len(text) % 8)
with open(sys.argv[1], 'wb') as f:
    f.write(struct.pack('<Q', len(text)) + text + body)
)PY";

class PythonInterop : public SafetensorsFiles {
 protected:
  void SetUp() override {
    if (::access(python_.c_str(), X_OK) != 0)
      GTEST_SKIP() << python_ << " not found; interop not checked";
    SafetensorsFiles::SetUp();
  }

  // Runs a script with arguments; returns its combined output, failing the test on nonzero exit.
  std::string run_python(const char* script, const std::vector<std::string>& args) {
    fs::path script_path = dir_ / "script.py";
    fs::path output_path = dir_ / "python_output.txt";
    std::ofstream(script_path) << script;
    std::string command = fmt::format("{} '{}'", python_, script_path.string());
    for (const std::string& arg : args) command += fmt::format(" '{}'", arg);
    command += fmt::format(" > '{}' 2>&1", output_path.string());
    int status = std::system(command.c_str());
    std::string output = read_text(output_path);
    EXPECT_EQ(status, 0) << "python failed:\n" << output;
    return output;
  }

  std::string python_ = python;
};

// Writes sample_file() into `dir` and, beside it, what an independent reader should find in it
// (its metadata and sample_expectations(), as JSON); returns the two paths.
std::pair<std::string, std::string> sample_file_and_expectations(const fs::path& dir) {
  std::string path = dir / "from_cpp.safetensors";
  st::File file = sample_file();
  st::write(path, file);
  Value metadata = Value::object();
  for (const auto& [key, value] : file.metadata) metadata[key] = value;
  Value tensors = Value::array();
  for (const Expected& e : sample_expectations())
    tensors.push_back(
        {{"name", e.name}, {"dtype", e.dtype}, {"shape", e.shape}, {"values", e.values}});
  std::string expected_path = dir / "expected.json";
  std::ofstream(expected_path) << mt::json::dump(
      Value{{"metadata", std::move(metadata)}, {"tensors", std::move(tensors)}});
  return {path, expected_path};
}

TEST_F(PythonInterop, PythonReadsWhatMixtapeWrites) {
  auto [path, expected_path] = sample_file_and_expectations(dir_);

  EXPECT_NE(run_python(python_reader, {path, expected_path}).find("ok"), std::string::npos);
}

TEST_F(PythonInterop, MixtapeReadsWhatPythonWrites) {
  std::string path = dir_ / "from_python.safetensors";
  run_python(python_writer, {path});
  st::File file = st::read(path);

  // Tensors come back in data order, not the header's sorted key order.
  ASSERT_EQ(file.tensors.size(), 4u);
  EXPECT_EQ(file.tensors[0].name, "weight.bf16");
  EXPECT_EQ(file.tensors[1].name, "counts");
  EXPECT_EQ(file.tensors[2].name, "scale");
  EXPECT_EQ(file.tensors[3].name, "mask");

  const st::TensorData& weight = file.tensors[0];
  EXPECT_EQ(weight.dtype, DType::bf16);
  EXPECT_EQ(weight.shape, (std::vector<int64_t>{2, 3}));
  std::vector<uint16_t> expected_bf16;
  for (float v : {1.0f, -0.5f, 256.0f, 3.140625f, 0.0f, -2.0f})
    expected_bf16.push_back(bf16_bits(v));
  EXPECT_EQ(from_bytes<uint16_t>(weight.bytes), expected_bf16);

  const st::TensorData& counts = file.tensors[1];
  EXPECT_EQ(counts.dtype, DType::i64);
  EXPECT_EQ(counts.shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(from_bytes<int64_t>(counts.bytes),
            (std::vector<int64_t>{1, -2, int64_t{1} << 62, std::numeric_limits<int64_t>::min()}));

  const st::TensorData& scale = file.tensors[2];
  EXPECT_EQ(scale.dtype, DType::f16);
  EXPECT_TRUE(scale.shape.empty());
  EXPECT_EQ(from_bytes<uint16_t>(scale.bytes), std::vector<uint16_t>{0xB400});  // -0.25

  const st::TensorData& mask = file.tensors[3];
  EXPECT_EQ(mask.dtype, DType::boolean);
  EXPECT_EQ(mask.shape, (std::vector<int64_t>{0, 5}));
  EXPECT_TRUE(mask.bytes.empty());

  using Metadata = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(file.metadata, (Metadata{{"author", "python \u00fc \U0001F600"}, {"format", "pt"}}));

  // And mixtape's own rewrite of it reads back identically.
  std::string rewritten = dir_ / "rewritten.safetensors";
  st::write(rewritten, file);
  expect_same(st::read(rewritten), file);
}

// ---- the format's reference implementation (PyPI safetensors) ----

// The venv's python (tools/reference_venv.sh, shared with test_summary_writer): Debian's Python
// and torch plus PyPI's safetensors.
class ReferenceSafetensors : public PythonInterop {
 protected:
  void SetUp() override {
    std::string source = MIXTAPE_SOURCE_DIR, binary = MIXTAPE_BINARY_DIR;
    int made = std::system(
        (source + "/tools/reference_venv.sh " + binary + "/python-venv > /dev/null").c_str());
    if (made != 0)
      GTEST_SKIP() << "the reference venv could not be made (tools/reference_venv.sh said why "
                      "above; it needs python3-venv and PyPI)";
    python_ = binary + "/python-venv/bin/python";
    PythonInterop::SetUp();
  }
};

// safe_open and load_file read every tensor and the metadata of a file mixtape wrote, with the
// values an independent decoder expects (our checksums are one more metadata string to them).
constexpr const char* reference_reader = R"PY(
import json, sys, torch
from safetensors import safe_open
from safetensors.torch import load_file

path, expected_path = sys.argv[1], sys.argv[2]
expected = json.load(open(expected_path, encoding='utf-8'))
tags = {torch.float32: 'F32', torch.float64: 'F64', torch.float16: 'F16', torch.bfloat16: 'BF16',
        torch.int32: 'I32', torch.int64: 'I64', torch.bool: 'BOOL'}
loaded = load_file(path)
with safe_open(path, framework='pt') as f:
    metadata = f.metadata()
    assert sorted(f.keys()) == sorted(t['name'] for t in expected['tensors']), list(f.keys())
    for t in expected['tensors']:
        tensor = f.get_tensor(t['name'])
        assert tags[tensor.dtype] == t['dtype'], (t['name'], tensor.dtype)
        assert list(tensor.shape) == t['shape'], (t['name'], tensor.shape)
        flat = tensor.flatten()
        values = (flat.double() if tensor.is_floating_point() else flat).tolist()
        assert values == t['values'], (t['name'], values, t['values'])
        assert torch.equal(loaded[t['name']], tensor), t['name']
assert 'mixtape.checksum.xxh3_64' in metadata, metadata
del metadata['mixtape.checksum.xxh3_64']
del metadata['mixtape.checksum.header_xxh3_64']
assert metadata == expected['metadata'], (metadata, expected['metadata'])
print('ok')
)PY";

TEST_F(ReferenceSafetensors, SafeOpenReadsWhatMixtapeWrites) {
  auto [path, expected_path] = sample_file_and_expectations(dir_);
  EXPECT_NE(run_python(reference_reader, {path, expected_path}).find("ok"), std::string::npos);
}

// save_file writes every dtype mixtape reads, at the edges of each (f16's largest and smallest
// numbers, bf16 near f32's range, i64's extremes), a 0-d and an empty tensor, a transposed one
// made contiguous, and unicode metadata; the values it meant go to a JSON file beside it. It
// also writes one file per dtype the format has and mixtape does not read.
constexpr const char* reference_writer = R"PY(
import json, sys, torch
from safetensors.torch import save_file

folder = sys.argv[1]
tensors = {
    'f64': torch.tensor([0.1, -1e300, 5e-324], dtype=torch.float64),
    'f32.transposed': (torch.arange(6, dtype=torch.float32).reshape(2, 3) * -1.5).t().contiguous(),
    'f16': torch.tensor([65504.0, -2.0 ** -24, 0.333, -0.0], dtype=torch.float16),
    'bf16': torch.tensor([[3e38, -1.0 / 3], [1e-38, 7.0]], dtype=torch.bfloat16),
    'i64': torch.tensor([2 ** 62, -2 ** 63, 2 ** 63 - 1]),
    'i32': torch.tensor([[-2 ** 31], [2 ** 31 - 1]], dtype=torch.int32),
    'mask': torch.tensor([True, False, True]),
    'scalar': torch.tensor(2.5),
    'empty': torch.zeros(0, 4, dtype=torch.float16),
}
tags = {torch.float32: 'F32', torch.float64: 'F64', torch.float16: 'F16', torch.bfloat16: 'BF16',
        torch.int32: 'I32', torch.int64: 'I64', torch.bool: 'BOOL'}
metadata = {'format': 'pt', 'note': 'caf\u00e9 \U0001F600'}
save_file(tensors, folder + '/from_reference.safetensors', metadata=metadata)
expected = {'metadata': metadata, 'tensors': [
    {'name': name, 'dtype': tags[t.dtype], 'shape': list(t.shape),
     'values': (t.double() if t.is_floating_point() else t).flatten().tolist()}
    for name, t in tensors.items()]}
json.dump(expected, open(folder + '/expected.json', 'w', encoding='utf-8'))
for name, dtype in [('i8', torch.int8), ('u8', torch.uint8), ('i16', torch.int16)]:
    save_file({'q': torch.tensor([1, 2], dtype=dtype)}, folder + '/' + name + '.safetensors')
)PY";

// A tensor's values decoded to JSON numbers (f16 and bf16 by exact widening), as Python's
// tolist() of the same tensor gives them.
Value decoded(const st::TensorData& tensor) {
  Value values = Value::array();
  auto push_all = [&]<typename T>(T, auto widen) {
    for (T value : from_bytes<T>(tensor.bytes)) values.push_back(widen(value));
  };
  auto same = [](auto value) { return value; };
  switch (tensor.dtype) {
    case DType::f32:
      push_all(float{}, [](float v) { return double{v}; });
      break;
    case DType::f64:
      push_all(double{}, same);
      break;
    case DType::f16:
      push_all(uint16_t{}, [](uint16_t b) { return double{mt::f16_bits_to_f32(b)}; });
      break;
    case DType::bf16:
      push_all(uint16_t{}, [](uint16_t b) { return double{mt::bf16_bits_to_f32(b)}; });
      break;
    case DType::i32:
      push_all(int32_t{}, same);
      break;
    case DType::i64:
      push_all(int64_t{}, same);
      break;
    case DType::boolean:
      push_all(uint8_t{}, [](uint8_t b) { return b != 0; });
      break;
    default:
      ADD_FAILURE() << "unexpected dtype for " << tensor.name;
  }
  return values;
}

TEST_F(ReferenceSafetensors, MixtapeReadsWhatSaveFileWrites) {
  run_python(reference_writer, {dir_.string()});
  st::File file = st::read(dir_ / "from_reference.safetensors");
  Value expected = mt::json::parse(read_text(dir_ / "expected.json"));

  ASSERT_EQ(file.tensors.size(), expected["tensors"].size());
  for (const Value& want : expected["tensors"]) {
    const std::string& name = want["name"].get_ref<const std::string&>();
    SCOPED_TRACE(name);
    const st::TensorData* got = file.find(name);
    ASSERT_NE(got, nullptr);
    EXPECT_EQ(mt::safetensors_name(got->dtype), want["dtype"].get<std::string>());
    EXPECT_EQ(Value(got->shape), want["shape"]);
    EXPECT_EQ(decoded(*got), want["values"]);
  }
  using Metadata = std::vector<std::pair<std::string, std::string>>;
  Metadata metadata;
  for (const auto& [key, value] : expected["metadata"].items())
    metadata.emplace_back(key, value.get<std::string>());
  std::sort(metadata.begin(), metadata.end());
  Metadata read_metadata = file.metadata;
  std::sort(read_metadata.begin(), read_metadata.end());
  EXPECT_EQ(read_metadata, metadata);

  // Dtypes of the format mixtape has no tensors for are refused by name, not misread.
  for (auto [tag, file_name] : {std::pair{"I8", "i8"}, {"U8", "u8"}, {"I16", "i16"}}) {
    std::string path = dir_ / fmt::format("{}.safetensors", file_name);
    EXPECT_MT_ERROR(st::read(path), path, fmt::format("dtype '{}' is not one mixtape reads", tag));
  }
}

}  // namespace
