// mixtape/dsl/operand_checks.h -- the checks ops make of their tensor operands, each failure an
// mt::Error naming the op and the operand's role.
#pragma once

#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// "<op>: the <role> is an undefined tensor" unless t is defined.
void require(const Tensor& t, const char* op, const char* role, const Loc& loc);
/// As require, and "<op>: the <role> must be floating-point" unless it is.
void require_float(const Tensor& t, const char* op, const char* role, const Loc& loc);

}  // namespace mixtape
