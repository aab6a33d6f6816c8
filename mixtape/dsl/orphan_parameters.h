// mixtape/dsl/orphan_parameters.h -- one warning for a module parameter that gets gradients but
// that no optimizer updates (typically a submodule that was never register_module'd).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// Module::register_parameter: `param` (a leaf that requires grad) is a parameter named `name`.
void note_module_parameter(const Tensor& param, const std::string& name);
/// Whether `t` is a parameter some module registered (frozen ones too), as torch's Parameter.
bool is_module_parameter(const Tensor& t);
/// An optimizer holds (add) or no longer holds (!add) these parameters.
void note_optimizer_parameters(const std::vector<Tensor>& params, bool add);
/// backward(): `leaf` received a gradient.
void note_gradient(const std::shared_ptr<TensorImpl>& leaf);
/// An optimizer step: each module parameter that received gradients since the last step but
/// that no live optimizer holds gets one warning on stderr (once per parameter per process),
/// naming its shape and where it was made. Returns how many were warned about now.
int warn_about_orphan_parameters();

}  // namespace mixtape
