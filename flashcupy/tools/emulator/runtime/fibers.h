// runtime/fibers.h: the room of fibers: the CUDA threads and their switching.
//
// Part of runtime.cpp, a unity build: runtime.cpp includes its parts, in order, into one
// translation unit (one object, compiled once per toolchain, as before the split); include
// it nowhere else. It uses what the parts before it declare.
//
// The context switch (x86-64 assembly, ucontext elsewhere), a fiber's state (what it blocks in,
// its warp-collective arrival, its cp.async copies in flight), the per-block state of the sm_90
// barriers, one launch's state (`active`), how a fiber starts, blocks and ends, and how a launch
// is abandoned from anywhere with a report.

namespace {

// ----------------------------------------------------------------------------
// context switching

void fiber_start();

#if defined(__x86_64__) && !defined(EMU_USE_UCONTEXT)

// emu_switch_stack(from, to): push the callee-saved registers, store the stack
// pointer in *from, load `to`, pop the registers saved there and return into
// that fiber.
extern "C" void emu_switch_stack(void** from, void* to);
asm(R"(
    .text
    .globl emu_switch_stack
    .hidden emu_switch_stack
    .type emu_switch_stack, @function
    .p2align 4
emu_switch_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_stack, .-emu_switch_stack
)");

struct Context {
    void* sp = nullptr;

    // A fresh stack that emu_switch_stack "returns" into fiber_start from.
    void prepare(unsigned char* stack_lo, std::size_t bytes) {
        auto** top = reinterpret_cast<void**>(stack_lo + bytes);  // 16-byte aligned
        top[-1] = nullptr;                                     // fiber_start never returns
        top[-2] = reinterpret_cast<void*>(&fiber_start);       // popped by `ret`
        for (int slot = 3; slot <= 8; ++slot) top[-slot] = nullptr;  // rbp rbx r12-r15
        sp = top - 8;
    }
};

void switch_context(Context& from, Context& to) { emu_switch_stack(&from.sp, to.sp); }

#else

struct Context {
    ucontext_t uc;

    void prepare(unsigned char* stack_lo, std::size_t bytes) {
        getcontext(&uc);
        uc.uc_stack.ss_sp = stack_lo;
        uc.uc_stack.ss_size = bytes;
        uc.uc_link = nullptr;
        makecontext(&uc, &fiber_start, 0);
    }
};

void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

#endif

// ----------------------------------------------------------------------------
// fibers

// kAtMbarrier: in mbarrier.try_wait.parity until the phase completes (Fiber::mbarrier);
// kAtNamed: in bar.sync until its named barrier completes; kAtWarpgroup: in setmaxnreg until the
// 128 threads of its warpgroup are there; kAtFlag: in flag_wait until an int in global memory, which
// another block raises, reaches a value (Fiber::flag; scheduler.h parks the block meanwhile).
enum class State : unsigned char { kRunnable, kAtBarrier, kAtWarp, kAtMbarrier, kAtNamed, kAtWarpgroup, kAtFlag, kDone };

struct Arrival {
    int kind;
    unsigned mask;
    std::uint64_t payload;  // this lane's value going in, the received value coming out (warp_all_gather: scratch bytes)
    int operand;            // warp_all_gather: the variant, which every lane must agree on
    int width;              // warp_all_gather: the record size in bytes
    const void* gather_src; // warp_all_gather: this lane's record
    void* gather_dst;       // warp_all_gather: every lane's record (32 * width bytes), then the scratch: lane 0's `gathered`
};

// One cp.async copy in flight: its source bytes (read when issued) and where they land.
struct PendingCopy {
    unsigned char* dst;
    unsigned char data[16];
    int bytes;
    long group;   // -1 until cp.async.commit_group puts it in the thread's newest group
    bool landed;  // written already (cp_async_eager), still to be waited for
};

// One bulk store or reduce-add in flight (runtime/tma.h: a TMA store, cp.reduce.async.bulk .add.f32):
// checked when issued; `read` takes its shared-memory source when a wait_group (.read or not) covers
// its bulk group, `write` writes (or adds) it into global memory when a wait_group without .read covers
// it, or when the block ends (the latest a GPU completes it).
struct PendingBulk {
    std::function<void()> read;
    std::function<void()> write;
    long group;  // -1 until cp.async.bulk.commit_group puts it in the thread's newest bulk group
    bool read_done = false;
};

// One TMA load in flight (runtime/tma.h): checked when issued, its box copied when a thread waits on its
// mbarrier (a GPU's copy lands some time after the issue; a reader that skips the wait reads stale bytes).
struct PendingTmaLoad {
    void* dst;
    const void* map;
    int rank;
    int coords[5];
    std::uintptr_t bar;
};

struct Fiber {
    Context context;
    State state;
    uint3 tid;
    unsigned warp;
    unsigned lane;
    Arrival arrival;
    std::vector<PendingCopy> copies;  // issued, not yet waited for
    long groups_committed;
    std::uintptr_t mbarrier;  // kAtMbarrier: the barrier's address
    unsigned parity;          // kAtMbarrier: the parity of the phase awaited
    unsigned named_id;        // kAtNamed: the named barrier
    int bulk_open;            // TMA stores issued and not yet committed (cp.async.bulk.commit_group)
    int bulk_reading;         // committed bulk groups not yet waited for (cp.async.bulk.wait_group.read)
    long bulk_committed;      // bulk groups committed since the block began
    std::vector<PendingBulk> bulk;  // bulk stores and reduce-adds not yet complete (written)
    const int* flag;          // kAtFlag: the int awaited (global memory)
    int flag_value;           // kAtFlag: the value it must reach
    bool acquired_unfenced;   // a flag_wait since the thread's last fence.proxy.async.global
    bool written_unfenced;    // bulk writes completed (wait_group) since its last fence.proxy.async.global
    std::vector<unsigned char> gathered;  // lane 0's: its warp's records at the last warp_all_gather
};

// An mbarrier object (emu_hopper.h): the state the PTX ISA describes, kept beside shared memory.
struct Mbarrier {
    unsigned phase;      // phases completed since init (its parity is what try_wait.parity tests)
    unsigned expected;   // the init count: arrivals each phase waits for
    unsigned pending;    // arrivals still to come in the current phase
    long tx;             // bytes expected (expect_tx) and not yet completed (complete_tx)
    std::size_t init_thread;  // the thread that initialised it
    unsigned long epoch;      // the block's barrier epoch at the init (Launch::barrier_epoch)
    bool fenced;              // its initialiser has run fence.mbarrier_init since
};

// One of a block's 16 named barriers (bar.sync / bar.arrive): the instance in progress.
struct NamedBarrier {
    unsigned count = 0;    // threads it waits for (0: no arrival yet)
    unsigned arrived = 0;
};

// ----------------------------------------------------------------------------
// one launch

struct Launch {
    void (*entry)(void**);
    void** argv;
    const EmuLaunchConfig* config;
    EmuLaunchReport* report;
    std::vector<Fiber> fibers;
    std::vector<unsigned> pass_order;
    Context scheduler;
    Fiber* current = nullptr;
    SharedRegion shared;
    std::mt19937_64 rng;
    sigjmp_buf escape;
    struct Counting* counting = nullptr;  // set for a counted launch (config->count)
    std::unordered_map<std::uintptr_t, Mbarrier> mbarriers;  // this block's, by address
    unsigned long barrier_epoch = 0;  // __syncthreads and named barriers completed by this block
    std::vector<PendingTmaLoad> tma_loads;  // issued, not landed (runtime/tma.h)
    NamedBarrier named[16];
    std::vector<unsigned> maxnreg;  // per warpgroup: the cap its last setmaxnreg set (0: none yet)
};

Launch* active = nullptr;

void record_thread(const Fiber& f) {
    EmuLaunchReport& r = *active->report;
    r.has_thread = 1;
    r.block[0] = emu::builtins.block_idx.x;
    r.block[1] = emu::builtins.block_idx.y;
    r.block[2] = emu::builtins.block_idx.z;
    r.thread[0] = f.tid.x;
    r.thread[1] = f.tid.y;
    r.thread[2] = f.tid.z;
}

// End the launch from anywhere (a fiber, the scheduler, a signal handler).
[[noreturn]] void abandon(int status, const char* format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(active->report->message, sizeof active->report->message, format, args);
    va_end(args);
    siglongjmp(active->escape, status);
}

void fiber_start() {
    active->entry(active->argv);
    Fiber& self = *active->current;
    if (!self.copies.empty()) {
        long uncommitted = std::count_if(self.copies.begin(), self.copies.end(),
                                         [](const PendingCopy& c) { return c.group < 0; });
        record_thread(self);
        abandon(kTrap,
                "the thread exited with %zu cp.async cop%s not waited for (%ld not even committed): the "
                "copies of an exited CTA may land in shared memory that the next CTA on the SM already "
                "owns; wait for every group (cp.async.wait_group 0) before exiting, or issue none",
                self.copies.size(), self.copies.size() == 1 ? "y" : "ies", uncommitted);
    }
    if (self.bulk_open || self.bulk_reading) {
        record_thread(self);
        abandon(kTrap,
                "the thread exited with %d TMA store(s) or reduce-add(s) not committed (cp.async.bulk.commit_group) and %d bulk "
                "group(s) not waited for (cp.async.bulk.wait_group.read 0): a store may still read the shared "
                "memory that the next CTA on the SM already owns", self.bulk_open, self.bulk_reading);
    }
    self.state = State::kDone;
    switch_context(self.context, active->scheduler);
    __builtin_unreachable();  // a finished fiber is never resumed
}

void block_until_scheduled(Fiber& self, State state) {
    self.state = state;
    switch_context(self.context, active->scheduler);
}

}  // namespace
