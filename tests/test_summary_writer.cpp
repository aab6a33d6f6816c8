// tests/test_summary_writer.cpp -- mt::SummaryWriter: CRC32C against RFC 3720's vectors, the
// record frame and Event protobuf byte for byte, graph values fetched in batches (also from a
// step compiled by mt::compile), the logging helpers, and a round trip through TensorBoard's
// own EventAccumulator (PyPI tensorboard in a venv) checking every scalar's tag, step and bits.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <csignal>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <mixtape/mixtape.h>
#include <nlohmann/json.hpp>

#include "mixtape/summary/tfevents.h"

#include "tests/test_util.h"

namespace mt = mixtape;
namespace tfe = mixtape::tfevents;
namespace fs = std::filesystem;

namespace {

// Bitwise CRC32C (reflected polynomial 0x82F63B78), the independent reference for ISA-L's.
uint32_t reference_crc32c(const std::string& data) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint32_t reference_masked(const std::string& data) {
  uint32_t crc = reference_crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string bytes(std::initializer_list<int> values) {
  std::string out;
  for (int v : values) out.push_back(static_cast<char>(v));
  return out;
}

std::string le32(uint32_t v) {
  return bytes({int(v & 0xff), int(v >> 8 & 0xff), int(v >> 16 & 0xff), int(v >> 24)});
}

std::string le64(uint64_t v) { return le32(static_cast<uint32_t>(v)) + le32(v >> 32); }

fs::path fresh_dir(const std::string& name) {
  fs::path dir =
      fs::temp_directory_path() / ("mixtape_summary_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

// Reads a tfevents file back: the frames (checking both CRCs with the reference) and, in each
// Event, the step, the file_version and the (tag, simple_value) pairs of its summary.
struct ReadEvent {
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> scalars;
};

uint64_t read_varint(const std::string& s, size_t& i) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    uint8_t b = static_cast<uint8_t>(s.at(i++));
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
}

// Calls field(number, wire type, payload) for each field of a message (payload: the bytes of a
// length-delimited or fixed field; varints come back as their value in `varint`).
template <typename F>
void fields(const std::string& message, F field) {
  size_t i = 0;
  while (i < message.size()) {
    uint64_t key = read_varint(message, i);
    int number = static_cast<int>(key >> 3), type = static_cast<int>(key & 7);
    uint64_t varint = 0;
    std::string payload;
    if (type == 0) varint = read_varint(message, i);
    if (type == 1) payload = message.substr(i, 8), i += 8;
    if (type == 5) payload = message.substr(i, 4), i += 4;
    if (type == 2) {
      uint64_t n = read_varint(message, i);
      payload = message.substr(i, n);
      i += n;
    }
    field(number, type, varint, payload);
  }
}

std::vector<ReadEvent> read_events(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(in)), {});
  std::vector<ReadEvent> events;
  size_t i = 0;
  while (i < data.size()) {
    std::string length_bytes = data.substr(i, 8);
    uint64_t length = 0;
    std::memcpy(&length, length_bytes.data(), 8);
    uint32_t length_crc = 0, data_crc = 0;
    std::memcpy(&length_crc, data.data() + i + 8, 4);
    EXPECT_EQ(length_crc, reference_masked(length_bytes));
    std::string record = data.substr(i + 12, length);
    std::memcpy(&data_crc, data.data() + i + 12 + length, 4);
    EXPECT_EQ(data_crc, reference_masked(record));
    i += 16 + length;
    ReadEvent event;
    fields(record, [&](int number, int, uint64_t varint, const std::string& payload) {
      if (number == 2) event.step = static_cast<int64_t>(varint);
      if (number == 3) event.file_version = payload;
      if (number == 5)
        fields(payload, [&](int, int, uint64_t, const std::string& value) {
          std::string tag;
          float simple = std::numeric_limits<float>::quiet_NaN();
          fields(value, [&](int n, int, uint64_t, const std::string& p) {
            if (n == 1) tag = p;
            if (n == 2) std::memcpy(&simple, p.data(), 4);
          });
          event.scalars.emplace_back(tag, simple);
        });
    });
    events.push_back(event);
  }
  return events;
}

// (tag, step, value) of every scalar in the events, in file order.
std::vector<std::tuple<std::string, int64_t, float>> scalars_of(const fs::path& path) {
  std::vector<std::tuple<std::string, int64_t, float>> out;
  for (const ReadEvent& e : read_events(path))
    for (const auto& [tag, value] : e.scalars) out.emplace_back(tag, e.step, value);
  return out;
}

TEST(Crc32c, MatchesRfc3720Vectors) {
  // RFC 3720, appendix B.4.
  std::string zeros(32, '\0'), ones(32, '\xff'), up, down;
  for (int i = 0; i < 32; ++i) up.push_back(static_cast<char>(i));
  for (int i = 31; i >= 0; --i) down.push_back(static_cast<char>(i));
  std::string pdu = bytes({0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                           0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
                           0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
                           0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00});
  EXPECT_EQ(tfe::crc32c(zeros.data(), zeros.size()), 0x8a9136aau);
  EXPECT_EQ(tfe::crc32c(ones.data(), ones.size()), 0x62a8ab43u);
  EXPECT_EQ(tfe::crc32c(up.data(), up.size()), 0x46dd794eu);
  EXPECT_EQ(tfe::crc32c(down.data(), down.size()), 0x113fdb5cu);
  EXPECT_EQ(tfe::crc32c(pdu.data(), pdu.size()), 0xd9963a56u);
  EXPECT_EQ(tfe::crc32c("123456789", 9), 0xe3069283u);  // the CRC catalogue's check value
  EXPECT_EQ(tfe::crc32c("", 0), 0u);
  // Longer inputs, at every offset and length, against the bitwise reference.
  std::string text;
  for (int i = 0; i < 3000; ++i) text.push_back(static_cast<char>(i * 7919 % 251));
  for (size_t n : {1u, 7u, 8u, 63u, 64u, 65u, 1000u, 2990u})
    for (size_t offset : {0u, 1u, 3u})
      EXPECT_EQ(tfe::crc32c(text.data() + offset, n), reference_crc32c(text.substr(offset, n)));
  // The mask: rotate right by 15, add 0xa282ead8 (crc 0 of "" masks to the constant).
  EXPECT_EQ(tfe::masked_crc32c("", 0), 0xa282ead8u);
  EXPECT_EQ(tfe::masked_crc32c("123456789", 9),
            ((0xe3069283u >> 15) | (0xe3069283u << 17)) + 0xa282ead8u);
}

TEST(Tfevents, EncodesEventsByteForByte) {
  // wall_time 1.5 (field 1, fixed64), step 3 (field 2, varint), summary (field 5) with one
  // value: tag "a" (field 1), simple_value 2.0f (field 2, fixed32).
  std::string scalar_event =
      bytes({0x09, 0,    0,    0,    0,    0,   0,    0xf8, 0x3f, 0x10, 0x03, 0x2a,
             0x0a, 0x0a, 0x08, 0x0a, 0x01, 'a', 0x15, 0,    0,    0,    0x40});
  EXPECT_EQ(tfe::encode_event(1.5, 3, "", {{"a", 2.0f, std::nullopt, std::nullopt}}), scalar_event);
  // The first event: file_version (field 3) and no summary.
  std::string version_event =
      bytes({0x09, 0, 0, 0, 0, 0, 0, 0, 0x40, 0x10, 0x00, 0x1a, 0x0d}) + "brain.Event:2";
  EXPECT_EQ(tfe::encode_event(2.0, 0, "brain.Event:2", {}), version_event);
  // Multi-byte and negative varints (two's complement, ten bytes, as protobuf's int64).
  EXPECT_EQ(tfe::encode_event(0, 300, "v", {}).substr(9, 3), bytes({0x10, 0xac, 0x02}));
  EXPECT_EQ(tfe::encode_event(0, -1, "v", {}).substr(9, 11),
            bytes({0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}));
  // Two values in one summary, in order.
  std::string two = tfe::encode_event(0, 1, "", {{"x", 1.0f, {}, {}}, {"yy", -0.0f, {}, {}}});
  EXPECT_EQ(two.substr(11), bytes({0x2a, 0x15, 0x0a, 0x08, 0x0a, 0x01, 'x',  0x15, 0, 0, 0x80, 0x3f,
                                   0x0a, 0x09, 0x0a, 0x02, 'y',  'y',  0x15, 0,    0, 0, 0x80}));
}

TEST(Tfevents, FramesRecordsByteForByte) {
  std::string data = "hello, tensorboard";
  std::string length = le64(data.size());
  std::string expected =
      length + le32(reference_masked(length)) + data + le32(reference_masked(data));
  EXPECT_EQ(tfe::frame_record(data), expected);
  std::string empty = le64(0);
  EXPECT_EQ(tfe::frame_record(""), empty + le32(reference_masked(empty)) + le32(0xa282ead8u));
}

TEST(Tfevents, HistogramsCountOverTensorFlowsBuckets) {
  tfe::Histogram h = tfe::make_histogram({-2.0, 0.0, 0.5, 0.5, 3.0});
  EXPECT_EQ(h.num, 5);
  EXPECT_EQ(h.min, -2.0);
  EXPECT_EQ(h.max, 3.0);
  EXPECT_EQ(h.sum, 2.0);
  EXPECT_EQ(h.sum_squares, 13.5);
  double counted = 0;
  for (size_t i = 0; i < h.bucket.size(); ++i) {
    counted += h.bucket[i];
    if (i > 0) {
      EXPECT_LT(h.bucket_limit[i - 1], h.bucket_limit[i]);
    }
    // Each full bucket's left edge is the limit before it: its values lie in (left, right].
    if (h.bucket[i] > 0) {
      ASSERT_GT(i, 0u);
    }
  }
  EXPECT_EQ(counted, 5);
  // 0.5 twice: in one bucket whose edges enclose it, as TensorFlow's upper_bound finds it.
  for (size_t i = 1; i < h.bucket.size(); ++i)
    if (h.bucket_limit[i - 1] <= 0.5 && 0.5 < h.bucket_limit[i]) {
      EXPECT_EQ(h.bucket[i], 2);
    }
  EXPECT_THROW(tfe::make_histogram({1.0, std::numeric_limits<double>::infinity()}), mt::Error);
}

TEST(SummaryWriter, WritesNamedFileWithVersionAndScalars) {
  fs::path dir = fresh_dir("basic") / "nested" / "run";
  std::string path;
  {
    mt::SummaryWriter writer(dir.string());
    path = writer.path();
    EXPECT_TRUE(std::regex_match(fs::path(path).filename().string(),
                                 std::regex(R"(events\.out\.tfevents\.\d{10}\..+\.\d+\.\d+)")));
    writer.add_scalar("loss", 0.25, 1);
    writer.add_scalar("loss", 0.125, 2);
    writer.flush();
    // flush() put everything in the file: readable while the writer is open.
    EXPECT_EQ(scalars_of(path).size(), 2u);
    writer.add_scalar("acc", 0.5, 3);
  }
  std::vector<ReadEvent> events = read_events(path);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].scalars.empty());
  using Row = std::tuple<std::string, int64_t, float>;
  EXPECT_EQ(scalars_of(path),
            (std::vector<Row>{{"loss", 1, 0.25f}, {"loss", 2, 0.125f}, {"acc", 3, 0.5f}}));
  fs::remove_all(dir.parent_path().parent_path());
}

TEST(SummaryWriter, BadInputIsAnError) {
  fs::path dir = fresh_dir("bad");
  fs::create_directories(dir);
  std::ofstream(dir / "file") << "x";
  EXPECT_THROW(mt::SummaryWriter((dir / "file").string()), mt::Error);
  EXPECT_THROW(mt::SummaryWriter((dir / "file" / "below").string()), mt::Error);
  EXPECT_THROW(mt::SummaryWriter(dir.string(), {.fetch_every = 0}), mt::Error);
  mt::SummaryWriter writer(dir.string());
  EXPECT_THROW(writer.add_scalar("v", mt::Tensor()), mt::Error);
  EXPECT_THROW(writer.add_scalar("v", mt::zeros({2})), mt::Error);
  EXPECT_THROW(writer.log_gradient_health(mt::Linear(2, 2), 0), mt::Error);
  EXPECT_THROW(writer.add_text("notes", "\xff", 1), mt::Error);  // not UTF-8
  fs::remove_all(dir);
}

// A review's findings (session 38), each checked with TensorBoard's reader by the reviewer:
// - a tag that is not UTF-8 made TensorBoard stop reading the file (every later event lost);
// - host values were buffered until a later call, so an idle or killed run lost them;
// - a write that failed part way (a full disk) left a torn record, after which nothing written
//   later was read.
// A file size limit stands in for a full disk: the next event's write fails part way.
void fail_a_write_part_way(mt::SummaryWriter& writer) {
  struct rlimit before {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit tight = before;
  tight.rlim_cur = static_cast<rlim_t>(fs::file_size(writer.path()) + 20);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &tight), 0);
  EXPECT_THROW(writer.add_scalar("a tag long enough to need more than twenty bytes", 2.0, 2),
               mt::Error);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &before), 0);
  std::signal(SIGXFSZ, old_handler);
}

TEST(SummaryWriter, TagsAreUtf8HostValuesAreWrittenAtOnceAndAFailedWriteIsCutBack) {
  fs::path dir = fresh_dir("review");
  mt::SummaryWriter writer(dir.string());
  EXPECT_MT_ERROR(writer.add_scalar("caf\xe9", 1.0, 1), "not valid UTF-8");
  EXPECT_MT_ERROR(writer.add_scalar("\xed\xa0\x80", mt::scalar(1.0)), "not valid UTF-8");
  EXPECT_MT_ERROR(writer.add_histogram("x\xc0\x80", std::vector<double>{1.0}, 1), "UTF-8");
  writer.add_scalar("caf\xc3\xa9 \xf0\x9f\x98\x80", 1.0, 1);  // "café 😀"
  EXPECT_EQ(scalars_of(writer.path()).size(), 1u) << "in the file before any flush";

  fail_a_write_part_way(writer);
  writer.add_scalar("b", 3.0, 3);
  writer.add_scalar("b", 4.0, 4);
  using Row = std::tuple<std::string, int64_t, float>;
  EXPECT_EQ(scalars_of(writer.path()),
            (std::vector<Row>{
                {"caf\xc3\xa9 \xf0\x9f\x98\x80", 1, 1.0f}, {"b", 3, 3.0f}, {"b", 4, 4.0f}}));
  fs::remove_all(dir);
}

// A failed write that cannot be cut back (the file made append-only, so ftruncate fails) leaves a
// torn record that ends what a reader sees: every later write and flush is an error naming the
// file. They returned silently, as if this were a process without a file.
TEST(SummaryWriter, AWriteThatCannotBeCutBackFailsEveryLaterWrite) {
  fs::path dir = fresh_dir("torn");
  {
    mt::SummaryWriter writer(dir.string());
    writer.add_scalar("a", 1.0, 1);
    std::string quoted = "'" + writer.path() + "'";
    if (std::system(("chattr +a " + quoted + " 2> /dev/null").c_str()) != 0)
      GTEST_SKIP() << "chattr +a is not available here (root on ext4 or similar)";
    fail_a_write_part_way(writer);
    ASSERT_EQ(std::system(("chattr -a " + quoted).c_str()), 0);
    EXPECT_MT_ERROR(writer.add_scalar("b", 3.0, 3), writer.path(), "takes no more events");
    writer.add_scalar("c", mt::scalar(4.0));
    EXPECT_MT_ERROR(writer.flush(), writer.path(), "takes no more events");
    EXPECT_MT_ERROR(writer.flush(), writer.path(), "takes no more events");
  }
  fs::remove_all(dir);
}

// A compiled step that logged to a writer since destroyed traces again and logs to the writer in
// place then (a new run folder after a resume): its replays kept sending values to the old one,
// which dropped them.
TEST(SummaryWriter, ACompiledStepLogsToTheWriterThatReplacedItsOwn) {
  fs::path dir = fresh_dir("replaced");
  mt::manual_seed(2);
  mt::Linear net(3, 1);
  mt::SGD opt(net.parameters(), {.lr = 0.1});
  auto writer = std::make_unique<mt::SummaryWriter>((dir / "first").string());
  auto step_fn = mt::compile([&](const mt::Tensor& x) {
    opt.zero_grad();
    mt::Tensor loss = mt::mean(mt::square(net(x)));
    loss.backward();
    opt.step();
    writer->add_scalar("loss", loss);
    return std::vector<mt::Tensor>{loss};
  });
  mt::Tensor x = mt::ones({2, 3});
  std::vector<std::string> paths;
  std::vector<float> losses;
  for (int64_t step = 1; step <= 8; ++step) {
    if (step == 5) {
      writer->flush();
      paths.push_back(writer->path());
      writer = std::make_unique<mt::SummaryWriter>((dir / "second").string());
    }
    writer->set_step(step);
    losses.push_back(static_cast<float>(step_fn(x)[0].item()));
  }
  writer->flush();
  paths.push_back(writer->path());
  using Row = std::tuple<std::string, int64_t, float>;
  for (size_t run = 0; run < 2; ++run) {
    std::vector<Row> expected;
    for (int64_t step = 1 + 4 * static_cast<int64_t>(run);
         step <= 4 + 4 * static_cast<int64_t>(run); ++step)
      expected.emplace_back("loss", step, losses[static_cast<size_t>(step - 1)]);
    EXPECT_EQ(scalars_of(paths[run]), expected) << "run " << run;
  }
  fs::remove_all(dir);
}

// close() writes what is pending and closes the file: later logging is an mt::Error (nothing
// is silently dropped), a later flush, close or destruction does nothing, and a compiled step
// that logged to it is traced again (and then logs to nothing it can reach: an error).
TEST(SummaryWriter, CloseWritesEverythingAndRefusesLaterLogging) {
  fs::path dir = fresh_dir("close");
  mt::manual_seed(3);
  mt::Linear net(3, 1);
  mt::SGD opt(net.parameters(), {.lr = 0.1});
  mt::SummaryWriter writer(dir.string());
  auto step_fn = mt::compile([&](const mt::Tensor& x) {
    opt.zero_grad();
    mt::Tensor loss = mt::mean(mt::square(net(x)));
    loss.backward();
    opt.step();
    writer.add_scalar("loss", loss);
    return std::vector<mt::Tensor>{loss};
  });
  mt::Tensor x = mt::ones({2, 3});
  std::vector<float> losses;
  for (int64_t step = 1; step <= 3; ++step) {
    writer.set_step(step);
    losses.push_back(static_cast<float>(step_fn(x)[0].item()));
  }
  writer.add_scalar("host", 0.5, 3);
  writer.close();
  using Row = std::tuple<std::string, int64_t, float>;
  // Host values go into the file at once, the graph values at close's fetch.
  EXPECT_EQ(scalars_of(writer.path()), (std::vector<Row>{{"host", 3, 0.5f},
                                                         {"loss", 1, losses[0]},
                                                         {"loss", 2, losses[1]},
                                                         {"loss", 3, losses[2]}}));
  EXPECT_THROW(writer.add_scalar("host", 1.0, 4), mt::Error);
  EXPECT_THROW(writer.add_text("notes", "late", 4), mt::Error);
  EXPECT_THROW(writer.add_histogram("h", std::vector<double>{1.0}, 4), mt::Error);
  EXPECT_THROW(step_fn(x), mt::Error);  // traced again: its add_scalar refuses
  EXPECT_NO_THROW(writer.flush());
  EXPECT_NO_THROW(writer.close());
  EXPECT_EQ(scalars_of(writer.path()).size(), 4u);
  fs::remove_all(dir);
}

// A file of that name already there (a restarted container: same second, host name and pid)
// made the constructor throw. The next counter's name is taken instead.
TEST(SummaryWriter, ANameTakenAlreadyTakesTheNextOne) {
  fs::path dir = fresh_dir("taken");
  std::string first;
  { first = mt::SummaryWriter(dir.string()).path(); }
  // The next writer's name differs in the counter (and the second, if one has begun since):
  // occupy the next ten counters at this second and the next.
  // events.out.tfevents.<10-digit seconds>.<host>.<pid>.<counter>
  const std::string name = fs::path(first).filename().string();
  const size_t time_at = std::string("events.out.tfevents.").size();
  const int64_t seconds = std::stoll(name.substr(time_at, 10));
  const std::string host_pid = name.substr(time_at + 10, name.rfind('.') + 1 - (time_at + 10));
  const int64_t next = std::stoll(name.substr(name.rfind('.') + 1)) + 1;
  for (int64_t t = seconds; t <= seconds + 1; ++t)
    for (int64_t k = next; k < next + 10; ++k)
      std::ofstream(dir / fmt::format("events.out.tfevents.{:010d}{}{}", t, host_pid, k)) << "x";
  mt::SummaryWriter writer(dir.string());
  writer.add_scalar("v", 1.0, 1);
  EXPECT_EQ(scalars_of(writer.path()).size(), 1u);
  fs::remove_all(dir);
}

TEST(SummaryWriter, GraphValuesWaitAndAreFetchedInBatches) {
  fs::path dir = fresh_dir("batch");
  mt::SummaryWriter writer(dir.string(), {.fetch_every = 4});
  std::vector<float> expected;
  for (int64_t step = 1; step <= 5; ++step) {
    writer.set_step(step);
    mt::Tensor v = mt::scalar(1.0 / static_cast<double>(step)) * mt::scalar(3.0);
    expected.push_back(static_cast<float>(3.0f * static_cast<float>(1.0 / step)));
    writer.add_scalar("v", mt::reshape(v, {1}));  // one element of any shape
    // Steps 1..4 wait (a span of 3); set_step(5) is 4 past step 1 and fetches those four.
    EXPECT_EQ(scalars_of(writer.path()).size(), step < 5 ? 0u : 4u) << step;
  }
  writer.flush();
  std::vector<std::tuple<std::string, int64_t, float>> got = scalars_of(writer.path());
  ASSERT_EQ(got.size(), 5u);
  for (int64_t step = 1; step <= 5; ++step)
    EXPECT_EQ(got[step - 1], std::make_tuple(std::string("v"), step, expected[step - 1]));
  fs::remove_all(dir);
}

// A small MLP trained by a step compiled with mt::compile, logging through the writer.
TEST(SummaryWriter, CompiledStepValuesAreCapturedEveryCall) {
  fs::path dir = fresh_dir("compiled");
  mt::manual_seed(1);
  mt::MLP net({3, 4, 2});
  mt::SGD opt(net.parameters(), {.lr = 0.1});
  mt::GradScaler scaler({.init_scale = 1024});
  std::vector<double> losses, norms, scales;
  std::string path;
  {
    mt::SummaryWriter writer(dir.string(), {.fetch_every = 3});
    path = writer.path();
    auto step_fn = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
      opt.zero_grad();
      mt::Tensor loss = mt::mse_loss(net(x), y);
      scaler.scale(loss).backward();
      scaler.unscale_(opt);
      mt::Tensor norm = mt::grad_norm(net.parameters());
      scaler.step(opt);
      writer.add_scalar("loss", loss);
      writer.log_grad_norm(net.parameters());
      writer.log_scaler(scaler);
      writer.log_learning_rate(opt);
      scaler.update();
      return std::vector<mt::Tensor>{loss, norm};
    });
    mt::Tensor x = mt::tensor(std::vector<float>{0.5f, -1, 2, 1, 0, -0.5f}, {2, 3});
    mt::Tensor y = mt::tensor(std::vector<float>{1, 0, 0, 1}, {2, 2});
    for (int64_t step = 1; step <= 8; ++step) {
      writer.set_step(step);
      scales.push_back(scaler.get_scale());
      std::vector<mt::Tensor> out = step_fn(x, y);
      losses.push_back(out[0].item());
      norms.push_back(out[1].item());
    }
    // The reference executor traces every call; elsewhere the values come from replays.
    if (mt::current_device() != mt::Device::reference) {
      EXPECT_GT(step_fn.stats().replays, 0) << step_fn.stats().reason;
    }
  }
  std::map<std::string, std::vector<std::pair<int64_t, float>>> by_tag;
  for (const auto& [tag, step, value] : scalars_of(path)) by_tag[tag].emplace_back(step, value);
  ASSERT_EQ(by_tag["loss"].size(), 8u);
  ASSERT_EQ(by_tag["grad_norm"].size(), 8u);
  ASSERT_EQ(by_tag["loss_scale"].size(), 8u);
  ASSERT_EQ(by_tag["skipped"].size(), 8u);
  ASSERT_EQ(by_tag["lr"].size(), 8u);
  for (int64_t i = 0; i < 8; ++i) {
    EXPECT_EQ(by_tag["loss"][i], std::make_pair(i + 1, static_cast<float>(losses[i])));
    EXPECT_EQ(by_tag["grad_norm"][i], std::make_pair(i + 1, static_cast<float>(norms[i])));
    EXPECT_EQ(by_tag["loss_scale"][i], std::make_pair(i + 1, static_cast<float>(scales[i])));
    EXPECT_EQ(by_tag["skipped"][i], std::make_pair(i + 1, 0.0f));
    EXPECT_EQ(by_tag["lr"][i], std::make_pair(i + 1, 0.1f));
  }
  fs::remove_all(dir);
}

TEST(SummaryWriter, LogsSkippedStepsAndGradientHealth) {
  fs::path dir = fresh_dir("skips");
  mt::manual_seed(2);
  mt::MLP net({3, 4, 2});
  mt::SGD opt(net.parameters(), {.lr = 0.1});
  mt::GradScaler scaler({.init_scale = 8});
  std::string path;
  {
    mt::SummaryWriter writer(dir.string(), {.fetch_every = 100});
    path = writer.path();
    mt::Tensor x = mt::tensor(std::vector<float>{0.5f, -1, 2}, {1, 3});
    for (int64_t step = 1; step <= 3; ++step) {
      writer.set_step(step);
      opt.zero_grad();
      // Step 2's loss is inf: its gradients are non-finite and the scaler skips it.
      mt::Tensor loss = mt::sum(net(x)) * (step == 2 ? std::numeric_limits<double>::infinity() : 1);
      scaler.scale(loss).backward();
      scaler.step(opt);
      writer.log_scaler(scaler);
      writer.log_gradient_health(net, 3);
      scaler.update();
    }
  }
  std::map<std::string, std::vector<std::pair<int64_t, float>>> by_tag;
  for (const auto& [tag, step, value] : scalars_of(path)) by_tag[tag].emplace_back(step, value);
  using P = std::vector<std::pair<int64_t, float>>;
  EXPECT_EQ(by_tag["skipped"], (P{{1, 0.0f}, {2, 1.0f}, {3, 0.0f}}));
  EXPECT_EQ(by_tag["loss_scale"], (P{{1, 8.0f}, {2, 8.0f}, {3, 4.0f}}));
  // Health only at step 3, for every parameter and the total, against gradient_health itself.
  mt::GradientHealth health = mt::gradient_health(net);
  ASSERT_EQ(health.rows.size(), 4u);
  for (const mt::GradientHealthRow& row : health.rows) {
    EXPECT_EQ(by_tag["grad_amax/" + row.name], (P{{3, static_cast<float>(row.amax)}}));
    EXPECT_EQ(by_tag["grad_f16_underflow/" + row.name],
              (P{{3, static_cast<float>(row.f16_zero_fraction())}}));
  }
  // fc2's bias gradient is d sum / d b = 1 (unscaled): amax 1, nothing zero.
  EXPECT_EQ(by_tag["grad_amax/fc2.bias"], (P{{3, 1.0f}}));
  EXPECT_EQ(by_tag["grad_zero_fraction/fc2.bias"], (P{{3, 0.0f}}));
  EXPECT_EQ(by_tag["grad_amax/total"].size(), 1u);
  fs::remove_all(dir);
}

TEST(GradNorm, IsWhatClipGradNormClipsBy) {
  mt::manual_seed(3);
  mt::MLP net({3, 4, 2});
  mt::Tensor x = mt::tensor(std::vector<float>{0.5f, -1, 2}, {1, 3});
  mt::sum(net(x)).backward();
  double norm = mt::grad_norm(net.parameters()).item();
  double sum_squares = 0;
  for (const mt::Tensor& p : net.parameters())
    for (float g : p.grad().to_vector<float>()) sum_squares += double(g) * g;
  EXPECT_NEAR(norm, std::sqrt(sum_squares), 1e-6 * norm);
  EXPECT_EQ(mt::clip_grad_norm(net.parameters(), 1e9).item(), norm);
  EXPECT_EQ(mt::grad_norm({}).item(), 0.0);
}

// Why the reference readers cannot run here, or "": the venv tools/reference_venv.sh makes
// (PyPI's tensorboard and safetensors) and, `with_torch`, /usr/bin/python3's torch and PIL.
std::string reference_readers_missing(bool with_torch) {
  if (with_torch && std::system("/usr/bin/python3 -c 'import torch, PIL' 2>/dev/null") != 0)
    return "/usr/bin/python3 cannot import torch and PIL";
  const std::string source = MIXTAPE_SOURCE_DIR, binary = MIXTAPE_BINARY_DIR;
  if (std::system(
          (source + "/tools/reference_venv.sh " + binary + "/python-venv > /dev/null").c_str()) !=
      0)
    return "the reference venv could not be made (tools/reference_venv.sh said why above; it "
           "needs python3-venv and PyPI)";
  return "";
}

// Runs tests/<script> with `args` in /usr/bin/python3 (torch, PIL) with the reference venv's
// packages on its path too (tensorboard, safetensors); a failure unless it exits 0.
void run_with_torch_and_tensorboard(const std::string& script, const std::string& args) {
  const std::string source = MIXTAPE_SOURCE_DIR, binary = MIXTAPE_BINARY_DIR;
  const std::string command = "PYTHONPATH=$(echo " + binary +
                              "/python-venv/lib/python3*/site-packages) /usr/bin/python3 " +
                              source + "/tests/" + script + " " + args;
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

// Writes scalars (host values, graph values, extreme floats), a histogram and texts, then has
// TensorBoard's EventAccumulator read the folder: every (tag, step, f32 bits) must come back,
// and the texts as the text plugin's string tensors.
TEST(RoundTrip, TensorBoardReadsEveryScalarExactly) {
  std::string source = MIXTAPE_SOURCE_DIR, binary = MIXTAPE_BINARY_DIR;
  std::string venv_python = binary + "/python-venv/bin/python";
  if (std::string why = reference_readers_missing(false); !why.empty()) GTEST_SKIP() << why;
  fs::path dir = fresh_dir("roundtrip");
  std::vector<std::tuple<std::string, int64_t, float>> expected;
  {
    mt::SummaryWriter writer(dir.string(), {.fetch_every = 2});
    const float specials[] = {0.1f,
                              -0.0f,
                              1e-45f,
                              3.4028235e38f,
                              -1.17549435e-38f,
                              65504.0f,
                              std::numeric_limits<float>::infinity(),
                              1.0f / 3.0f};
    int64_t step = 0;
    for (float v : specials) {
      writer.add_scalar("special", v, step);
      expected.emplace_back("special", step, v);
      step += 7;
    }
    for (int64_t s = 0; s < 10; ++s) {
      writer.set_step(s * 100);
      mt::Tensor v = mt::exp(mt::scalar(-0.3 * static_cast<double>(s)));
      writer.add_scalar("train/graph", v);
      expected.emplace_back("train/graph", s * 100, static_cast<float>(v.item()));
      writer.add_scalar("train/host", static_cast<double>(s) * 0.01, s * 100 + 1);
      expected.emplace_back("train/host", s * 100 + 1, static_cast<float>(s * 0.01));
    }
    writer.add_histogram("weights", mt::tensor(std::vector<float>{-1, 0.5f, 0.5f, 2}, {4}), 5);
    writer.add_text("notes", "lr 3e-4, **bf16** \xc3\xa9t\xc3\xa9", 3);  // read back below
    writer.add_text("notes", "", 4);
  }
  std::ofstream list(dir / "expected.txt");
  for (const auto& [tag, step, value] : expected)
    list << tag << ' ' << step << ' ' << std::bit_cast<uint32_t>(value) << '\n';
  list.close();
  std::string command = venv_python + " " + source + "/tests/tensorboard_roundtrip.py " +
                        dir.string() + " " + (dir / "expected.txt").string();
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  fs::remove_all(dir);
}

// add_hparams: one run as torch's add_hparams writes it (TensorBoard's reader and the hparams
// plugin's protobufs compare the two), one of flags, one named by the time; and the refusals.
TEST(RoundTrip, HParamsAsTorchWritesThem) {
  if (std::string why = reference_readers_missing(true); !why.empty()) GTEST_SKIP() << why;
  fs::path dir = fresh_dir("hparams"), torch_dir = fresh_dir("hparams_torch");
  {
    mt::SummaryWriter writer(dir.string());
    writer.add_hparams({{"lr", 3e-4}, {"layers", 4}, {"policy", "autocast-bf16"}, {"zero", 0.0}},
                       {{"hparam/val_loss", 1.25}, {"hparam/accuracy", 0.5}},
                       {{"policy", {"fp32", "autocast-bf16"}}, {"layers", {2, 4, 8}}}, "compare");
    writer.add_hparams({{"shuffle", true}, {"ema", false}}, {{"loss", 2.0}}, {}, "flags");
    writer.add_hparams({{"seed", int64_t{7}}}, {});
    EXPECT_MT_ERROR(writer.add_hparams({{"lr", 1}, {"lr", 2}}, {}), "add_hparams",
                    "'lr' is given twice");
    EXPECT_MT_ERROR(writer.add_hparams({{"lr", 1}}, {}, {{"policy", {"fp32"}}}), "add_hparams",
                    "'policy', which is not a hyperparameter given");
    EXPECT_MT_ERROR(writer.add_hparams({{"lr", 1}}, {}, {{"lr", {"fast"}}}), "add_hparams",
                    "another type");
    EXPECT_MT_ERROR(writer.add_hparams({{"lr", 1}}, {}, {}, "../outside"), "add_hparams",
                    "'../outside' must be a folder inside the writer's");
    EXPECT_MT_ERROR(writer.add_hparams({{"lr", 1}}, {}, {}, "/tmp/outside"), "add_hparams",
                    "inside the writer's");
    EXPECT_MT_ERROR(writer.add_hparams({{"l\xffr", 1}}, {}), "add_hparams", "UTF-8");
    EXPECT_MT_ERROR(writer.add_hparams({{"lr", "\xc0"}}, {}), "add_hparams", "UTF-8");
    EXPECT_MT_ERROR(writer.add_hparams({{"lr", 1}}, {{"lo\xffss", 1}}), "add_hparams", "UTF-8");
    EXPECT_MT_ERROR(writer.add_hparams({{"lr", 1}}, {{"loss", 1}, {"loss", 2}}), "add_hparams",
                    "the metric 'loss' is given twice");
    EXPECT_MT_ERROR(writer.add_hparams({{"lr", 1}}, {}, {}, "run\xff"), "add_hparams",
                    "run's name is not valid UTF-8");
    EXPECT_MT_ERROR(writer.add_hparams({{"lr", 1}}, {}, {}, std::string("nu\0l", 4)), "add_hparams",
                    "NUL byte");
  }
  run_with_torch_and_tensorboard("tensorboard_hparams.py", dir.string() + " " + torch_dir.string());
  fs::remove_all(dir);
  fs::remove_all(torch_dir);
}

// add_image in every layout, channel count and dtype, with values outside [0, 1], NaN and the
// edges of each byte, and add_images' grids: TensorBoard reads the PNGs back, with torch's own
// image summary's pixels.
TEST(RoundTrip, ImagesAsTorchMakesThem) {
  if (std::string why = reference_readers_missing(true); !why.empty()) GTEST_SKIP() << why;
  fs::path dir = fresh_dir("images");
  mt::Generator gen(11);
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  // Every byte's edges: k / 255 and the floats just below and above it.
  std::vector<float> edges;
  for (int k = 0; k <= 255; ++k) {
    const float at = static_cast<float>(k) / 255.0f;
    edges.insert(edges.end(), {std::nextafter(at, -inf), at, std::nextafter(at, inf)});
  }
  edges.insert(edges.end(), {nan, inf, -inf, -0.0f, 1e30f, -1e-30f});
  const std::vector<std::tuple<std::string, mt::Tensor, std::string>> images = {
      {"rgb_chw", mt::rand({3, 5, 7}, mt::f32, &gen) * 1.4 - 0.2, "CHW"},
      {"gray_chw_f64", mt::rand({1, 4, 6}, mt::f64, &gen), "CHW"},
      {"rgba_hwc_bf16", mt::cast(mt::rand({5, 3, 4}, mt::f32, &gen), mt::bf16), "HWC"},
      {"gray_hwc", mt::rand({2, 9, 1}, mt::f32, &gen), "HWC"},
      {"edges_hw", mt::tensor(edges, {static_cast<int64_t>(edges.size()) / 6, 6}), "HW"},
      {"rgb_hwc_f16", mt::cast(mt::rand({1, 1, 3}, mt::f32, &gen), mt::f16), "HWC"},
      // add_images: one row of five, two rows of eight and three, RGBA with empty cells.
      {"batch_nchw", mt::rand({5, 3, 4, 6}, mt::f32, &gen), "NCHW"},
      {"batch_nhwc_gray", mt::rand({11, 3, 2, 1}, mt::f32, &gen), "NHWC"},
      {"batch_rgba", mt::rand({9, 4, 2, 3}, mt::f32, &gen) * 1.2, "NCHW"}};
  mt::NamedTensors saved;
  nlohmann::json formats = nlohmann::json::object();
  {
    mt::SummaryWriter writer(dir.string());
    for (const auto& [tag, image, layout] : images) {
      if (layout.size() == 4)
        writer.add_images(tag, image, 3, layout);
      else
        writer.add_image(tag, image, 3, layout);
      saved.emplace_back(tag, image);
      formats[tag] = layout;
    }
    EXPECT_MT_ERROR(writer.add_images("none", mt::zeros({0, 3, 4, 4}), 0), "add_images",
                    "no images", "[0, 3, 4, 4]");
    EXPECT_MT_ERROR(writer.add_images("chw", mt::zeros({3, 4, 4}), 0, "CHW"), "add_images",
                    "dataformats must be \"NCHW\" or \"NHWC\"");
    EXPECT_MT_ERROR(writer.add_images("wide", mt::zeros({9, 1, 1, 500'000}), 0), "add_images",
                    "height and width must be in [1, 1000000]");
    mt::Tensor two = mt::zeros({2, 4, 4});
    EXPECT_MT_ERROR(writer.add_image("two", two, 0), "add_image", "1, 3 or 4 channels",
                    "[2, 4, 4]");
    EXPECT_MT_ERROR(writer.add_image("hw", mt::zeros({4, 4}), 0), "add_image",
                    "laid out CHW has 3 axes", "[4, 4]");
    EXPECT_MT_ERROR(writer.add_image("nchw", mt::zeros({1, 3, 4, 4}), 0, "NCHW"), "add_image",
                    "dataformats must be");
    EXPECT_MT_ERROR(writer.add_image("empty", mt::zeros({3, 0, 4}), 0), "add_image",
                    "height and width must be in [1, 1000000]", "[3, 0, 4]");
    EXPECT_MT_ERROR(writer.add_image("none", mt::Tensor(), 0), "add_image", "undefined");
  }
  fs::path file = dir / "images.safetensors";
  mt::save_tensors(file.string(), saved, {{"dataformats", formats.dump()}});
  run_with_torch_and_tensorboard("tensorboard_images.py", dir.string() + " " + file.string());
  fs::remove_all(dir);
}

TEST(PrecisionSummary, TalliesModulesAndPairs) {
  mt::PrecisionReport report;
  auto row = [](std::string module, mt::DType storage, mt::DType compute, bool backward) {
    return mt::PrecisionRow{0,       "add",   std::move(module), {},       storage,
                            storage, compute, compute,           backward, "rule"};
  };
  report.rows = {
      row("fc1", mt::f32, mt::f32, false),  row("fc1", mt::bf16, mt::f32, false),
      row("", mt::f32, mt::f32, false),     row("fc1", mt::bf16, mt::f32, true),
      row("fc1", mt::f32, mt::f32, true),   row("blocks.0.attention", mt::bf16, mt::f32, true),
      row("fc1", mt::bf16, mt::f32, false), row("", mt::f32, mt::f32, true)};
  EXPECT_EQ(report.summary(),
            "module              storage compute  forward backward\n"
            "fc1                 f32     f32            1        1\n"
            "fc1                 bf16    f32            2        1\n"
            "-                   f32     f32            1        1\n"
            "blocks.0.attention  bf16    f32            0        1\n"
            "(all)               f32     f32            2        2\n"
            "(all)               bf16    f32            2        2\n");
}

TEST(PrecisionSummary, CountsEveryNodeOfARealReport) {
  mt::manual_seed(4);
  mt::MLP net({3, 4, 2});
  mt::Tensor loss;
  {
    mt::autocast guard(mt::bf16);
    loss = mt::sum(net(mt::ones({2, 3})));
  }
  loss.backward();
  std::vector<mt::Tensor> outputs{loss};
  for (const mt::Tensor& p : net.parameters()) outputs.push_back(p.grad());
  mt::PrecisionReport report = mt::precision_report(outputs);
  // The "(all)" lines' counts, parsed back, are the rows' counts per pair and pass.
  std::map<std::tuple<std::string, std::string, bool>, int64_t> expected, got;
  for (const mt::PrecisionRow& r : report.rows)
    ++expected[std::make_tuple(std::string(mt::name(r.storage)), std::string(mt::name(r.compute)),
                               r.backward)];
  std::istringstream lines(report.summary());
  std::string line;
  int64_t module_total = 0, all_total = 0;
  std::getline(lines, line);  // the header
  while (std::getline(lines, line)) {
    std::istringstream fields_of(line);
    std::string module, storage, compute;
    int64_t forward = 0, backward = 0;
    fields_of >> module >> storage >> compute >> forward >> backward;
    if (module == "(all)") {
      got[{storage, compute, false}] += forward;
      got[{storage, compute, true}] += backward;
      all_total += forward + backward;
    } else {
      module_total += forward + backward;
    }
  }
  std::erase_if(got, [](const auto& entry) { return entry.second == 0; });
  EXPECT_EQ(got, expected);
  EXPECT_EQ(module_total, static_cast<int64_t>(report.rows.size()));
  EXPECT_EQ(all_total, module_total);
  EXPECT_NE(report.summary().find("\nfc1 "), std::string::npos);
}

}  // namespace
