// runtime/scheduler.h: the room of the scheduler: blocks, passes, barriers, deadlocks.
//
// Part of runtime.cpp, a unity build: runtime.cpp includes its parts, in order, into one
// translation unit (one object, compiled once per toolchain, as before the split); include
// it nowhere else. It uses what the parts before it declare.
//
// A block runs in passes over the runnable fibers in the launch's thread order until every fiber is
// done; __syncthreads() completes when every live fiber is at it; a block where no fiber can go on is
// reported (report_deadlock, naming what each one waits for), unless some wait for a flag in global
// memory, which another block may raise: then runtime/grid.h, which runs the grid, parks it.

namespace {

bool land_awaited_tma_loads();  // runtime/tma.h

// Where `address` lies in shared memory, for messages: "dynamic shared memory offset 16".
std::string shared_place(std::uintptr_t address) {
    const SharedRegion& sh = active->shared;
    char text[96];
    const auto dyn = reinterpret_cast<std::uintptr_t>(sh.base);
    const auto static_lo = reinterpret_cast<std::uintptr_t>(__start_emu_shared);
    const auto dyn_lo = reinterpret_cast<std::uintptr_t>(sh.data_lo), dyn_hi = reinterpret_cast<std::uintptr_t>(sh.data_hi);
    if (address >= dyn_lo && address < dyn_hi)
        std::snprintf(text, sizeof text, "dynamic shared memory offset %ld", static_cast<long>(address - dyn));
    else if (static_lo && address >= static_lo && address < reinterpret_cast<std::uintptr_t>(__stop_emu_shared))
        std::snprintf(text, sizeof text, "static __shared__ offset %ld", static_cast<long>(address - static_lo));
    else
        std::snprintf(text, sizeof text, "address %p (not shared memory)", reinterpret_cast<void*>(address));
    return text;
}

[[noreturn]] void report_deadlock(Launch& l) {
    std::size_t at_barrier = 0;
    for (const Fiber& f : l.fibers) at_barrier += f.state == State::kAtBarrier;
    char detail[1536] = "";
    std::size_t used = 0;
    int described = 0;
    auto append = [&](const char* format, auto... args) {
        if (used < sizeof detail)
            used += static_cast<std::size_t>(std::snprintf(detail + used, sizeof detail - used, format, args...));
    };
    // Every mbarrier waited on, first: the usual culprit in a warp-specialised kernel.
    std::vector<std::uintptr_t> seen;
    for (const Fiber& f : l.fibers) {
        if (f.state != State::kAtMbarrier || std::find(seen.begin(), seen.end(), f.mbarrier) != seen.end()) continue;
        seen.push_back(f.mbarrier);
        if (seen.size() > 4) continue;
        if (!described++) record_thread(f);
        std::size_t waiters = 0;
        for (const Fiber& g : l.fibers) waiters += g.state == State::kAtMbarrier && g.mbarrier == f.mbarrier;
        const Mbarrier& b = l.mbarriers[f.mbarrier];
        append("; %zu threads (the first: thread (%u,%u,%u)) wait on the mbarrier at %s for its phase %u "
               "(parity %u) to complete, which still waits for %u of %u arrivals and a tx-count of %ld bytes",
               waiters, f.tid.x, f.tid.y, f.tid.z, shared_place(f.mbarrier).c_str(), b.phase, f.parity,
               b.pending, b.expected, b.tx);
    }
    for (unsigned id = 0; id < 16; ++id) {
        std::size_t waiters = 0;
        const Fiber* first = nullptr;
        for (const Fiber& f : l.fibers)
            if (f.state == State::kAtNamed && f.named_id == id && (++waiters, !first)) first = &f;
        if (!first) continue;
        if (!described++) record_thread(*first);
        append("; %zu threads wait at named barrier %u (bar.sync), %u of its %u threads arrived", waiters, id,
               l.named[id].arrived, l.named[id].count);
    }
    for (std::size_t g = 0; g * 128 < l.fibers.size(); ++g) {
        std::size_t waiters = 0;
        const Fiber* first = nullptr;
        for (std::size_t i = g * 128; i < std::min(l.fibers.size(), g * 128 + 128); ++i)
            if (l.fibers[i].state == State::kAtWarpgroup && (++waiters, !first)) first = &l.fibers[i];
        if (!first) continue;
        if (!described++) record_thread(*first);
        append("; %zu threads of warpgroup %zu wait in %s for the rest of the warpgroup", waiters, g,
               warpgroup_instruction(first->arrival.kind));
    }
    for (std::size_t warp_first = 0; warp_first < l.fibers.size() && described < 4; warp_first += 32) {
        std::uint32_t waiting = 0, alive = 0;
        for (std::size_t lane = 0; lane < 32 && warp_first + lane < l.fibers.size(); ++lane) {
            State state = l.fibers[warp_first + lane].state;
            waiting |= static_cast<std::uint32_t>(state == State::kAtWarp) << lane;
            alive |= static_cast<std::uint32_t>(state != State::kDone) << lane;
        }
        if (!waiting) continue;
        const Fiber& lead = l.fibers[warp_first + __builtin_ctz(waiting)];
        if (!described++) record_thread(lead);
        append("; in warp %u, %d lanes wait in %s(mask 0x%08x) for lanes 0x%08x, which wait elsewhere",
               lead.warp, __builtin_popcount(waiting), collective_name(lead.arrival.kind), lead.arrival.mask,
               lead.arrival.mask & alive & ~waiting);
    }
    abandon(kDeadlock, "deadlock in block (%u,%u,%u): %zu threads wait at __syncthreads()%s",
            emu::builtins.block_idx.x, emu::builtins.block_idx.y, emu::builtins.block_idx.z, at_barrier, detail);
}

void order_pass(Launch& l) {
    std::vector<unsigned>& order = l.pass_order;
    for (unsigned i = 0; i < order.size(); ++i) order[i] = i;
    if (l.config->order == kDescending || l.config->order == kWarpSkew) std::reverse(order.begin(), order.end());
    if (l.config->order == kShuffled) std::shuffle(order.begin(), order.end(), l.rng);
}

// A block's start: its shared memory garbage, its per-block state reset, its fibers at the kernel's entry.
void start_block(Launch& l) {
    if (__start_emu_shared) std::memset(__start_emu_shared, kGarbage, __stop_emu_shared - __start_emu_shared);
    std::memset(l.shared.data_lo, kGarbage, l.shared.data_hi - l.shared.data_lo);
    l.mbarriers.clear();
    l.barrier_epoch = 0;
    l.tma_loads.clear();
    for (NamedBarrier& b : l.named) b = NamedBarrier{};
    l.maxnreg.assign((l.fibers.size() + 127) / 128, 0);
    wgmma_reset_block(l);
    proxy_reset_block(l);
    for (std::size_t i = 0; i < l.fibers.size(); ++i) {
        l.fibers[i].state = State::kRunnable;
        l.fibers[i].copies.clear();
        l.fibers[i].groups_committed = 0;
        l.fibers[i].bulk_open = l.fibers[i].bulk_reading = 0;
        l.fibers[i].bulk_committed = 0;
        l.fibers[i].bulk.clear();
        l.fibers[i].acquired_unfenced = l.fibers[i].written_unfenced = false;
        l.fibers[i].context.prepare(stacks.stack_lo(i), stacks.bytes);
    }
}

// The threads waiting in flag_wait whose flag has reached its value go on.
bool wake_flag_waiters(Launch& l) {
    bool woke = false;
    for (Fiber& f : l.fibers)
        if (f.state == State::kAtFlag && *f.flag >= f.flag_value) f.state = State::kRunnable, woke = true;
    return woke;
}

// Runs the block until it ends (true) or until every thread that can go on waits for a flag that
// another block must raise (false: runtime/grid.h parks it).
bool advance_block(Launch& l) {
    auto run = [&l](Fiber& f) {
        emu::builtins.thread_idx = f.tid;
        l.current = &f;
        switch_context(l.scheduler, f.context);
        l.current = nullptr;
    };
    for (;;) {
        wake_flag_waiters(l);
        order_pass(l);
        if (l.config->order == kWarpSkew) {
            std::size_t n = l.fibers.size();
            for (std::size_t first = (n - 1) / 32 * 32 + 32; first > 0;) {
                first -= 32;
                for (bool ran = true; ran; resolve_warps(l)) {
                    ran = false;
                    for (std::size_t i = std::min(first + 32, n); i-- > first;) {
                        if (l.fibers[i].state != State::kRunnable) continue;
                        run(l.fibers[i]);
                        ran = true;
                    }
                }
            }
        } else {
            for (unsigned i : l.pass_order) {
                Fiber& f = l.fibers[i];
                if (f.state == State::kRunnable) run(f);
            }
        }
        resolve_warps(l);
        resolve_warpgroups(l);
        bool done = true, runnable = false, all_at_barrier = true, at_flag = false;
        for (const Fiber& f : l.fibers) {
            done &= f.state == State::kDone;
            runnable |= f.state == State::kRunnable;
            all_at_barrier &= f.state == State::kDone || f.state == State::kAtBarrier;
            at_flag |= f.state == State::kAtFlag;
        }
        if (done) return true;
        if (runnable) continue;
        if (!all_at_barrier && land_awaited_tma_loads()) continue;  // a waiter's TMA loads have landed
        if (at_flag) {
            if (wake_flag_waiters(l)) continue;  // a thread of this block raised it
            return false;
        }
        if (!all_at_barrier) report_deadlock(l);
        if (l.counting) ++l.counting->totals.barriers;
        ++l.barrier_epoch;
        for (Fiber& f : l.fibers)
            if (f.state == State::kAtBarrier) f.state = State::kRunnable;
    }
}

void complete_bulk_writes(Launch& l);  // runtime/tma.h

// A block's end: its counts, its bulk writes still in flight, and the checks of what it left behind.
void finish_block(Launch& l) {
    complete_bulk_writes(l);
    if (l.counting) {
        flush_counts(l);
        ++l.counting->totals.ctas;
        l.counting->totals.warps += (l.fibers.size() + 31) / 32;
    }
    if (!l.tma_loads.empty())
        abandon(kTrap, "block (%u,%u,%u) ended with %zu TMA load(s) in flight that no thread waited for on their "
                "mbarrier: they may land in shared memory that the next CTA on the SM already owns",
                emu::builtins.block_idx.x, emu::builtins.block_idx.y, emu::builtins.block_idx.z, l.tma_loads.size());
    long overrun = l.shared.overrun();
    if (overrun >= 0) {
        abandon(kSharedOverrun,
                "block (%u,%u,%u) wrote dynamic shared memory at byte offset %ld, outside the %zu bytes "
                "the launch requested (found after the block ended; the writing thread is unknown)",
                emu::builtins.block_idx.x, emu::builtins.block_idx.y, emu::builtins.block_idx.z, overrun,
                l.shared.bytes);
    }
}

}  // namespace
