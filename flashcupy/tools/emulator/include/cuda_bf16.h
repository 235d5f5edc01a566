// cuda_bf16.h for the CPU emulator: __nv_bfloat16, its conversions and operators.
// Not provided: __nv_bfloat162 and the h* intrinsics.

#pragma once

#include "emu_narrow_float.h"

using __nv_bfloat16 = emu::NarrowFloat<emu::BFloat16>;
using nv_bfloat16 = __nv_bfloat16;

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }
inline float __bfloat162float(__nv_bfloat16 h) { return float(h); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return __nv_bfloat16::from_bits(bits); }

EMU_SHUFFLES(__nv_bfloat16)
