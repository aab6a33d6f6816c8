// mixtape/summary/png.h -- 8-bit images as PNG bytes (libpng), for TensorBoard's image summaries.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mixtape {

/// The largest height or width encode_png takes: libpng's readers refuse larger ones by default.
inline constexpr int64_t kMaxPngSide = 1'000'000;

/// `pixels`: height x width x channels bytes, row-major (channels 1: gray, 3: RGB, 4: RGBA).
/// The PNG file's bytes; an mt::Error naming `who` for another channel count, an empty or too
/// large image, or what libpng reports.
std::string encode_png(const std::vector<uint8_t>& pixels, int64_t height, int64_t width,
                       int64_t channels, const char* who);

}  // namespace mixtape
