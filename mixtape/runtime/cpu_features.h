// mixtape/runtime/cpu_features.h -- which x86 instruction-set extensions this CPU has, by the names
// LLVM gives them.
#pragma once

#include <string>
#include <vector>

namespace mixtape {

/// The features of a fixed table that this CPU (and its operating system, for the AVX and AMX
/// register states) supports, in the table's order. The table holds the x86 extensions LLVM may
/// use when it compiles for the host CPU (sse4.2, avx, avx2, fma, f16c, bmi2, avx512f, ...,
/// avx512fp16, amx-bf16), named as LLVM and GCC name them. An artifact records the exporting
/// host's list, and opening it on a CPU that lacks one of them is refused with a clear error
/// instead of an illegal-instruction crash inside a kernel. On other architectures the list is
/// empty: nothing is recorded and nothing is checked.
std::vector<std::string> host_cpu_features();

/// Every feature of the table, whether this CPU has it or not.
std::vector<std::string> known_cpu_features();

/// The features of `required` that this CPU lacks, in the order given. A name outside the table
/// (written by a newer mixtape, say) counts as missing: this build cannot tell whether the CPU
/// has it, and a kernel that uses it would crash.
std::vector<std::string> missing_cpu_features(const std::vector<std::string>& required);

/// Whether code compiled for x86-64-v4 (AVX-512 F, BW, CD, DQ and VL on 512-bit vectors) runs
/// here, the OS saving the AVX-512 register state: the level the library's hand-vectorized loops
/// are compiled for beside the baseline. Checked once.
bool cpu_runs_x86_64_v4();

}  // namespace mixtape
