// mixtape/dsl/conv_layers.h -- the convolution modules: Conv1d, Conv2d, Conv3d and ConvTranspose2d,
// with PyTorch's parameter names, shapes and initialization.
#pragma once

#include "mixtape/dsl/conv.h"
#include "mixtape/dsl/module.h"

namespace mixtape {

class Generator;

/// weight [out, in / groups, KH, KW], bias [out]; both U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with
/// fan_in = in / groups * KH * KW, as torch.nn.Conv2d.
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, Size2 kernel_size,
         const Conv2dOptions& options = {}, bool bias = true, Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight, bias;
  Conv2dOptions options;
};

/// weight [out, in / groups, K], bias [out], as torch.nn.Conv1d.
class Conv1d : public Module {
 public:
  Conv1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size,
         const Conv1dOptions& options = {}, bool bias = true, Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight, bias;
  Conv1dOptions options;
};

/// weight [out, in / groups, KD, KH, KW], bias [out], as torch.nn.Conv3d.
class Conv3d : public Module {
 public:
  Conv3d(int64_t in_channels, int64_t out_channels, Size3 kernel_size,
         const Conv3dOptions& options = {}, bool bias = true, Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight, bias;
  Conv3dOptions options;
};

/// weight [in, out / groups, KH, KW], bias [out], as torch.nn.ConvTranspose2d (whose fan_in is
/// out / groups * KH * KW).
class ConvTranspose2d : public Module {
 public:
  ConvTranspose2d(int64_t in_channels, int64_t out_channels, Size2 kernel_size,
                  const ConvTranspose2dOptions& options = {}, bool bias = true,
                  Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight, bias;
  ConvTranspose2dOptions options;
};

/// weight [in, out / groups, K], bias [out], as torch.nn.ConvTranspose1d.
class ConvTranspose1d : public Module {
 public:
  ConvTranspose1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size,
                  const ConvTranspose1dOptions& options = {}, bool bias = true,
                  Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight, bias;
  ConvTranspose1dOptions options;
};

/// weight [in, out / groups, KD, KH, KW], bias [out], as torch.nn.ConvTranspose3d.
class ConvTranspose3d : public Module {
 public:
  ConvTranspose3d(int64_t in_channels, int64_t out_channels, Size3 kernel_size,
                  const ConvTranspose3dOptions& options = {}, bool bias = true,
                  Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight, bias;
  ConvTranspose3dOptions options;
};

}  // namespace mixtape
