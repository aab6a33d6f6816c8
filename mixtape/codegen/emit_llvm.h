// mixtape/codegen/emit_llvm.h -- prints a kernel as LLVM 16 IR text for the CPU back end.
#pragma once

#include <string>

#include "mixtape/codegen/kernel_ir.h"

namespace mixtape {

/// One module defining `void @<kernel.name>(ptr params, i64 begin, i64 end)`: params points to
/// one buffer pointer per kernel parameter; [begin, end) is a range of the kernel's flattened
/// parallel dims (kir::Kernel::parallel_dims). f32 exp, tanh and erf arrive as arithmetic
/// (dsl/scalar_math.h), other math calls go to the C library (logf, ...), so results equal the
/// reference executor's bit for bit.
std::string emit_llvm(const kir::Kernel& kernel);

}  // namespace mixtape
