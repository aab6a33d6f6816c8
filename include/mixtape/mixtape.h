// include/mixtape/mixtape.h -- the umbrella header: everything a mixtape user needs.
#pragma once

#include "autograd/grad.h"
#include "dsl/data.h"
#include "dsl/dtype.h"
#include "dsl/error.h"
#include "dsl/functional.h"
#include "dsl/module.h"
#include "dsl/nn.h"
#include "dsl/ops.h"
#include "dsl/optim.h"
#include "dsl/tensor.h"
#include "runtime/checkpoint.h"
#include "precision_policy/policy.h"
#include "precision_policy/report.h"
