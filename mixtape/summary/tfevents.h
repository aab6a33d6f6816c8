// mixtape/summary/tfevents.h -- TensorBoard's event file format, encoded by hand: CRC32C-framed
// records holding Event protobufs with scalar, histogram, image, text and hparams summaries.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace mixtape::tfevents {

/// CRC32C (Castagnoli, iSCSI's CRC of RFC 3720), computed by ISA-L.
uint32_t crc32c(const void* data, size_t size);
/// TensorFlow's masked CRC (tensorflow/core/lib/hash/crc32c.h): rotate right by 15, add a
/// constant, so that a CRC stored inside CRC'd data does not weaken the check.
uint32_t masked_crc32c(const void* data, size_t size);

/// One record of a TFRecord file: uint64 length (little-endian), masked CRC of those 8 bytes,
/// the data, masked CRC of the data.
std::string frame_record(const std::string& data);

/// TensorFlow's HistogramProto (tensorflow/core/framework/summary.proto).
struct Histogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit;  // the right edge of each bucket
  std::vector<double> bucket;        // the count in each bucket
};
/// A histogram of `values` over TensorFlow's default buckets (edges +-1e-12 * 1.1^k and
/// +-DBL_MAX), with only the non-empty buckets (and the edges before them) kept, as TensorBoard
/// writes them. mt::Error for a non-finite value.
Histogram make_histogram(const std::vector<double>& values);

/// SummaryMetadata.PluginData: the plugin that reads a value, and what it needs besides.
struct PluginData {
  std::string name;
  std::string content;  // the plugin's own protobuf, serialized
};

/// Summary.Image: an encoded image (PNG) and its height, width and channel count.
struct Image {
  int64_t height = 0, width = 0, colorspace = 0;
  std::string encoded;
};

/// What one Summary.Value holds: a float scalar, a histogram, an image, a text (a string tensor of
/// one element with the text plugin's metadata, as torch's add_text writes it), or only a plugin's
/// metadata (the hparams plugin's summaries).
struct Value {
  std::string tag;
  std::optional<float> simple_value{};
  std::optional<Histogram> histo{};
  std::optional<Image> image{};
  std::optional<std::string> text{};
  std::optional<PluginData> plugin{};
};

/// A hyperparameter's value as the hparams plugin holds it (a google.protobuf.Value).
using HParamValue = std::variant<double, std::string, bool>;
/// One run's hyperparameters and the tags of its metrics, for hparams_values.
struct HParamsRun {
  std::vector<std::pair<std::string, HParamValue>> hparams;
  /// The values a hyperparameter takes in the sweep, by its name (HParamInfo.domain_discrete).
  std::vector<std::pair<std::string, std::vector<HParamValue>>> domains;
  std::vector<std::string> metrics;
};
/// The hparams plugin's three summaries of a run, as torch.utils.tensorboard's hparams() makes
/// them: HParamsPluginData (version 0) holding the experiment (each hyperparameter's name, type
/// and domain, each metric's tag), the session's start (the values) and its end
/// (STATUS_SUCCESS), tagged "_hparams_/experiment", "_hparams_/session_start_info" and
/// "_hparams_/session_end_info". One difference: a flag is a bool (DATA_TYPE_BOOL), where
/// torch's hparams() takes Python's True for the number 1.
std::vector<Value> hparams_values(const HParamsRun& run);

/// An Event protobuf: wall_time (1), step (2), and file_version (3) when given, else a Summary
/// (5) with the values.
/// mt::Error naming `who` unless `tag` is valid UTF-8: a Summary's tag is a protobuf string,
/// and TensorBoard's reader stops at the first event whose tag is not (dropping the rest of the
/// file). Checked by hand (a dozen lines) rather than through a Unicode library for one check.
void check_tag(std::string_view tag, const char* who);
/// The same check of any protobuf string (`what` names it in the message: "text").
void check_utf8(std::string_view text, const char* who, const char* what);

std::string encode_event(double wall_time, int64_t step, const std::string& file_version,
                         const std::vector<Value>& values);

}  // namespace mixtape::tfevents
