// cuda_fp16.h for the CPU emulator: __half, its conversions and operators.
// Not provided: __half2 and the h* intrinsics (__hadd, hexp, ...).

#pragma once

#include "emu_narrow_float.h"

using __half = emu::NarrowFloat<emu::Binary16>;
using half = __half;

inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half(d); }
inline float __half2float(__half h) { return float(h); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short bits) { return __half::from_bits(bits); }

EMU_SHUFFLES(__half)
