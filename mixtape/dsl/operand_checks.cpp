// mixtape/dsl/operand_checks.cpp -- the checks ops make of their tensor operands.
#include "mixtape/dsl/operand_checks.h"

#include "mixtape/dsl/error.h"

namespace mixtape {

void require(const Tensor& t, const char* op, const char* role, const Loc& loc) {
  if (!t.defined()) op_fail(op, loc, "the {} is an undefined tensor", role);
}

void require_float(const Tensor& t, const char* op, const char* role, const Loc& loc) {
  require(t, op, role, loc);
  if (!is_floating(t.dtype()))
    op_fail(op, loc, "the {} must be floating-point, got {}", role, name(t.dtype()));
}

}  // namespace mixtape
