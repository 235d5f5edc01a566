// runtime/hopper.h: the room of the sm_90 synchronisation model (include/emu_hopper.h declares it).
//
// Part of runtime.cpp, a unity build: runtime.cpp includes its parts, in order, into one
// translation unit (one object, compiled once per toolchain, as before the split); include
// it nowhere else. It uses what the parts before it declare.
//
// mbarrier (init, arrive, expect_tx, complete_tx, try_wait.parity), named barriers (bar.sync,
// bar.arrive) and setmaxnreg; setmaxnreg's rendezvous completes in warps.h, and a block stuck on any
// of them is reported by scheduler.h's report_deadlock.

// ----------------------------------------------------------------------------
// sm_90 synchronisation (emu_hopper.h says what is modelled)

namespace {
[[noreturn]] void misuse(const char* format, ...) {
    record_thread(*active->current);
    va_list args;
    va_start(args, format);
    vsnprintf(active->report->message, sizeof active->report->message, format, args);
    va_end(args);
    siglongjmp(active->escape, kTrap);
}

constexpr long kMbarrierLimit = (1l << 20) - 1;  // the ISA's range of the counts and the tx-count

void land_tma_loads(std::uintptr_t bar);  // runtime/tma.h
bool land_awaited_tma_loads();

std::size_t self_index() { return static_cast<std::size_t>(active->current - active->fibers.data()); }

// A thread's use of a barrier: initialised, and by another thread only once a block barrier
// (__syncthreads, a named barrier) has completed since the init, which orders it before the use
Mbarrier& mbarrier_at(void* bar, const char* what) {
    emu::check_shared(bar, 8, 8, what);
    const auto address = reinterpret_cast<std::uintptr_t>(bar);
    auto it = active->mbarriers.find(address);
    if (it == active->mbarriers.end())
        misuse("%s: the mbarrier at %s was not initialised (mbarrier.init) in this block", what,
               shared_place(address).c_str());
    Mbarrier& b = it->second;
    if (active->current && self_index() != b.init_thread && active->barrier_epoch == b.epoch) {
        const Fiber& init = active->fibers[b.init_thread];
        misuse("%s: the mbarrier at %s was initialised by thread (%u,%u,%u) and no barrier (__syncthreads, "
               "bar.sync) has completed since: nothing orders the init before this thread's use", what,
               shared_place(address).c_str(), init.tid.x, init.tid.y, init.tid.z);
    }
    return b;
}

// The phase completes once nothing is pending: the next begins, and its waiters wake.
void maybe_complete(std::uintptr_t address, Mbarrier& b) {
    if (b.pending != 0 || b.tx != 0) return;
    for (Fiber& f : active->fibers)
        if (f.state == State::kAtMbarrier && f.mbarrier == address && f.parity == (b.phase & 1u))
            f.state = State::kRunnable;
    ++b.phase;
    b.pending = b.expected;
}
}  // namespace

void emu::mbarrier_init(void* bar, unsigned count) {
    check_shared(bar, 8, 8, "mbarrier.init");
    const auto address = reinterpret_cast<std::uintptr_t>(bar);
    if (count < 1 || count > kMbarrierLimit)
        misuse("mbarrier.init of the mbarrier at %s with count %u (it must be in [1, 2^20 - 1])",
               shared_place(address).c_str(), count);
    for (const Fiber& f : active->fibers)
        if (f.state == State::kAtMbarrier && f.mbarrier == address)
            misuse("mbarrier.init of the mbarrier at %s while thread (%u,%u,%u) waits on it",
                   shared_place(address).c_str(), f.tid.x, f.tid.y, f.tid.z);
    active->mbarriers[address] = Mbarrier{0, count, count, 0, self_index(), active->barrier_epoch, false};
}

void emu::mbarrier_init_fence() {
    for (auto& [address, b] : active->mbarriers)
        if (b.init_thread == self_index()) b.fenced = true;
}

// What a TMA load does as it lands: complete_tx, by the async proxy, which sees the init only
// through fence.mbarrier_init in the initialising thread
void emu::mbarrier_complete_tx_async(void* bar, unsigned bytes) {
    Mbarrier& b = mbarrier_at(bar, "cp.async.bulk.tensor's complete_tx");
    if (!b.fenced) {
        const Fiber& init = active->fibers[b.init_thread];
        misuse("cp.async.bulk.tensor completes a transaction on the mbarrier at %s, which thread (%u,%u,%u) "
               "initialised without fence.mbarrier_init after: the async proxy may not see the init",
               shared_place(reinterpret_cast<std::uintptr_t>(bar)).c_str(), init.tid.x, init.tid.y, init.tid.z);
    }
    mbarrier_complete_tx(bar, bytes);
}

void emu::mbarrier_arrive(void* bar, unsigned expect_tx_bytes) {
    const char* what = expect_tx_bytes ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive";
    Mbarrier& b = mbarrier_at(bar, what);
    const auto address = reinterpret_cast<std::uintptr_t>(bar);
    if (b.tx + static_cast<long>(expect_tx_bytes) > kMbarrierLimit)
        misuse("%s of %u bytes: the tx-count of the mbarrier at %s would exceed 2^20 - 1", what, expect_tx_bytes,
               shared_place(address).c_str());
    if (b.pending == 0)
        misuse("%s: the mbarrier at %s has had all %u arrivals of its phase %u (it waits for a tx-count of %ld "
               "bytes); one arrival too many", what, shared_place(address).c_str(), b.expected, b.phase, b.tx);
    b.tx += expect_tx_bytes;
    --b.pending;
    maybe_complete(address, b);
}

void emu::mbarrier_complete_tx(void* bar, unsigned bytes) {
    Mbarrier& b = mbarrier_at(bar, "mbarrier.complete_tx");
    const auto address = reinterpret_cast<std::uintptr_t>(bar);
    if (b.tx - static_cast<long>(bytes) < -kMbarrierLimit)
        misuse("mbarrier.complete_tx of %u bytes: the tx-count of the mbarrier at %s would fall below -(2^20 - 1)",
               bytes, shared_place(address).c_str());
    b.tx -= bytes;
    maybe_complete(address, b);
}

bool emu::mbarrier_try_wait_parity(void* bar, unsigned parity) {
    mbarrier_at(bar, "mbarrier.try_wait.parity");
    land_tma_loads(reinterpret_cast<std::uintptr_t>(bar));  // the TMA loads that complete on it land now
    Mbarrier& b = mbarrier_at(bar, "mbarrier.try_wait.parity");
    Fiber& self = *active->current;
    const bool blocks = (b.phase & 1u) == (parity & 1u);  // the phase of this parity is the current one
    if (active->counting) {
        ++active->counting->totals.mbarrier_waits;
        active->counting->totals.mbarrier_blocked += blocks;
    }
    if (blocks) {  // not complete: wait for it
        self.mbarrier = reinterpret_cast<std::uintptr_t>(bar);
        self.parity = parity & 1u;
        block_until_scheduled(self, State::kAtMbarrier);
    }
    return true;
}

void emu::named_barrier(unsigned id, unsigned count, bool wait) {
    const char* what = wait ? "bar.sync" : "bar.arrive";
    const std::size_t threads = active->fibers.size();
    if (id == 0 || id > 15)
        misuse("%s %u, %u: named barrier ids are 1..15 (0 is __syncthreads()'s)", what, id, count);
    if (count == 0 || count % 32 || count > threads)
        misuse("%s %u, %u: the thread count must be a positive multiple of 32 and at most the block's %zu threads",
               what, id, count, threads);
    NamedBarrier& b = active->named[id];
    if (b.count && b.count != count)
        misuse("%s %u, %u while %u threads have arrived at named barrier %u with a count of %u: every arrival "
               "must name the same count", what, id, count, b.arrived, id, b.count);
    b.count = count;
    if (++b.arrived == count) {
        if (active->counting) ++active->counting->totals.named_barriers;
        for (Fiber& f : active->fibers)
            if (f.state == State::kAtNamed && f.named_id == id) f.state = State::kRunnable;
        b = NamedBarrier{};
        ++active->barrier_epoch;
        return;
    }
    if (wait) {
        Fiber& self = *active->current;
        self.named_id = id;
        block_until_scheduled(self, State::kAtNamed);
    }
}

void emu::setmaxnreg(unsigned regs, bool increase) {
    if (regs % 8 || regs < 24 || regs > 256)
        misuse("setmaxnreg.%s %u: the register count must be a multiple of 8 in [24, 256]", increase ? "inc" : "dec",
               regs);
    Fiber& self = *active->current;
    self.arrival = Arrival{increase ? 1 : 0, 0, 0, static_cast<int>(regs), 0, nullptr, nullptr};
    block_until_scheduled(self, State::kAtWarpgroup);
}
