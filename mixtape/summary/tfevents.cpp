// mixtape/summary/tfevents.cpp -- the protobuf wire encoding of TensorBoard's Event and the record
// frame.
#include "mixtape/summary/tfevents.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>

#include "mixtape/dsl/error.h"

namespace mixtape::tfevents {

static_assert(std::endian::native == std::endian::little,
              "the record frame and protobuf fixed fields are little-endian");

uint32_t crc32c(const void* data, size_t size) {
  // ISA-L's crc32_iscsi takes an int length and leaves out the initial and final inversion.
  uint32_t crc = 0xffffffffu;
  const auto* bytes = static_cast<const unsigned char*>(data);
  while (size > 0) {
    int chunk = static_cast<int>(std::min<size_t>(size, 1u << 30));
    crc = crc32_iscsi(const_cast<unsigned char*>(bytes), chunk, crc);
    bytes += chunk;
    size -= static_cast<size_t>(chunk);
  }
  return crc ^ 0xffffffffu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

namespace {

template <typename T>
void put_fixed(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

// The protobuf wire format (protobuf.dev/programming-guides/encoding): tag = field << 3 | type.
class ProtoWriter {
 public:
  void varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<char>(v));
  }
  void key(int field, int wire_type) { varint(static_cast<uint64_t>(field) << 3 | wire_type); }
  void int64_field(int field, int64_t v) {
    key(field, 0);
    varint(static_cast<uint64_t>(v));  // negative int64s take ten bytes, as protobuf's do
  }
  void double_field(int field, double v) {
    key(field, 1);
    put_fixed(out_, v);
  }
  void float_field(int field, float v) {
    key(field, 5);
    put_fixed(out_, v);
  }
  void bytes_field(int field, const std::string& v) {
    key(field, 2);
    varint(v.size());
    out_ += v;
  }
  void packed_doubles(int field, const std::vector<double>& v) {
    std::string body;
    for (double d : v) put_fixed(body, d);
    bytes_field(field, body);
  }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

std::string encode_histogram(const Histogram& h) {
  ProtoWriter w;
  w.double_field(1, h.min);
  w.double_field(2, h.max);
  w.double_field(3, h.num);
  w.double_field(4, h.sum);
  w.double_field(5, h.sum_squares);
  w.packed_doubles(6, h.bucket_limit);
  w.packed_doubles(7, h.bucket);
  return std::move(w.str());
}

std::string encode_value(const Value& v) {
  ProtoWriter w;
  w.bytes_field(1, v.tag);
  if (v.simple_value) w.float_field(2, *v.simple_value);
  if (v.image) {
    // Summary.Value.image (4): Summary.Image of height (1), width (2), colorspace (3) and
    // encoded_image_string (4).
    ProtoWriter image;
    image.int64_field(1, v.image->height);
    image.int64_field(2, v.image->width);
    image.int64_field(3, v.image->colorspace);
    image.bytes_field(4, v.image->encoded);
    w.bytes_field(4, image.str());
  }
  if (v.histo) w.bytes_field(5, encode_histogram(*v.histo));  // Summary.Value.histo is field 5
  if (v.text) {
    // Summary.Value.tensor (8): a TensorProto of dtype DT_STRING (1: 7), shape [1] (2: a
    // TensorShapeProto whose dim (2) has size (1) 1) and the text as its string_val (8).
    ProtoWriter dim, shape, tensor;
    dim.int64_field(1, 1);
    shape.bytes_field(2, dim.str());
    tensor.int64_field(1, 7);
    tensor.bytes_field(2, shape.str());
    tensor.bytes_field(8, *v.text);
    w.bytes_field(8, tensor.str());
  }
  // Summary.Value.metadata (9): SummaryMetadata.plugin_data (1), a PluginData naming (1) the
  // plugin, with its content (2). The text plugin's content, TextPluginData at version 0,
  // encodes to no bytes.
  std::optional<PluginData> plugin = v.text ? PluginData{"text", ""} : v.plugin;
  if (plugin) {
    ProtoWriter data, metadata;
    data.bytes_field(1, plugin->name);
    if (!plugin->content.empty()) data.bytes_field(2, plugin->content);
    metadata.bytes_field(1, data.str());
    w.bytes_field(9, metadata.str());
  }
  return std::move(w.str());
}

// A google.protobuf.Value: number_value (2), string_value (3) or bool_value (4), members of a
// oneof, so written even when zero.
std::string encode_hparam_value(const HParamValue& value) {
  ProtoWriter w;
  if (const double* number = std::get_if<double>(&value)) w.double_field(2, *number);
  if (const std::string* text = std::get_if<std::string>(&value)) w.bytes_field(3, *text);
  if (const bool* flag = std::get_if<bool>(&value)) w.int64_field(4, *flag ? 1 : 0);
  return std::move(w.str());
}

// HParamsPluginData (version 0, the default, so no bytes) holding `data` in field `field`: the
// experiment (2), the session's start (3) or its end (4).
Value hparams_value(const char* tag, int field, const std::string& data) {
  ProtoWriter w;
  w.bytes_field(field, data);
  return {.tag = tag, .plugin = PluginData{"hparams", std::move(w.str())}};
}

// TensorFlow's default edges (tensorflow/core/lib/histogram/histogram.cc): 1e-12 * 1.1^k up to
// 1e20, mirrored for negative values, with DBL_MAX closing both ends.
const std::vector<double>& default_edges() {
  static const std::vector<double> edges = [] {
    std::vector<double> positive;
    for (double v = 1e-12; v < 1e20; v *= 1.1) positive.push_back(v);
    positive.push_back(DBL_MAX);
    std::vector<double> all;
    for (auto it = positive.rbegin(); it != positive.rend(); ++it) all.push_back(-*it);
    all.push_back(0.0);
    all.insert(all.end(), positive.begin(), positive.end());
    return all;
  }();
  return edges;
}

}  // namespace

std::string frame_record(const std::string& data) {
  std::string out;
  uint64_t length = data.size();
  put_fixed(out, length);
  put_fixed(out, masked_crc32c(&length, sizeof length));
  out += data;
  put_fixed(out, masked_crc32c(data.data(), data.size()));
  return out;
}

Histogram make_histogram(const std::vector<double>& values) {
  Histogram h;
  const std::vector<double>& edges = default_edges();
  std::vector<double> counts(edges.size(), 0.0);
  h.min = std::numeric_limits<double>::infinity();
  h.max = -h.min;
  for (double v : values) {
    if (!std::isfinite(v)) fail("add_histogram: the values hold a non-finite value ({})", v);
    h.min = std::min(h.min, v);
    h.max = std::max(h.max, v);
    h.num += 1;
    h.sum += v;
    h.sum_squares += v * v;
    // The bucket whose right edge is the first edge above v, as TensorFlow's Histogram::Add.
    size_t b = static_cast<size_t>(std::upper_bound(edges.begin(), edges.end(), v) - edges.begin());
    counts[std::min(b, edges.size() - 1)] += 1;
  }
  if (values.empty()) h.min = h.max = 0;
  for (size_t i = 0; i < edges.size(); ++i) {
    if (counts[i] == 0) continue;
    // An empty bucket before a full one keeps its edge, so the full one's left edge is known.
    if (i > 0 && (h.bucket.empty() || h.bucket_limit.back() != edges[i - 1]) &&
        counts[i - 1] == 0) {
      h.bucket_limit.push_back(edges[i - 1]);
      h.bucket.push_back(0);
    }
    h.bucket_limit.push_back(edges[i]);
    h.bucket.push_back(counts[i]);
  }
  return h;
}

void check_tag(std::string_view tag, const char* who) { check_utf8(tag, who, "tag"); }

void check_utf8(std::string_view tag, const char* who, const char* what) {
  // UTF-8 as RFC 3629 defines it: no overlong forms, no surrogates, nothing past U+10FFFF.
  for (size_t i = 0; i < tag.size();) {
    const auto byte = [&](size_t k) { return static_cast<unsigned char>(tag[k]); };
    const unsigned char lead = byte(i);
    size_t length = lead < 0x80           ? 1
                    : (lead >> 5) == 0x6  ? 2
                    : (lead >> 4) == 0xe  ? 3
                    : (lead >> 3) == 0x1e ? 4
                                          : 0;
    bool valid = length > 0 && i + length <= tag.size() && (length != 2 || lead >= 0xc2) &&
                 (length != 4 || lead <= 0xf4);
    for (size_t k = 1; valid && k < length; ++k) valid = (byte(i + k) & 0xc0) == 0x80;
    if (valid && length == 3)
      valid = !(lead == 0xe0 && byte(i + 1) < 0xa0) && !(lead == 0xed && byte(i + 1) >= 0xa0);
    if (valid && length == 4)
      valid = !(lead == 0xf0 && byte(i + 1) < 0x90) && !(lead == 0xf4 && byte(i + 1) >= 0x90);
    if (!valid)
      fail(
          "{}: the {} is not valid UTF-8 (byte {} of it, 0x{:02x}); TensorBoard would stop "
          "reading the file there",
          who, what, i, lead);
    i += length;
  }
}

std::vector<Value> hparams_values(const HParamsRun& run) {
  // Experiment: hparam_infos (4), each a HParamInfo of name (1), type (4: DATA_TYPE_FLOAT64 3,
  // STRING 1, BOOL 2) and domain_discrete (5, a ListValue of values (1)); metric_infos (5), each
  // a MetricInfo whose name (1) is a MetricName of tag (2).
  ProtoWriter experiment;
  for (const auto& [name, value] : run.hparams) {
    ProtoWriter info;
    info.bytes_field(1, name);
    info.int64_field(4, std::holds_alternative<double>(value)        ? 3
                        : std::holds_alternative<std::string>(value) ? 1
                                                                     : 2);
    for (const auto& [domain_name, values] : run.domains) {
      if (domain_name != name) continue;
      ProtoWriter list;
      for (const HParamValue& v : values) list.bytes_field(1, encode_hparam_value(v));
      info.bytes_field(5, list.str());
    }
    experiment.bytes_field(4, info.str());
  }
  for (const std::string& tag : run.metrics) {
    ProtoWriter metric_name, info;
    metric_name.bytes_field(2, tag);
    info.bytes_field(1, metric_name.str());
    experiment.bytes_field(5, info.str());
  }
  // SessionStartInfo: hparams (1), a map whose entries hold key (1) and value (2).
  ProtoWriter start;
  for (const auto& [name, value] : run.hparams) {
    ProtoWriter entry;
    entry.bytes_field(1, name);
    entry.bytes_field(2, encode_hparam_value(value));
    start.bytes_field(1, entry.str());
  }
  // SessionEndInfo: status (1) STATUS_SUCCESS (1).
  ProtoWriter end;
  end.int64_field(1, 1);
  return {hparams_value("_hparams_/experiment", 2, experiment.str()),
          hparams_value("_hparams_/session_start_info", 3, start.str()),
          hparams_value("_hparams_/session_end_info", 4, end.str())};
}

std::string encode_event(double wall_time, int64_t step, const std::string& file_version,
                         const std::vector<Value>& values) {
  ProtoWriter w;
  w.double_field(1, wall_time);
  w.int64_field(2, step);
  if (!file_version.empty()) {
    w.bytes_field(3, file_version);
  } else {
    ProtoWriter summary;
    for (const Value& v : values) summary.bytes_field(1, encode_value(v));
    w.bytes_field(5, summary.str());
  }
  return std::move(w.str());
}

}  // namespace mixtape::tfevents
