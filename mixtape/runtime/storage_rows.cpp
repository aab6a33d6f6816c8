// mixtape/runtime/storage_rows.cpp -- runs of f32 / bf16 / f16 elements to and from f32.
#include "mixtape/runtime/storage_rows.h"

#include <cstring>

#include "mixtape/runtime/half_convert.h"

namespace mixtape {

void widen_row(const Storage& s, int64_t at, float* out, int64_t count) {
  if (count == 0) return;
  if (s.dtype == f32)
    std::memcpy(out, s.as<float>() + at, static_cast<size_t>(count) * sizeof(float));
  else if (s.dtype == bf16)
    widen_bf16(s.as<uint16_t>() + at, out, count);
  else
    widen_f16(s.as<uint16_t>() + at, out, count);
}

void narrow_row(const float* in, Storage& s, int64_t at, int64_t count) {
  if (count == 0) return;
  if (s.dtype == f32)
    std::memcpy(s.as<float>() + at, in, static_cast<size_t>(count) * sizeof(float));
  else if (s.dtype == bf16)
    narrow_to_bf16(in, s.as<uint16_t>() + at, count);
  else
    narrow_to_f16(in, s.as<uint16_t>() + at, count);
}

}  // namespace mixtape
