// mixtape/dsl/adaptive_optim.cpp -- Adamax, NAdam, RAdam and Adadelta updates as graph code, in
// torch.optim's order of operations (so that results agree to rounding).
#include "mixtape/dsl/adaptive_optim.h"

#include <cmath>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/optimizer_state.h"

namespace mixtape {
namespace {

using optimizer_state::bias_correction;
using optimizer_state::finite_non_negative;
using optimizer_state::set_state;
using optimizer_state::started_state;

// mt::Error unless the betas are in [0, 1), eps > 0 and weight_decay finite and >= 0.
void check_betas(const char* kind, double beta1, double beta2, double eps, double weight_decay) {
  if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1))
    fail("{}: betas must be in [0, 1), got ({}, {})", kind, beta1, beta2);
  if (!(eps > 0 && std::isfinite(eps)) || !finite_non_negative(weight_decay))
    fail("{}: eps must be finite and > 0 and weight_decay finite and >= 0, got {} and {}", kind,
         eps, weight_decay);
}

// NAdam's mu_product: in f32 at least, where the state is narrower (a half product would round
// 1 - mu_product, which divides the step, to three digits).
DType mu_product_type(DType state) { return size_of(state) < size_of(f32) ? f32 : state; }

}  // namespace

OptionFields option_fields(AdamaxOptions& o) {
  return {{"beta1", &o.beta1},
          {"beta2", &o.beta2},
          {"eps", &o.eps},
          {"weight_decay", &o.weight_decay},
          {"maximize", &o.maximize}};
}
OptionFields option_fields(NAdamOptions& o) {
  return {{"beta1", &o.beta1},
          {"beta2", &o.beta2},
          {"eps", &o.eps},
          {"weight_decay", &o.weight_decay},
          {"momentum_decay", &o.momentum_decay},
          {"maximize", &o.maximize}};
}
OptionFields option_fields(RAdamOptions& o) {
  return {{"beta1", &o.beta1},
          {"beta2", &o.beta2},
          {"eps", &o.eps},
          {"weight_decay", &o.weight_decay},
          {"maximize", &o.maximize}};
}
OptionFields option_fields(AdadeltaOptions& o) {
  return {{"rho", &o.rho},
          {"eps", &o.eps},
          {"weight_decay", &o.weight_decay},
          {"maximize", &o.maximize}};
}

// ---------------------------------------------------------------------------------------------
// Adamax

Adamax::Adamax(std::vector<Tensor> params, AdamaxOptions options)
    : Adamax(std::vector<ParamGroup<AdamaxOptions>>{{std::move(params), options}}) {}

Adamax::Adamax(std::vector<ParamGroup<AdamaxOptions>> groups)
    : OptimizerWith(std::move(groups), "Adamax") {
  start_groups();
}

void Adamax::resolve_options(AdamaxOptions& o) const {
  check_betas("Adamax", o.beta1, o.beta2, o.eps, o.weight_decay);
}

void Adamax::begin_step() {
  beta1_ = momentum_value();  // a cycled beta1, as torch's OneCycleLR writes the group's betas
  rest1_ = beta1_.defined() ? 1.0 - beta1_ : Tensor();
  step_size_ = lr_value() / bias_correction(beta1_, group_options().beta1, step_number());
}

std::optional<std::vector<std::string>> Adamax::state_names(size_t) const {
  return std::vector<std::string>{"exp_avg", "exp_inf"};
}

void Adamax::start_state(NamedTensors& state, const Tensor& grad) const {
  add_zero_state(state, "exp_avg", grad);
  add_zero_state(state, "exp_inf", grad);
}

Tensor Adamax::update(const Tensor& param, const Tensor& grad, NamedTensors& state) {
  const AdamaxOptions& o = group_options();
  Tensor g = rule_gradient(grad, param, o.maximize, o.weight_decay);
  const Tensor& m_prev = started_state(state, "exp_avg");
  const Tensor& u_prev = started_state(state, "exp_inf");
  Tensor m =
      lincomb({m_prev, step_factor(beta1_, o.beta1, g), g, step_factor(rest1_, 1 - o.beta1, g)});
  // The larger of the decayed norm and |g| + eps; a NaN in either stays (torch's amax).
  Tensor u = maximum(u_prev * step_constant(o.beta2, u_prev), abs(g) + step_constant(o.eps, g));
  set_state(state, "exp_avg", m);
  set_state(state, "exp_inf", u);
  return sub_mul({param, m / u, step_scalar(step_size_, m.dtype())});
}

// ---------------------------------------------------------------------------------------------
// NAdam

NAdam::NAdam(std::vector<Tensor> params, NAdamOptions options)
    : NAdam(std::vector<ParamGroup<NAdamOptions>>{{std::move(params), options}}) {}

NAdam::NAdam(std::vector<ParamGroup<NAdamOptions>> groups)
    : OptimizerWith(std::move(groups), "NAdam") {
  start_groups();
}

void NAdam::resolve_options(NAdamOptions& o) const {
  check_betas("NAdam", o.beta1, o.beta2, o.eps, o.weight_decay);
  if (!finite_non_negative(o.momentum_decay))
    fail("NAdam: momentum_decay must be finite and >= 0, got {}", o.momentum_decay);
}

void NAdam::begin_step() {
  const NAdamOptions& o = group_options();
  const Tensor& t = step_number();
  // A cycled beta1, as torch's OneCycleLR writes the group's betas, or the option's.
  beta1_ = momentum_value().defined() ? momentum_value() : full({}, o.beta1, f64);
  rest1_ = 1.0 - beta1_;
  // The momentum schedule mu_t and mu_{t+1}, in f64 as torch's Python floats.
  Tensor decay = full({}, 0.96, f64);
  mu_ = beta1_ * (1.0 - 0.5 * pow(decay, t * o.momentum_decay));
  mu_next_ = beta1_ * (1.0 - 0.5 * pow(decay, (t + 1.0) * o.momentum_decay));
  sqrt_bias2_ = sqrt(bias_correction(Tensor(), o.beta2, t));
}

std::optional<std::vector<std::string>> NAdam::state_names(size_t) const {
  return std::vector<std::string>{"exp_avg", "exp_avg_sq", "mu_product"};
}

Shape NAdam::state_shape(const std::string& name, const Shape& param) const {
  return name == "mu_product" ? Shape{} : param;
}

DType NAdam::entry_dtype(size_t param_index, const std::string& name) const {
  const DType own = state_dtype(param_index);
  return name == "mu_product" ? mu_product_type(own) : own;
}

void NAdam::start_state(NamedTensors& state, const Tensor& grad) const {
  add_zero_state(state, "exp_avg", grad);
  add_zero_state(state, "exp_avg_sq", grad);
  if (optimizer_state::find_state(state, "mu_product")) return;
  // The product starts at 1, stored (as torch's state).
  auto one = std::make_shared<Storage>(mu_product_type(grad.dtype()), 1);
  store_element(*one, 0, 1.0);
  state.emplace_back("mu_product", from_storage(std::move(one), {}));
}

Tensor NAdam::update(const Tensor& param, const Tensor& grad, NamedTensors& state) {
  const NAdamOptions& o = group_options();
  Tensor g = rule_gradient(grad, param, o.maximize, o.weight_decay);
  const Tensor& m_prev = started_state(state, "exp_avg");
  const Tensor& v_prev = started_state(state, "exp_avg_sq");
  const Tensor& product_prev = started_state(state, "mu_product");
  Tensor m = lincomb({m_prev, step_scalar(beta1_, g.dtype()), g, step_scalar(rest1_, g.dtype())});
  Tensor v =
      lincomb_square({v_prev, step_constant(o.beta2, v_prev), g, step_constant(1 - o.beta2, g)});
  // The product as the state keeps it, then read back in f64, as torch's mu_product.item().
  Tensor product = cast(cast(product_prev, f64) * mu_, product_prev.dtype());
  Tensor kept = cast(product, f64);
  Tensor grad_step = lr_value() * (1.0 - mu_) / (1.0 - kept);
  Tensor avg_step = lr_value() * mu_next_ / (1.0 - kept * mu_next_);
  set_state(state, "exp_avg", m);
  set_state(state, "exp_avg_sq", v);
  set_state(state, "mu_product", product);
  Tensor denominator = sqrt(v) / step_scalar(sqrt_bias2_, v.dtype()) + step_constant(o.eps, v);
  Tensor p = sub_mul({param, g / denominator, step_scalar(grad_step, g.dtype())});
  return sub_mul({p, m / denominator, step_scalar(avg_step, m.dtype())});
}

// ---------------------------------------------------------------------------------------------
// RAdam

RAdam::RAdam(std::vector<Tensor> params, RAdamOptions options)
    : RAdam(std::vector<ParamGroup<RAdamOptions>>{{std::move(params), options}}) {}

RAdam::RAdam(std::vector<ParamGroup<RAdamOptions>> groups)
    : OptimizerWith(std::move(groups), "RAdam") {
  start_groups();
}

void RAdam::resolve_options(RAdamOptions& o) const {
  check_betas("RAdam", o.beta1, o.beta2, o.eps, o.weight_decay);
}

void RAdam::begin_step() {
  const RAdamOptions& o = group_options();
  const Tensor& t = step_number();
  beta1_ = momentum_value();
  rest1_ = beta1_.defined() ? 1.0 - beta1_ : Tensor();
  bias1_ = bias_correction(beta1_, o.beta1, t);
  Tensor bias2 = bias_correction(Tensor(), o.beta2, t);
  sqrt_bias2_ = sqrt(bias2);
  // The approximated SMA's length, its limit, and the variance rectification term (NaN while
  // rho_t < 4, where the unrectified step is taken instead).
  const double rho_inf = 2 / (1 - o.beta2) - 1;
  Tensor rho = rho_inf - 2.0 * t * pow(full({}, o.beta2, f64), t) / bias2;
  rectified_ = rho > 5.0;
  rect_ = sqrt((rho - 4.0) * (rho - 2.0) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho));
}

std::optional<std::vector<std::string>> RAdam::state_names(size_t) const {
  return std::vector<std::string>{"exp_avg", "exp_avg_sq"};
}

void RAdam::start_state(NamedTensors& state, const Tensor& grad) const {
  add_zero_state(state, "exp_avg", grad);
  add_zero_state(state, "exp_avg_sq", grad);
}

Tensor RAdam::update(const Tensor& param, const Tensor& grad, NamedTensors& state) {
  const RAdamOptions& o = group_options();
  Tensor g = rule_gradient(grad, param, o.maximize, o.weight_decay);
  const Tensor& m_prev = started_state(state, "exp_avg");
  const Tensor& v_prev = started_state(state, "exp_avg_sq");
  Tensor m =
      lincomb({m_prev, step_factor(beta1_, o.beta1, g), g, step_factor(rest1_, 1 - o.beta1, g)});
  Tensor v =
      lincomb_square({v_prev, step_constant(o.beta2, v_prev), g, step_constant(1 - o.beta2, g)});
  set_state(state, "exp_avg", m);
  set_state(state, "exp_avg_sq", v);
  // torch's bias_corrected_exp_avg * lr, times adaptive_lr * rect once rectified.
  Tensor step = m / step_scalar(bias1_, m.dtype()) * step_scalar(lr_value(), m.dtype());
  Tensor adaptive = step_scalar(sqrt_bias2_, v.dtype()) / (sqrt(v) + step_constant(o.eps, v));
  Tensor rectified = step * adaptive * step_scalar(rect_, m.dtype());
  return param - where(rectified_, rectified, step);
}

// ---------------------------------------------------------------------------------------------
// Adadelta

Adadelta::Adadelta(std::vector<Tensor> params, AdadeltaOptions options)
    : Adadelta(std::vector<ParamGroup<AdadeltaOptions>>{{std::move(params), options}}) {}

Adadelta::Adadelta(std::vector<ParamGroup<AdadeltaOptions>> groups)
    : OptimizerWith(std::move(groups), "Adadelta") {
  start_groups();
}

void Adadelta::resolve_options(AdadeltaOptions& o) const {
  if (!(o.rho >= 0 && o.rho <= 1)) fail("Adadelta: rho must be in [0, 1], got {}", o.rho);
  if (!(o.eps > 0 && std::isfinite(o.eps)) || !finite_non_negative(o.weight_decay))
    fail("Adadelta: eps must be finite and > 0 and weight_decay finite and >= 0, got {} and {}",
         o.eps, o.weight_decay);
}

std::optional<std::vector<std::string>> Adadelta::state_names(size_t) const {
  return std::vector<std::string>{"square_avg", "acc_delta"};
}

void Adadelta::start_state(NamedTensors& state, const Tensor& grad) const {
  add_zero_state(state, "square_avg", grad);
  add_zero_state(state, "acc_delta", grad);
}

Tensor Adadelta::update(const Tensor& param, const Tensor& grad, NamedTensors& state) {
  const AdadeltaOptions& o = group_options();
  Tensor g = rule_gradient(grad, param, o.maximize, o.weight_decay);
  const Tensor& square_prev = started_state(state, "square_avg");
  const Tensor& delta_prev = started_state(state, "acc_delta");
  Tensor rho = step_constant(o.rho, g), rest = step_constant(1 - o.rho, g);
  Tensor eps = step_constant(o.eps, g);
  Tensor square_avg = lincomb_square({square_prev, rho, g, rest});
  Tensor delta = sqrt(delta_prev + eps) / sqrt(square_avg + eps) * g;
  set_state(state, "square_avg", square_avg);
  set_state(state, "acc_delta", lincomb_square({delta_prev, rho, delta, rest}));
  return sub_mul({param, delta, step_scalar(lr_value(), delta.dtype())});
}

}  // namespace mixtape
