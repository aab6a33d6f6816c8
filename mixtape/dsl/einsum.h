// mixtape/dsl/einsum.h -- torch.einsum as DSL code over permute, reshape, matmul, multiply and sum.
#pragma once

#include <string>
#include <vector>

#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// torch.einsum(equation, operands): subscripts a-z and A-Z, "..." for broadcast dimensions
/// (aligned from the right, as PyTorch and numpy do), an optional "->" output (without it: the
/// broadcast dimensions, then every letter used once, in alphabetical order, upper case first),
/// a letter repeated within one operand taking its diagonal, and size-1 dimensions broadcast
/// against a letter's other sizes. Spaces are ignored. Operands are contracted left to right,
/// each pair by one batched matmul (or a broadcast multiply when nothing is summed between
/// them), after summing every letter no later operand and no output uses. A malformed equation,
/// an operand count or rank it does not fit, or sizes that disagree are an mt::Error naming the
/// equation. Under autocast it runs in the half type with f32 accumulation, as linear does.
Tensor einsum(const std::string& equation, const std::vector<Tensor>& operands,
              const Loc& loc = Loc::current());

}  // namespace mixtape
