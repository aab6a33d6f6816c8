// mixtape/dsl/adaptive_optim.h -- Adamax, NAdam, RAdam and Adadelta, as torch.optim's.
#pragma once

#include "mixtape/dsl/optim.h"

namespace mixtape {

struct AdamaxOptions {
  double lr = 2e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;  // L2, added to the gradient
  bool maximize = false;
};
OptionFields option_fields(AdamaxOptions& options);

/// Adamax (Kingma and Ba 2015, section 7), as torch.optim.Adamax: the second moment replaced by
/// the running infinity norm exp_inf = max(beta2 exp_inf, |g| + eps). State "exp_avg",
/// "exp_inf".
class Adamax : public OptimizerWith<AdamaxOptions> {
 public:
  explicit Adamax(std::vector<ParamGroup<AdamaxOptions>> groups);
  Adamax(std::vector<Tensor> params, AdamaxOptions options = {});
  bool has_momentum() const override { return true; }
  std::optional<std::vector<std::string>> state_names(size_t param_index) const override;

 protected:
  void resolve_options(AdamaxOptions& options) const override;
  void begin_step() override;
  void start_state(NamedTensors& state, const Tensor& grad) const override;
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override;

 private:
  Tensor beta1_, rest1_, step_size_;  // a cycled beta1, 1 - beta1, lr / bias correction (0-d f64)
};

struct NAdamOptions {
  double lr = 2e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;       // L2, added to the gradient
  double momentum_decay = 4e-3;  // psi of mu_t = beta1 (1 - 0.96^(t psi) / 2)
  bool maximize = false;
};
OptionFields option_fields(NAdamOptions& options);

/// NAdam (Dozat 2016, Adam with Nesterov momentum and a momentum schedule), as torch.optim.NAdam
/// (the product of the mu_t as its multi-tensor update forms it, which later releases use in
/// both). State "exp_avg", "exp_avg_sq" and "mu_product", the running product of the mu_t (0-d,
/// in f32 or the parameter's wider type).
class NAdam : public OptimizerWith<NAdamOptions> {
 public:
  explicit NAdam(std::vector<ParamGroup<NAdamOptions>> groups);
  NAdam(std::vector<Tensor> params, NAdamOptions options = {});
  bool has_momentum() const override { return true; }
  std::optional<std::vector<std::string>> state_names(size_t param_index) const override;
  Shape state_shape(const std::string& name, const Shape& param) const override;
  DType entry_dtype(size_t param_index, const std::string& name) const override;

 protected:
  void resolve_options(NAdamOptions& options) const override;
  void begin_step() override;
  void start_state(NamedTensors& state, const Tensor& grad) const override;
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override;

 private:
  Tensor beta1_, rest1_, mu_, mu_next_, sqrt_bias2_;  // this step's scalars (0-d f64)
};

struct RAdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;  // L2, added to the gradient
  bool maximize = false;
};
OptionFields option_fields(RAdamOptions& options);

/// RAdam (Liu et al. 2020, rectified Adam), as torch.optim.RAdam: while the approximated
/// simple moving average's length rho_t is at most 5 (the first steps; about 6 with beta2 =
/// 0.999) the update is the bias-corrected momentum alone; after, Adam's, times the variance
/// rectification term. State "exp_avg", "exp_avg_sq".
class RAdam : public OptimizerWith<RAdamOptions> {
 public:
  explicit RAdam(std::vector<ParamGroup<RAdamOptions>> groups);
  RAdam(std::vector<Tensor> params, RAdamOptions options = {});
  bool has_momentum() const override { return true; }
  std::optional<std::vector<std::string>> state_names(size_t param_index) const override;

 protected:
  void resolve_options(RAdamOptions& options) const override;
  void begin_step() override;
  void start_state(NamedTensors& state, const Tensor& grad) const override;
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override;

 private:
  Tensor beta1_, rest1_;                          // a cycled beta1 and 1 - beta1 (0-d f64)
  Tensor bias1_, sqrt_bias2_, rectified_, rect_;  // this step's scalars (0-d f64; bool)
};

struct AdadeltaOptions {
  double lr = 1.0;
  double rho = 0.9;  // the running means' decay
  double eps = 1e-6;
  double weight_decay = 0;  // L2, added to the gradient
  bool maximize = false;
};
OptionFields option_fields(AdadeltaOptions& options);

/// Adadelta (Zeiler 2012), as torch.optim.Adadelta: the step sqrt(acc_delta + eps) /
/// sqrt(square_avg + eps) g, times lr. State "square_avg", "acc_delta" (running means of the
/// squared gradients and steps).
class Adadelta : public OptimizerWith<AdadeltaOptions> {
 public:
  explicit Adadelta(std::vector<ParamGroup<AdadeltaOptions>> groups);
  Adadelta(std::vector<Tensor> params, AdadeltaOptions options = {});
  std::optional<std::vector<std::string>> state_names(size_t param_index) const override;

 protected:
  void resolve_options(AdadeltaOptions& options) const override;
  void start_state(NamedTensors& state, const Tensor& grad) const override;
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override;
};

}  // namespace mixtape
