"""Float32 to the model's dtype, rounded to nearest even under Triton's interpreter too.

The compiled cast rounds to nearest even, as torch does; the interpreter's float32 -> bf16
cast truncates, which would make every bf16 result there one step off torch's. This one is
the same on both: add half a bf16 step (ties to the even side) and drop the low 16 bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast(x, dtype: tl.constexpr):
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
