// mixtape/runtime/attention.h -- CPU fused attention (the Attention and AttentionBackward
// primitives): flash-attention tiles with an online softmax in f32, never the [Tq, Tk] scores.
#pragma once

#include "mixtape/dsl/node.h"

namespace mixtape {

/// True when attention_cpu computes `node`: f32, bf16 or f16 operands computed in f32, or f64
/// ones in f64; otherwise the reference loops do.
bool attention_cpu_supported(const Node& node);

/// Computes an Attention or AttentionBackward node from its inputs' values into `out` (the
/// node's storage type and size). Query tiles of 64 rows meet key tiles sized so that a backward
/// step's four key-side tiles fill half the L2 cache; scores, weights and sums are f32 (f64 for
/// f64), inputs converted (and rounded to the compute type) as their tiles load. The backward
/// pass recomputes each row's log-sum-exp over the keys, then accumulates dK and dV per (batch,
/// head) in f32. Threads: OpenMP over (batch, query tile) forward, over the batch backward.
void attention_cpu(const Node& node, Storage& out);

/// Whether attention_cpu's f32 loops run 16 lanes wide where the CPU has AVX-512 (else 8 with
/// AVX2 and FMA): on, and settable for the test that compares the widths' bits.
bool attention_avx512();
void set_attention_avx512(bool enabled);

}  // namespace mixtape
