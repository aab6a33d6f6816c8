// mixtape/summary/png.cpp -- 8-bit images as PNG bytes, through libpng's simplified write API.
#include "mixtape/summary/png.h"

#include <png.h>

#include "mixtape/dsl/error.h"

namespace mixtape {

std::string encode_png(const std::vector<uint8_t>& pixels, int64_t height, int64_t width,
                       int64_t channels, const char* who) {
  if (channels != 1 && channels != 3 && channels != 4)
    fail("{}: an image has 1, 3 or 4 channels, got {}", who, channels);
  if (height < 1 || width < 1 || height > kMaxPngSide || width > kMaxPngSide)
    fail("{}: an image's height and width must be in [1, {}], got {} x {}", who, kMaxPngSide,
         height, width);
  if (static_cast<int64_t>(pixels.size()) != height * width * channels)
    fail("{}: {} bytes for a {} x {} x {} image", who, pixels.size(), height, width, channels);
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(width);
  image.height = static_cast<png_uint_32>(height);
  image.format = channels == 4 ? PNG_FORMAT_RGBA : channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
  png_alloc_size_t size = 0;
  // A first call sizes the file, a second writes it.
  if (!png_image_write_to_memory(&image, nullptr, &size, 0, pixels.data(), 0, nullptr))
    fail("{}: libpng could not encode the image: {}", who, image.message);
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&image, out.data(), &size, 0, pixels.data(), 0, nullptr))
    fail("{}: libpng could not encode the image: {}", who, image.message);
  out.resize(size);
  return out;
}

}  // namespace mixtape
