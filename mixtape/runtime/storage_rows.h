// mixtape/runtime/storage_rows.h -- a run of an f32, bf16 or f16 value's elements widened to f32
// or narrowed from it (runtime/half_convert's loops): what the CPU loops of pooling and attention
// read and write.
#pragma once

#include <cstdint>

#include "mixtape/dsl/node.h"

namespace mixtape {

/// Elements [at, at + count) of `s` (f32, bf16 or f16) as f32 into `out`.
void widen_row(const Storage& s, int64_t at, float* out, int64_t count);
/// `count` f32 values rounded to `s`'s type (f32, bf16 or f16) into its elements from `at`.
void narrow_row(const float* in, Storage& s, int64_t at, int64_t count);

}  // namespace mixtape
