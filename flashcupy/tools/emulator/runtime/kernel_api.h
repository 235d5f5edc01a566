// runtime/kernel_api.h: the room of what a kernel calls (cuda_emu.h and emu_tensor_core.h declare it).
//
// Part of runtime.cpp, a unity build: runtime.cpp includes its parts, in order, into one
// translation unit (one object, compiled once per toolchain, as before the split); include
// it nowhere else. It uses what the parts before it declare.
//
// __syncthreads(), the warp collectives, the shared-memory checks, cp.async and its groups, the
// counting build's callbacks (g++'s -fsanitize=kernel-address hooks; the stores also feed the
// async-proxy model of runtime/proxy.h, which defines the proxy_* functions) and __trap().

namespace {
void proxy_generic_write(std::uintptr_t a, std::size_t bytes);
void proxy_async_write(std::uintptr_t a, std::size_t bytes);
void proxy_async_read(std::uintptr_t a, std::size_t bytes, const Fiber& reader, const char* what, unsigned long issued);
}  // namespace

// ----------------------------------------------------------------------------
// what the kernel calls

void emu::block_barrier() { block_until_scheduled(*active->current, State::kAtBarrier); }

std::uint64_t emu::warp_collective(int kind, unsigned mask, std::uint64_t payload, int operand, int width) {
    Fiber& self = *active->current;
    if (!((mask >> self.lane) & 1)) {
        record_thread(self);
        abandon(kWarpMisuse, "%s(mask 0x%08x) called by lane %u, which the mask does not name",
                collective_name(kind), mask, self.lane);
    }
    if (width < 1 || width > 32 || (width & (width - 1))) {
        record_thread(self);
        abandon(kWarpMisuse, "%s called with width %d; it must be a power of two from 1 to 32",
                collective_name(kind), width);
    }
    self.arrival = Arrival{kind, mask, payload, operand, width};
    block_until_scheduled(self, State::kAtWarp);
    return self.arrival.payload;
}

void* emu::warp_all_gather(int kind, int variant, const void* mine, int bytes, int scratch) {
    Fiber& self = *active->current;
    self.arrival = Arrival{kind, 0xffffffffu, static_cast<std::uint64_t>(scratch), variant, bytes, mine, nullptr};
    block_until_scheduled(self, State::kAtWarp);
    return self.arrival.gather_dst;
}

unsigned emu::lane_id() { return active->current->lane; }

namespace {
bool in_shared(std::uintptr_t lo, std::uintptr_t hi) {
    auto inside = [&](const void* begin, const void* end) {
        return lo >= reinterpret_cast<std::uintptr_t>(begin) && hi <= reinterpret_cast<std::uintptr_t>(end);
    };
    const SharedRegion& s = active->shared;
    return inside(s.data_lo, s.data_hi) || (__start_emu_shared && inside(__start_emu_shared, __stop_emu_shared));
}
}  // namespace

void emu::check_shared(const void* p, int bytes, int align, const char* what) {
    auto lo = reinterpret_cast<std::uintptr_t>(p);
    const char* why = lo % static_cast<std::uintptr_t>(align) ? "is not aligned"
                      : !in_shared(lo, lo + static_cast<std::uintptr_t>(bytes)) ? "is not in shared memory"
                      : nullptr;
    if (!why) return;
    record_thread(*active->current);
    abandon(kTrap, "%s: address %p (%d bytes) %s (it must be %d-byte aligned shared memory)", what, p, bytes, why,
            align);
}

void emu::cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    Fiber& self = *active->current;
    if ((bytes != 4 && bytes != 8 && bytes != 16) || src_bytes < 0 || src_bytes > bytes) {
        record_thread(self);
        abandon(kTrap, "cp.async: copy size %d with src-size %d (the size must be 4, 8 or 16, src-size at most it)",
                bytes, src_bytes);
    }
    check_shared(dst, bytes, bytes, "cp.async destination");
    if (reinterpret_cast<std::uintptr_t>(src) % static_cast<std::uintptr_t>(bytes)) {
        record_thread(self);
        abandon(kTrap, "cp.async: source address %p is not %d-byte aligned", src, bytes);
    }
    if (active->counting) {
        const auto site = reinterpret_cast<std::uintptr_t>(__builtin_return_address(0));
        note(kOpCpAsync, site, reinterpret_cast<std::uintptr_t>(dst), bytes);
        note(kOpCpAsyncSource, site, reinterpret_cast<std::uintptr_t>(src), src_bytes);  // none when 0
    }
    PendingCopy copy{static_cast<unsigned char*>(dst), {}, bytes, -1, active->config->cp_async_eager != 0};
    std::memcpy(copy.data, src, static_cast<std::size_t>(src_bytes));  // a fault here names this thread
    if (copy.landed) {
        std::memcpy(copy.dst, copy.data, static_cast<std::size_t>(bytes));
        proxy_generic_write(reinterpret_cast<std::uintptr_t>(copy.dst), static_cast<std::size_t>(bytes));
    }
    self.copies.push_back(copy);
}

void emu::cp_async_commit() {
    Fiber& self = *active->current;
    for (PendingCopy& c : self.copies)
        if (c.group < 0) c.group = self.groups_committed;
    ++self.groups_committed;
}

void emu::cp_async_wait(int pending) {
    Fiber& self = *active->current;
    long complete_below = self.groups_committed - pending;  // groups older than the newest `pending`
    std::size_t kept = 0;
    for (PendingCopy& c : self.copies) {
        if (c.group < 0 || c.group >= complete_below) self.copies[kept++] = c;
        else if (!c.landed) {
            std::memcpy(c.dst, c.data, static_cast<std::size_t>(c.bytes));
            proxy_generic_write(reinterpret_cast<std::uintptr_t>(c.dst), static_cast<std::size_t>(c.bytes));
        }
    }
    self.copies.resize(kept);
}

void emu::record_access(int op, const void* address, int bytes) {
    if (active && active->counting)
        note(op, reinterpret_cast<std::uintptr_t>(__builtin_return_address(0)),
             reinterpret_cast<std::uintptr_t>(address), bytes);
}

void emu::count_ex2() {
    if (active && active->counting) ++active->counting->totals.ex2;
}

void emu::copy_raw(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }

// The callbacks of g++'s -fsanitize=kernel-address with --param
// asan-instrumentation-with-call-threshold=0 (a counting build, driver.py): every load and store the
// compiled kernel makes, before it makes it.
#define EMU_ASAN_CALLBACKS(size)                                                                      \
    extern "C" void __asan_load##size##_noabort(std::uintptr_t a) {                                   \
        note(kOpLoad, reinterpret_cast<std::uintptr_t>(__builtin_return_address(0)), a, size);        \
    }                                                                                                 \
    extern "C" void __asan_store##size##_noabort(std::uintptr_t a) {                                  \
        proxy_generic_write(a, size);                                                                 \
        note(kOpStore, reinterpret_cast<std::uintptr_t>(__builtin_return_address(0)), a, size);       \
    }
EMU_ASAN_CALLBACKS(1)
EMU_ASAN_CALLBACKS(2)
EMU_ASAN_CALLBACKS(4)
EMU_ASAN_CALLBACKS(8)
EMU_ASAN_CALLBACKS(16)
extern "C" void __asan_loadN_noabort(std::uintptr_t a, std::size_t n) {
    note(kOpLoad, reinterpret_cast<std::uintptr_t>(__builtin_return_address(0)), a, static_cast<int>(n));
}
extern "C" void __asan_storeN_noabort(std::uintptr_t a, std::size_t n) {
    proxy_generic_write(a, n);
    note(kOpStore, reinterpret_cast<std::uintptr_t>(__builtin_return_address(0)), a, static_cast<int>(n));
}
extern "C" void __asan_handle_no_return() {}

void emu::trap(const char* why) {
    if (active->current) record_thread(*active->current);
    abandon(kTrap, "%s", why);
}
