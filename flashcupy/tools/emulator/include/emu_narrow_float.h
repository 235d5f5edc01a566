// emu_narrow_float.h: 16-bit floating types for the emulator's cuda_fp16.h and
// cuda_bf16.h, by bit manipulation (no reliance on the host's _Float16).
//
// Storage is the 16-bit pattern; conversions round to nearest, ties to even,
// as cvt.rn does on a GPU; a NaN converts to the canonical NaN 0x7fff, as the
// GPU's cvt does. Arithmetic operators compute in float and round once, which
// gives the same result as the GPU's half-precision add/sub/mul/div (float
// holds more than twice the narrow significand, so there is no double rounding).

#pragma once

#include "cuda_emu.h"

namespace emu {

// A binary floating format with EXP exponent bits and FRAC fraction bits in 16 bits.
template <int EXP, int FRAC>
struct NarrowFormat {
    static_assert(1 + EXP + FRAC == 16);
    static constexpr int bias = (1 << (EXP - 1)) - 1;
    static constexpr int min_exp = 1 - bias;  // exponent of the smallest normal
    static constexpr std::uint32_t inf = ((1u << EXP) - 1) << FRAC;
    static constexpr std::uint16_t canonical_nan = 0x7fff;

    // Round a double (exact for every float input) to the nearest pattern, ties to even.
    static std::uint16_t round(double value) {
        std::uint64_t bits = emu_bits<std::uint64_t>(value);
        std::uint16_t sign = static_cast<std::uint16_t>((bits >> 63) << 15);
        std::uint64_t mag = bits & 0x7fffffffffffffffull;
        if (mag > 0x7ff0000000000000ull) return canonical_nan;
        if (mag == 0x7ff0000000000000ull) return sign | inf;
        int exp = static_cast<int>(mag >> 52) - 1023;
        if (exp < -1022) return sign;  // double subnormals lie far below every narrow subnormal
        std::uint64_t significand = (mag & ((1ull << 52) - 1)) | (1ull << 52);
        // Keep FRAC fraction bits; a subnormal result keeps fewer.
        int shift = 52 - FRAC + (exp < min_exp ? min_exp - exp : 0);
        if (shift > 60) return sign;  // below half the smallest subnormal
        std::uint64_t kept = significand >> shift;
        std::uint64_t rest = significand & ((1ull << shift) - 1);
        std::uint64_t half = 1ull << (shift - 1);
        if (rest > half || (rest == half && (kept & 1))) ++kept;  // may carry into the exponent: still right
        // For a normal result `kept` includes the implicit bit, which adds one to the exponent field.
        std::uint64_t out = exp < min_exp ? kept : (static_cast<std::uint64_t>(exp + bias - 1) << FRAC) + kept;
        if (out >= inf) return sign | inf;
        return sign | static_cast<std::uint16_t>(out);
    }

    // Exact, by bits alone (no ldexpf: a library call the wgmma and mma models made per operand element).
    static float widen(std::uint16_t x) {
        if constexpr (EXP == 8) {
            return emu_bits<float>(static_cast<std::uint32_t>(x) << 16);  // float's top half
        } else {
            std::uint32_t sign = static_cast<std::uint32_t>(x >> 15) << 31;
            std::uint32_t exp_field = (x >> FRAC) & ((1u << EXP) - 1);
            std::uint32_t frac = x & ((1u << FRAC) - 1);
            if (exp_field == (1u << EXP) - 1) return emu_bits<float>(sign | 0x7f800000u | (frac << (23 - FRAC)));
            if (exp_field != 0)  // a normal number: the exponent rebiased
                return emu_bits<float>(sign | (exp_field - bias + 127) << 23 | frac << (23 - FRAC));
            // a subnormal (or zero): frac units of 2^(min_exp - FRAC), a normal float
            static_assert(FRAC - min_exp < 32 && min_exp - FRAC >= -126);
            constexpr float unit = 1.0f / static_cast<float>(1ull << (FRAC - min_exp));
            float magnitude = static_cast<float>(frac) * unit;
            return sign ? -magnitude : magnitude;
        }
    }
};

template <class Format>
struct NarrowFloat {
    std::uint16_t __x;

    NarrowFloat() = default;
    NarrowFloat(float f) : __x(Format::round(f)) {}
    NarrowFloat(double d) : __x(Format::round(d)) {}
    template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
    NarrowFloat(I i) : __x(Format::round(static_cast<double>(i))) {}
    operator float() const { return Format::widen(__x); }

    static NarrowFloat from_bits(std::uint16_t bits) {
        NarrowFloat h;
        h.__x = bits;
        return h;
    }

    // Hidden friends, like CUDA's non-template operators: `h * 2.0f` is ambiguous
    // here exactly where it is ambiguous under nvcc.
    friend NarrowFloat operator+(NarrowFloat a, NarrowFloat b) { return NarrowFloat(float(a) + float(b)); }
    friend NarrowFloat operator-(NarrowFloat a, NarrowFloat b) { return NarrowFloat(float(a) - float(b)); }
    friend NarrowFloat operator*(NarrowFloat a, NarrowFloat b) { return NarrowFloat(float(a) * float(b)); }
    friend NarrowFloat operator/(NarrowFloat a, NarrowFloat b) { return NarrowFloat(float(a) / float(b)); }
    friend NarrowFloat operator-(NarrowFloat a) { return from_bits(a.__x ^ 0x8000); }
    friend NarrowFloat operator+(NarrowFloat a) { return a; }
    friend NarrowFloat& operator+=(NarrowFloat& a, NarrowFloat b) { return a = a + b; }
    friend NarrowFloat& operator-=(NarrowFloat& a, NarrowFloat b) { return a = a - b; }
    friend NarrowFloat& operator*=(NarrowFloat& a, NarrowFloat b) { return a = a * b; }
    friend NarrowFloat& operator/=(NarrowFloat& a, NarrowFloat b) { return a = a / b; }
    friend bool operator==(NarrowFloat a, NarrowFloat b) { return float(a) == float(b); }
    friend bool operator!=(NarrowFloat a, NarrowFloat b) { return float(a) != float(b); }
    friend bool operator<(NarrowFloat a, NarrowFloat b) { return float(a) < float(b); }
    friend bool operator<=(NarrowFloat a, NarrowFloat b) { return float(a) <= float(b); }
    friend bool operator>(NarrowFloat a, NarrowFloat b) { return float(a) > float(b); }
    friend bool operator>=(NarrowFloat a, NarrowFloat b) { return float(a) >= float(b); }
};

using Binary16 = NarrowFormat<5, 10>;
using BFloat16 = NarrowFormat<8, 7>;

}  // namespace emu

// The conversions CUDA's cuda_fp16.h and cuda_bf16.h declare for their type T (NAME: half,
// bfloat16), plus its shuffles (EMU_SHUFFLES, cuda_emu.h).
#define EMU_NARROW_FLOAT_API(T, NAME)                                                              \
    inline T __float2##NAME(float f) { return T(f); }                                              \
    inline T __float2##NAME##_rn(float f) { return T(f); }                                         \
    inline T __double2##NAME(double d) { return T(d); }                                            \
    inline float __##NAME##2float(T h) { return float(h); }                                        \
    inline unsigned short __##NAME##_as_ushort(T h) { return h.__x; }                              \
    inline T __ushort_as_##NAME(unsigned short bits) { return T::from_bits(bits); }                \
    EMU_SHUFFLES(T)
