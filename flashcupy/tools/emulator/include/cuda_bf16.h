// cuda_bf16.h for the CPU emulator: __nv_bfloat16, its conversions and operators.
// Not provided: __nv_bfloat162 and the h* intrinsics.

#pragma once

#include "emu_narrow_float.h"

using __nv_bfloat16 = emu::NarrowFloat<emu::BFloat16>;
using nv_bfloat16 = __nv_bfloat16;

EMU_NARROW_FLOAT_API(__nv_bfloat16, bfloat16)
