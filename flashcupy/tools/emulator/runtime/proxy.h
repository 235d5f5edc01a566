// runtime/proxy.h: the room of the async proxy (include/emu_hopper.h states the model).
//
// Part of runtime.cpp, a unity build, included after runtime/wgmma.h (whose shared window it
// indexes by) and before runtime/tma.h; include it nowhere else. kernel_api.h's __asan_store*
// callbacks and cp.async landings call proxy_generic_write, wgmma.h's element and tma.h call
// proxy_async_read / proxy_async_write (declared in kernel_api.h).
//
// The model. Per byte of the block's shared memory (dynamic and static, indexed by its
// shared-window address as smem_address gives it), the thread that last wrote it through the
// generic proxy (an ordinary store, a cp.async landing) and how many fence.proxy.async that
// thread had executed when it wrote. The write is visible to the async proxy once its writer
// has executed one more fence.proxy.async since (the count has grown): no scan at a fence, one
// increment. An async-proxy write (a TMA load landing) clears the bytes: nothing generic is
// pending on them, and a generic read after the mbarrier wait is ordered by the mbarrier (not
// checked: reads are not instrumented). An async-proxy read (a wgmma operand as the operation
// completes, a TMA store's source at issue) of a byte whose last generic write is not yet
// fenced by its writer is a KernelError naming the writer (the reported thread), the reader,
// the byte's shared-window address and the instruction. So is one whose last generic write, by
// another thread than the reader, no block barrier (__syncthreads, a named barrier) separates from the
// reading instruction's issue: its writer's fence alone does not order the store before another warp
// issues the wgmma (or the TMA store) that reads it.
//
// Only modules that include hopper.cuh (from the source or an -I header) record generic writes
// (build.py compiles them with store-only -fsanitize=kernel-address callbacks and defines
// emu_proxy_tracking); every other module has no callbacks and no shadow, so ordinary kernels pay
// nothing.

extern "C" const int emu_proxy_tracking __attribute__((weak, visibility("hidden")));

namespace {

struct ProxyState {
    bool on = false;
    // per window byte: 0 (no generic write pending) or (fences << 16 | writer + 1)
    std::vector<std::uint64_t> shadow;
    std::vector<std::uint64_t> fences;  // per fiber: fence.proxy.async executed in this block
    std::vector<unsigned long> epochs;  // per window byte: the block's barrier epoch at its last generic write
};
ProxyState proxy;

void proxy_reset_block(Launch& l) {
    proxy.on = &emu_proxy_tracking != nullptr;
    if (!proxy.on) return;
    std::size_t bytes = dynamic_window_bytes();
    if (__start_emu_shared)
        bytes = static_window_base() + (reinterpret_cast<std::uintptr_t>(__stop_emu_shared) - static_window_lo());
    proxy.shadow.assign(bytes, 0);
    proxy.epochs.assign(bytes, 0);
    proxy.fences.assign(l.fibers.size(), 0);
}

// The window address of host address a, or -1 when a is not shared memory.
long proxy_window(std::uintptr_t a) {
    const std::uintptr_t dyn = dynamic_window_lo();
    if (a >= dyn && a < dyn + dynamic_window_bytes()) return static_cast<long>(a - dyn);
    if (__start_emu_shared && a >= reinterpret_cast<std::uintptr_t>(__start_emu_shared) &&
        a < reinterpret_cast<std::uintptr_t>(__stop_emu_shared))
        return static_cast<long>(static_window_base() + (a - static_window_lo()));
    return -1;
}

void proxy_generic_write(std::uintptr_t a, std::size_t bytes) {
    if (!proxy.on || !active || !active->current) return;
    const long w = proxy_window(a);
    if (w < 0) return;
    const std::size_t self = static_cast<std::size_t>(active->current - active->fibers.data());
    const std::uint64_t entry = proxy.fences[self] << 16 | (self + 1);
    const std::size_t end = std::min(proxy.shadow.size(), static_cast<std::size_t>(w) + bytes);
    for (std::size_t i = static_cast<std::size_t>(w); i < end; ++i) {
        proxy.shadow[i] = entry;
        proxy.epochs[i] = active->barrier_epoch;
    }
}

void proxy_async_write(std::uintptr_t a, std::size_t bytes) {
    if (!proxy.on) return;
    const long w = proxy_window(a);
    if (w < 0) return;
    const std::size_t end = std::min(proxy.shadow.size(), static_cast<std::size_t>(w) + bytes);
    for (std::size_t i = static_cast<std::size_t>(w); i < end; ++i) proxy.shadow[i] = 0;
}

long proxy_async_blocked(std::uint64_t w, std::size_t bytes, const Fiber& reader, unsigned long issued) {
    if (!proxy.on) return -1;
    const std::size_t end = std::min(proxy.shadow.size(), static_cast<std::size_t>(w) + bytes);
    std::uint64_t pending = 0;  // most reads find no generic write pending on any byte: one pass, no branch
    for (std::size_t i = static_cast<std::size_t>(w); i < end; ++i) pending |= proxy.shadow[i];
    if (!pending) return -1;
    for (std::size_t i = static_cast<std::size_t>(w); i < end; ++i) {
        const std::uint64_t e = proxy.shadow[i];
        if (!e) continue;
        const std::size_t writer = (e & 0xffff) - 1;
        // fenced by its writer, and the writer is the reader or a barrier completed since the write
        if (proxy.fences[writer] > (e >> 16) && (&active->fibers[writer] == &reader || proxy.epochs[i] < issued))
            continue;
        return static_cast<long>(i);
    }
    return -1;
}

// `reader` reads `bytes` at host address a through the async proxy, in `what`, issued at barrier epoch `issued`.
void proxy_async_read(std::uintptr_t a, std::size_t bytes, const Fiber& reader, const char* what, unsigned long issued) {
    if (!proxy.on) return;
    const long w = proxy_window(a);
    if (w < 0) return;
    const long i = proxy_async_blocked(static_cast<std::uint64_t>(w), bytes, reader, issued);
    if (i < 0) return;
    const std::uint64_t e = proxy.shadow[static_cast<std::size_t>(i)];
    const std::size_t writer = (e & 0xffff) - 1;
    const Fiber& f = active->fibers[writer];
    record_thread(f);
    if (proxy.fences[writer] > (e >> 16))  // fenced: what is missing is the barrier
        abandon(kTrap, "%s by thread (%u,%u,%u) reads the byte at shared address 0x%zx through the async proxy, "
                "which thread (%u,%u,%u) wrote with an ordinary store and fenced, but no barrier (__syncthreads, "
                "bar.sync) completed between that store and the issue: another warp may issue it first",
                what, reader.tid.x, reader.tid.y, reader.tid.z, static_cast<std::size_t>(i), f.tid.x, f.tid.y, f.tid.z);
    abandon(kTrap, "%s by thread (%u,%u,%u) reads the byte at shared address 0x%zx through the async proxy, "
            "but thread (%u,%u,%u) last wrote it with an ordinary store and has not executed "
            "fence.proxy.async since (fence_proxy_async() in the writing thread, before the barrier)",
            what, reader.tid.x, reader.tid.y, reader.tid.z, static_cast<std::size_t>(i), f.tid.x, f.tid.y, f.tid.z);
}

}  // namespace

void emu::fence_proxy_async() {
    if (!proxy.on) return;
    ++proxy.fences[static_cast<std::size_t>(active->current - active->fibers.data())];
}
