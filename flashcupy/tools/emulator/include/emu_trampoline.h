// emu_trampoline.h: calling a kernel with a run-time argument list.
//
// The driver generates, per requested kernel name, two extern "C" functions:
//   emu_entry_N(void** argv)                 calls the kernel with *(A_i*)argv[i]
//   emu_params_N(ParamInfo* out, int cap)    returns the arity and fills each parameter's kind and size
// The parameter types A_i are deduced from the kernel's function pointer, so
// the kernel source is never parsed.

#pragma once

#include <utility>

namespace emu {

enum ParamKind : int { kPointer = 0, kSigned = 1, kUnsigned = 2, kFloating = 3, kBool = 4, kOther = 5 };

struct ParamInfo {
    int kind;
    int size;
    int pointee_size;  // pointers only; 0 for void*
};

template <class T>
constexpr ParamInfo describe_param() {
    if constexpr (std::is_pointer_v<T>) {
        using Pointee = std::remove_cv_t<std::remove_pointer_t<T>>;
        if constexpr (std::is_void_v<Pointee>) return {kPointer, sizeof(T), 0};  // no sizeof(void), not even unused
        else return {kPointer, sizeof(T), static_cast<int>(sizeof(Pointee))};
    } else if constexpr (std::is_same_v<T, bool>) {
        return {kBool, sizeof(T), 0};
    } else if constexpr (std::is_floating_point_v<T>) {
        return {kFloating, sizeof(T), 0};
    } else if constexpr (std::is_integral_v<T>) {
        return {std::is_signed_v<T> ? kSigned : kUnsigned, sizeof(T), 0};
    } else {
        return {kOther, sizeof(T), 0};
    }
}

template <class... A>
int describe(void (*)(A...), ParamInfo* out, int capacity) {
    const ParamInfo info[] = {describe_param<A>()..., ParamInfo{}};
    int arity = static_cast<int>(sizeof...(A));
    for (int i = 0; i < arity && i < capacity; ++i) out[i] = info[i];
    return arity;
}

template <class... A, std::size_t... I>
void call(void (*kernel)(A...), void** argv, std::index_sequence<I...>) {
    kernel(*static_cast<A*>(argv[I])...);
}

template <class... A>
void invoke(void (*kernel)(A...), void** argv) {
    call(kernel, argv, std::index_sequence_for<A...>{});
}

}  // namespace emu

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))
