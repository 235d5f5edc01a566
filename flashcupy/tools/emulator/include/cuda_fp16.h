// cuda_fp16.h for the CPU emulator: __half, its conversions and operators.
// Not provided: __half2 and the h* intrinsics (__hadd, hexp, ...).

#pragma once

#include "emu_narrow_float.h"

using __half = emu::NarrowFloat<emu::Binary16>;
using half = __half;

EMU_NARROW_FLOAT_API(__half, half)
