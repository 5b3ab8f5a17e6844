"""Round-to-nearest-even onto bfloat16 and float8_e4m3fn, computed in fp32 bits.

A GPU's conversions round to nearest even, as torch's do; Triton's interpreter (CI) truncates to
bfloat16 and rounds float8 ties away from zero, flushing its subnormals. The kernels therefore
round explicitly with these helpers before every store or cast to those types, so the interpreter
runs exactly the arithmetic the GPU does and bit-exact comparisons against the references hold on
both. The cost is a few integer operations per element in kernels bound by memory traffic.
"""

import triton
import triton.language as tl


@triton.jit
def bf16_rne(x):
    """fp32 x rounded to the nearest bfloat16 value, ties to even; still fp32, so the cast after it
    is exact. NaN and infinity pass through."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def fp8_rne(x):
    """fp32 x (already within +-448) rounded to the nearest float8_e4m3fn value, ties to even,
    subnormals kept: ``round(x / ulp) * ulp`` with ulp = 2**(exponent - 3), at least 2**-9. A value
    that rounds to zero keeps its sign (-0.0, as a cast gives); NaN stays NaN."""
    exponent = ((x.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    exponent = tl.maximum(exponent, -6)
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((x / ulp + 12582912.0) - 12582912.0) * ulp
    return tl.where(r == 0.0, x * 0.0, r)


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """fp32 x rounded as a cast to ``DTYPE`` rounds on a GPU (bfloat16 explicitly, see above)."""
    if DTYPE == tl.bfloat16:
        return bf16_rne(x).to(DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def fp8_bits(r):
    """The float8_e4m3fn encoding (uint8) of fp32 r, which must already be one of its values
    (``fp8_rne``) or NaN (0x7F, torch's encoding); written through a uint8 view, so no conversion of
    the interpreter's is involved."""
    bits = r.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    normal = (((exponent + 7) << 3).to(tl.uint32) | ((bits >> 20) & 7)) & 0x7F
    subnormal = (tl.abs(r) * 512.0).to(tl.uint32)
    code = sign | tl.where(exponent >= -6, normal, subnormal)
    return tl.where(r != r, 0x7F, code).to(tl.uint8)
