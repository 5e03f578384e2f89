// What a kernel source needs of ATen, and no more: torch/extension.h (all of libtorch's C++
// API plus pybind11) cost about a minute of compile per source on a 2-core AVX2 machine,
// these headers ~10 s. Only module.cpp, which binds the kernels to Python, includes more.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Optional.h>

namespace torch {
using at::empty;
using at::empty_like;
using at::Tensor;
using at::zeros;
}  // namespace torch
