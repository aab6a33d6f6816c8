// mixtape/codegen/emit_llvm.h -- prints a kernel as LLVM 16 IR text for the CPU back end.
#pragma once

#include <cstdint>
#include <string>

#include "mixtape/codegen/kernel_ir.h"

namespace mixtape {

/// One module defining `void @<kernel.name>(ptr params, i64 begin, i64 end)`: params points to
/// one buffer pointer per kernel parameter; [begin, end) is a range of the kernel's flattened
/// parallel dims (kir::Kernel::parallel_dims). f32 exp, tanh and erf arrive as arithmetic
/// (dsl/scalar_math.h), other math calls go to the C library (logf, ...), so results equal the
/// reference executor's bit for bit.
std::string emit_llvm(const kir::Kernel& kernel);

/// A long fast f32 sum is added in blocks: at most this many terms per chain (a vector lane, or
/// a column's accumulator) in f32, each block's partial sums then added into an f64 total that
/// rounds to f32 once, so its error does not grow with the count (emit_llvm.cpp, "Blocked sums").
inline constexpr int64_t sum_chain_terms = 64;

}  // namespace mixtape
