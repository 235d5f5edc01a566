// runtime/grid.h: the room of the grid: blocks in the launch's order, and the blocks parked on flags.
//
// Part of runtime.cpp, a unity build, included last (it keeps aside the state every other part keeps
// for the block running); include it nowhere else.
//
// Blocks run one after another in the launch's block order (scheduler.h runs one). A block whose
// threads all wait, some of them in flag_wait for an int in global memory that another block must
// raise (runtime/tma.h), is parked: its shared memory (dynamic and static), its fibers with their
// stacks, and every part's per-block state (mbarriers, named barriers, TMA loads, wgmma, the async
// proxy, the counts) are kept aside, and the next block starts on fresh stacks. After each block ends
// or parks, the parked blocks whose flags have reached their values resume, in the order they parked,
// into the same shared memory (the same addresses: their pointers stay valid). A GPU runs CTAs
// concurrently; here a CTA that waits for a later CTA of the launch's order runs again once that one
// has raised the flag, so the result does not depend on the block order when the kernel orders its
// blocks' work through flags, and does when it does not (the tests run descending and shuffled orders).
// Parked blocks that nothing can wake are a DeadlockError naming the first one's flag.

namespace {

struct ParkedBlock {
    uint3 index;
    std::vector<Fiber> fibers;
    std::unordered_map<std::uintptr_t, Mbarrier> mbarriers;
    unsigned long barrier_epoch;
    std::vector<PendingTmaLoad> tma_loads;
    NamedBarrier named[16];
    std::vector<unsigned> maxnreg;
    std::vector<WgmmaThread> wgmma_threads;
    std::vector<WgmmaOp> wgmma_ops;
    ProxyState proxy;
    std::vector<std::unordered_map<SiteKey, SiteLog, SiteHash>> counted;  // Counting::warps
    std::vector<unsigned char> dynamic_shared, static_shared;
    std::vector<unsigned char*> stacks;  // StackPool mappings: the fibers' contexts point into them
};

std::vector<std::vector<unsigned char*>> spare_stacks;  // mappings of blocks resumed, for the next park
std::vector<ParkedBlock> parked;  // the launch's parked blocks, in the order they parked

// Exchange the running block's state with `b`'s (its shared memory copied in or out by the caller).
void swap_block(Launch& l, ParkedBlock& b) {
    std::swap(l.fibers, b.fibers);
    std::swap(l.mbarriers, b.mbarriers);
    std::swap(l.barrier_epoch, b.barrier_epoch);
    std::swap(l.tma_loads, b.tma_loads);
    std::swap(l.named, b.named);
    std::swap(l.maxnreg, b.maxnreg);
    std::swap(wgmma_threads, b.wgmma_threads);
    std::swap(wgmma_ops, b.wgmma_ops);
    std::swap(proxy, b.proxy);
    if (l.counting) std::swap(l.counting->warps, b.counted);
    std::swap(stacks.mappings, b.stacks);
    std::swap(emu::builtins.block_idx, b.index);
}

const unsigned char* static_lo() { return __start_emu_shared; }
std::size_t static_bytes() { return __start_emu_shared ? std::size_t(__stop_emu_shared - __start_emu_shared) : 0; }

ParkedBlock park(Launch& l) {
    ParkedBlock b;
    b.dynamic_shared.assign(l.shared.data_lo, l.shared.data_hi);
    b.static_shared.assign(static_lo(), static_lo() + static_bytes());
    if (!spare_stacks.empty()) b.stacks = std::move(spare_stacks.back()), spare_stacks.pop_back();
    swap_block(l, b);  // b holds the parked block now, the launch fresh stacks (or none yet)
    if (l.counting) l.counting->warps.resize(b.counted.size());
    const std::size_t threads = b.fibers.size();
    l.fibers = b.fibers;  // the next block's fibers: the same threads (start_block resets them)
    if (!stacks.reserve(threads, stacks.bytes ? stacks.bytes : l.config->stack_bytes))
        abandon(kResources, "mmap failed for the stacks of a block parked on a flag (%s)", std::strerror(errno));
    return b;
}

void resume(Launch& l, ParkedBlock& b) {
    std::memcpy(l.shared.data_lo, b.dynamic_shared.data(), b.dynamic_shared.size());
    if (static_bytes()) std::memcpy(__start_emu_shared, b.static_shared.data(), static_bytes());
    swap_block(l, b);  // b holds the finished block's leftovers: its stacks become spares
    spare_stacks.push_back(std::move(b.stacks));
}

bool can_resume(const ParkedBlock& b) {
    for (const Fiber& f : b.fibers)
        if (f.state == State::kAtFlag && *f.flag >= f.flag_value) return true;
    return false;
}

[[noreturn]] void report_parked(Launch& l) {
    resume(l, parked.front());  // the report names its block and its first waiting thread
    const Fiber* waiter = nullptr;
    std::size_t waiters = 0;
    for (const Fiber& f : l.fibers)
        if (f.state == State::kAtFlag && (++waiters, !waiter)) waiter = &f;
    record_thread(*waiter);
    abandon(kDeadlock,
            "deadlock: %zu block(s) wait for flags in global memory that no block raises; in block (%u,%u,%u) "
            "%zu thread(s) (the first: thread (%u,%u,%u)) wait in flag_wait for the int at %p to reach %d, "
            "and it holds %d",
            parked.size(), emu::builtins.block_idx.x, emu::builtins.block_idx.y, emu::builtins.block_idx.z, waiters,
            waiter->tid.x, waiter->tid.y, waiter->tid.z, static_cast<const void*>(waiter->flag), waiter->flag_value,
            *waiter->flag);
}

// The stacks of spare and parked blocks (a launch abandoned with blocks parked leaves them)
void release_parked_stacks() {
    for (ParkedBlock& b : parked) spare_stacks.push_back(std::move(b.stacks));
    parked.clear();
    for (auto& mappings : spare_stacks)
        for (unsigned char* m : mappings) munmap(m, page_size() + stacks.bytes);
    spare_stacks.clear();
}

void run_grid(Launch& l) {
    const EmuLaunchConfig& c = *l.config;
    emu::builtins.grid_dim = dim3(c.grid[0], c.grid[1], c.grid[2]);
    emu::builtins.block_dim = dim3(c.block[0], c.block[1], c.block[2]);
    unsigned threads = c.block[0] * c.block[1] * c.block[2];
    l.fibers.resize(threads);
    l.pass_order.resize(threads);
    for (unsigned i = 0; i < threads; ++i) {
        Fiber& f = l.fibers[i];
        f.tid = uint3{i % c.block[0], i / c.block[0] % c.block[1], i / (c.block[0] * c.block[1])};
        f.warp = i / 32;
        f.lane = i % 32;
    }
    std::size_t blocks = std::size_t{c.grid[0]} * c.grid[1] * c.grid[2];
    std::vector<std::size_t> block_order(blocks);
    for (std::size_t b = 0; b < blocks; ++b) block_order[b] = b;
    if (c.order == kDescending || c.order == kWarpSkew) std::reverse(block_order.begin(), block_order.end());
    if (c.order == kShuffled) std::shuffle(block_order.begin(), block_order.end(), l.rng);
    release_parked_stacks();
    // Runs the block in the launch's slots to its end, or parks it
    auto advance = [&l] {
        if (advance_block(l)) finish_block(l);
        else parked.push_back(park(l));
    };
    // Resumes parked blocks whose flags were raised until none can
    auto resume_parked = [&l, &advance] {
        for (bool resumed = true; resumed;) {
            resumed = false;
            for (std::size_t i = 0; i < parked.size(); ++i) {
                if (!can_resume(parked[i])) continue;
                ParkedBlock b = std::move(parked[i]);
                parked.erase(parked.begin() + static_cast<long>(i));
                resume(l, b);
                advance();
                resumed = true;
                break;
            }
        }
    };
    for (std::size_t b : block_order) {
        emu::builtins.block_idx = uint3{static_cast<unsigned>(b % c.grid[0]),
                                        static_cast<unsigned>(b / c.grid[0] % c.grid[1]),
                                        static_cast<unsigned>(b / (std::size_t{c.grid[0]} * c.grid[1]))};
        start_block(l);
        advance();
        resume_parked();
    }
    if (!parked.empty()) report_parked(l);
    release_parked_stacks();
}

}  // namespace
