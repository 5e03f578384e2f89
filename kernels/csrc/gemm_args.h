// The operands of a GEMM kernel with an epilogue, as the kernels take them: x in float32
// (whatever it came as), the optional per-output scale (int8's), bias and residual in
// float32, each checked against M and N, and the float32 output to fill.
#pragma once

#include "tensor.h"

struct GemmArgs {
  at::Tensor x, scale, bias, residual, out;  // scale, bias, residual undefined when absent
};

inline const float* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

inline GemmArgs gemm_args(const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& scale,
                          const c10::optional<at::Tensor>& bias,
                          const c10::optional<at::Tensor>& residual) {
  auto f32 = [](const c10::optional<at::Tensor>& t) {
    return t.has_value() ? t->to(at::kFloat).contiguous() : at::Tensor();
  };
  GemmArgs a{x.to(at::kFloat).contiguous(), f32(scale), f32(bias), f32(residual), {}};
  const int64_t M = x.size(0);
  if (a.scale.defined()) TORCH_CHECK(a.scale.numel() == N, "scale must be [N]");
  if (a.bias.defined()) TORCH_CHECK(a.bias.numel() == N, "bias must be [N]");
  if (a.residual.defined())
    TORCH_CHECK(a.residual.size(0) == M && a.residual.size(1) == N, "residual must be [M, N]");
  a.out = at::empty({M, N}, a.x.options());
  return a;
}
