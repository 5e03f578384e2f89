// The Python module of the CPU kernels: binds each kernel (one source each, see
// kernels/cpu_build.py) and records the torch it was built against. The only source that
// includes pybind11 (torch/python.h); the kernels include the lighter tensor.h.
#include <torch/python.h>
#include <torch/version.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens,
                           int64_t block_size, double scale,
                           c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale);
torch::Tensor small_gemm(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                         c10::optional<torch::Tensor> residual);
torch::Tensor rows_gemm(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale,
                        c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual);
torch::Tensor packed_gemm(torch::Tensor x, torch::Tensor panels, int64_t N,
                          c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> residual);
int64_t panel_width();
torch::Tensor int8_gemm(torch::Tensor xq, torch::Tensor x_scale, torch::Tensor panels,
                        torch::Tensor w_sums, torch::Tensor w_scale, int64_t N,
                        c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual);
bool int8_gemm_supported();
double fma_peak_gflops(int64_t iters);
int64_t vector_lanes();
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, int64_t ctx_len, int64_t block_size,
                            double scale, c10::optional<torch::Tensor> k_scale,
                            c10::optional<torch::Tensor> v_scale);
void kv_write_int8(torch::Tensor cache, torch::Tensor scales, torch::Tensor x,
                   torch::Tensor slot_mapping, int64_t block_size);
void kv_write(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_mapping);
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus);
void lora_rows(torch::Tensor x, torch::Tensor y, torch::Tensor row_slot, torch::Tensor a,
               torch::Tensor col_slot, torch::Tensor b, torch::Tensor b_off,
               torch::Tensor b_col0, torch::Tensor b_len);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL, as torch's own ops do: the worker's event loop (its
  // gRPC streams, KV events, write-back) runs Python beside the engine thread's kernels
  // instead of waiting for each kernel to end, and stopping the engine while it runs.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  // The loader refuses a module built against another torch (kernels/cpu.py).
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." +
                            std::to_string(TORCH_VERSION_MINOR) + "." +
                            std::to_string(TORCH_VERSION_PATCH);
  m.def("paged_decode", &paged_decode, nogil, "paged decode attention (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.def("paged_prefill", &paged_prefill, nogil,
        "paged prefill attention over a cached prefix (CPU)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_table"), py::arg("ctx_len"), py::arg("block_size"),
        py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("kv_write_int8", &kv_write_int8, nogil,
        "rows into the int8 KV cache, adapting block scales");
  m.def("kv_write", &kv_write, nogil,
        "K and V rows into a float32 / bf16 / fp16 KV cache at their slots");
  m.def("small_gemm", &small_gemm, nogil,
        "x @ w (+ bias) (+ residual) for a few rows (CPU, float32)");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm of each row, HF's rounding for every dtype");
  m.def("rope", &rope, nogil, "rotary embedding, rotate-half layout, torch's rounding");
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up of the fused gate_up rows [T, 2 I]");
  m.def("lora_rows", &lora_rows, nogil,
        "y += LoRA updates of rows, each with its own adapter (float32)");
  m.def("packed_gemm", &packed_gemm, nogil,
        "x @ w.T (* scale) (+ bias) (+ residual) over w packed in column panels [P, K, panel_width]",
        py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("scale") = py::none(),
        py::arg("bias") = py::none(), py::arg("residual") = py::none());
  m.def("int8_gemm", &int8_gemm, nogil,
        "int8 xq @ int8 w.T, scaled per row and column (+ bias) (+ residual): W8A8 on VNNI",
        py::arg("xq"), py::arg("x_scale"), py::arg("panels"), py::arg("w_sums"),
        py::arg("w_scale"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("int8_gemm_supported", &int8_gemm_supported, "whether this CPU runs int8_gemm (VNNI)");
  m.def("panel_width", &panel_width, "output columns per packed_gemm panel");
  m.def("vector_lanes", &vector_lanes, "float32 lanes of the build's widest register");
  m.def("fma_peak_gflops", &fma_peak_gflops, nogil, "the FMA pipes' rate, measured in registers");
  m.def("bind_threads", &bind_threads, nogil,
        "bind the calling thread's parallel team, thread i to cpus[i]; the CPUs bound (-1: refused)");
  m.def("rows_gemm", &rows_gemm, nogil,
        "x @ w.T (* scale) (+ bias) (+ residual), bf16/fp16/int8 w [N, K]");
}
