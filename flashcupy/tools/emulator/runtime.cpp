// runtime.cpp: the CUDA emulator's scheduler.
//
// Linked into every emulated module. Runs a grid block by block; the threads
// of a block are fibers, each with its own guarded stack, switched by a few
// instructions of assembly on x86-64 (ucontext elsewhere, or with
// -DEMU_USE_UCONTEXT). A fiber runs until it blocks:
//   __syncthreads()      waits until every live thread of the block is there;
//   warp collectives     (__syncwarp, __shfl*_sync) wait until every live lane
//                        named in the mask is there, then exchange and go on;
//                        the warp-wide PTX instructions of emu_tensor_core.h
//                        (mma.sync, ldmatrix.sync) wait for all 32 lanes and
//                        give each lane a copy of every lane's operands;
//   sm_90 waits          (emu_hopper.h) mbarrier.try_wait.parity until its phase
//                        completes, bar.sync until its named barrier's count has
//                        arrived, setmaxnreg and wgmma.mma_async until the whole
//                        warpgroup is there (wgmma: emu_wgmma_runtime.inc);
//   the kernel's return  ends the fiber (an exited thread drops out of later
//                        barriers, as on a GPU).
// Between blocking points the fibers of a block run one after another, in the
// launch's thread order (ascending, descending, a fresh seeded shuffle per pass,
// or warp_skew: one warp at a time, the last first, each as far as it can go
// before the next starts), so a missing barrier changes the answer under some order.
//
// Each thread also keeps its cp.async copies, read at issue and written to shared
// memory either at the cp.async.wait_group that completes their group ("deferred":
// a missing wait reads stale memory) or at once ("eager": a prefetch lands while
// other warps may still read the buffer); a thread that ends with copies it never
// waited for is reported, as the copies of an exited CTA may land in shared memory
// that the next CTA on the SM already owns.
//
// With -ftz=true the launch runs with the CPU's flush-to-zero (subnormal inputs
// and results of floating-point operations become zero), as CUDA flushes float32.
//
// A memory fault, a failed assertion, a __trap(), a deadlock, a misused warp
// collective or barrier, or running past the launch's CPU-time limit ends the launch: the runtime jumps back to emu_launch and fills
// EmuLaunchReport, which the Python driver turns into an exception.

#include "cuda_emu.h"
#include "emu_hopper.h"
#include "emu_wgmma.h"

#include <algorithm>
#include <csetjmp>
#include <csignal>
#include <cerrno>
#include <cstdarg>
#include <cstring>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include <sys/mman.h>
#include <ctime>
#include <ucontext.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#define EMU_API extern "C" __attribute__((visibility("default")))

namespace emu {
Builtins builtins;
void* dynamic_shared;
}  // namespace emu

// Bounds of this library's static __shared__ objects (null when it has none).
extern "C" unsigned char __start_emu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" unsigned char __stop_emu_shared[] __attribute__((weak, visibility("hidden")));

// ----------------------------------------------------------------------------
// the interface with the Python driver (mirrored by ctypes structures there)

enum Status : int {
    kOk = 0,
    kFault = 1,           // a signal: SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT
    kDeadlock = 2,        // threads wait for one another forever
    kWarpMisuse = 3,      // a warp collective used in a way a GPU leaves undefined
    kTrap = 4,            // __trap()
    kSharedOverrun = 5,   // a write into the slack around dynamic shared memory
    kResources = 6,       // mmap failed, or the CPU cannot do what the launch asks (-ftz=true)
    kTimeout = 7,         // the launch used more CPU time than its limit
};

// kWarpSkew: warps run one at a time, the last first, each as far as it can (its warp
// collectives complete as soon as its own lanes are there) before the next starts; lanes in
// descending order. Warps drift as far apart as barriers allow, which exposes a missing
// __syncthreads() between warps that meet at warp collectives in lockstep under the other orders.
enum Order : int { kAscending = 0, kDescending = 1, kShuffled = 2, kWarpSkew = 3 };
enum Where : int { kElsewhere = 0, kDynamicShared = 1, kStack = 2 };
enum Access : int { kUnknownAccess = 0, kRead = 1, kWrite = 2 };

struct EmuLaunchConfig {
    unsigned grid[3];
    unsigned block[3];
    std::uint64_t dynamic_shared_bytes;
    std::uint64_t stack_bytes;
    std::uint64_t seed;
    int order;
    int cp_async_eager;   // cp.async writes shared memory when issued instead of at its wait
    int flush_denormals;  // -ftz=true: subnormal operands and results are zero
    int count;            // fill EmuCounters (the module was built with counters=True)
    double time_limit;    // seconds of this thread's CPU time the launch may use (0: no limit)
};

// What a counted launch did (counters.py mirrors it and documents the model). One row per
// category of warp-wide memory instruction: requests (warp instructions), bytes (summed over
// lanes), cost (shared: wavefronts; global: 32-byte sectors) and ideal (the least that cost
// could be: one wavefront per non-empty phase; the sectors of the distinct bytes requested).
enum Category : int {
    kSharedLoad = 0, kSharedStore = 1, kLdmatrixCat = 2, kCpAsyncShared = 3,
    kGlobalLoad = 4, kGlobalStore = 5, kCpAsyncGlobal = 6, kCategories = 7,
};
struct EmuCounters {
    std::uint64_t access[kCategories][4];  // requests, bytes, cost, ideal
    std::uint64_t barriers;                // __syncthreads() completed, summed over CTAs
    std::uint64_t mma;                     // mma.sync executed, per warp
    std::uint64_t ctas;
    std::uint64_t warps;                   // warps launched, summed over CTAs
};

struct EmuLaunchReport {
    int status;
    int signal;
    int access;
    int where;
    std::uint64_t fault_address;
    int has_thread;
    unsigned block[3];
    unsigned thread[3];
    char message[2048];
};

namespace {

constexpr unsigned char kGarbage = 0xff;  // NaN in every float format, -1 in every integer
constexpr std::uint64_t kGarbagePayload = ~0ull;

std::size_t page_size() {
    static const std::size_t size = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    return size;
}

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

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
// fibers and their stacks

// kAtMbarrier: in mbarrier.try_wait.parity until the phase completes (Fiber::mbarrier);
// kAtNamed: in bar.sync until its named barrier completes; kAtWarpgroup: in setmaxnreg until the
// 128 threads of its warpgroup are there.
enum class State : unsigned char { kRunnable, kAtBarrier, kAtWarp, kAtMbarrier, kAtNamed, kAtWarpgroup, kDone };

struct Arrival {
    int kind;
    unsigned mask;
    std::uint64_t payload;  // this lane's value going in, the received value coming out
    int operand;            // warp_all_gather: the variant, which every lane must agree on
    int width;              // warp_all_gather: the record size in bytes
    const void* gather_src; // warp_all_gather: this lane's record
    void* gather_dst;       // warp_all_gather: where every lane's record goes (32 * width bytes)
};

// One cp.async copy in flight: its source bytes (read when issued) and where they land.
struct PendingCopy {
    unsigned char* dst;
    unsigned char data[16];
    int bytes;
    long group;   // -1 until cp.async.commit_group puts it in the thread's newest group
    bool landed;  // written already (cp_async_eager), still to be waited for
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
};

// An mbarrier object (emu_hopper.h): the state the PTX ISA describes, kept beside shared memory.
struct Mbarrier {
    unsigned phase;      // phases completed since init (its parity is what try_wait.parity tests)
    unsigned expected;   // the init count: arrivals each phase waits for
    unsigned pending;    // arrivals still to come in the current phase
    long tx;             // bytes expected (expect_tx) and not yet completed (complete_tx)
};

// One of a block's 16 named barriers (bar.sync / bar.arrive): the instance in progress.
struct NamedBarrier {
    unsigned count = 0;    // threads it waits for (0: no arrival yet)
    unsigned arrived = 0;
};

// Stacks outlive launches: mapping them is the costly part. Each mapping is a
// PROT_NONE guard page followed by the stack, so an overflow faults.
struct StackPool {
    std::size_t bytes = 0;
    std::vector<unsigned char*> mappings;

    bool reserve(std::size_t count, std::size_t stack_bytes) {
        stack_bytes = round_up(stack_bytes, page_size());
        if (stack_bytes != bytes) {
            release();
            bytes = stack_bytes;
        }
        while (mappings.size() < count) {
            void* m = mmap(nullptr, page_size() + bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) return false;
            mprotect(m, page_size(), PROT_NONE);
            mappings.push_back(static_cast<unsigned char*>(m));
        }
        return true;
    }

    void release() {
        for (unsigned char* m : mappings) munmap(m, page_size() + bytes);
        mappings.clear();
    }

    unsigned char* stack_lo(std::size_t i) const { return mappings[i] + page_size(); }

    bool in_guard(std::uintptr_t address) const {
        for (unsigned char* m : mappings) {
            auto lo = reinterpret_cast<std::uintptr_t>(m);
            if (address >= lo && address < lo + page_size()) return true;
        }
        return false;
    }
};

StackPool stacks;

// Dynamic shared memory: [guard][data pages][guard], the requested bytes end
// 16-byte aligned as close to the upper guard as alignment allows. The slack
// on either side stays filled with garbage; a write there is reported after
// the block.
struct SharedRegion {
    unsigned char* mapping = nullptr;
    std::size_t mapping_bytes = 0;
    unsigned char* data_lo = nullptr;  // first data page
    unsigned char* data_hi = nullptr;  // the upper guard page
    unsigned char* base = nullptr;
    std::size_t bytes = 0;

    bool map(std::size_t requested) {
        std::size_t page = page_size();
        std::size_t data = round_up(requested + 15, page);
        mapping_bytes = data + 2 * page;
        void* m = mmap(nullptr, mapping_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return false;
        mapping = static_cast<unsigned char*>(m);
        mprotect(mapping, page, PROT_NONE);
        mprotect(mapping + page + data, page, PROT_NONE);
        data_lo = mapping + page;
        data_hi = data_lo + data;
        bytes = requested;
        base = reinterpret_cast<unsigned char*>(reinterpret_cast<std::uintptr_t>(data_hi - requested) & ~std::uintptr_t{15});
        return true;
    }

    void unmap() {
        if (mapping) munmap(mapping, mapping_bytes);
        mapping = nullptr;
    }

    bool in_guard(std::uintptr_t address) const {
        auto lo = reinterpret_cast<std::uintptr_t>(mapping);
        auto hi = reinterpret_cast<std::uintptr_t>(data_hi);
        return mapping && ((address >= lo && address < lo + page_size()) || (address >= hi && address < hi + page_size()));
    }

    // Offset of the first byte outside [base, base + bytes) that is not garbage any more; -1 if none.
    long overrun() const {
        for (unsigned char* p = data_lo; p < base; ++p)
            if (*p != kGarbage) return static_cast<long>(p - base);
        for (unsigned char* p = base + bytes; p < data_hi; ++p)
            if (*p != kGarbage) return static_cast<long>(p - base);
        return -1;
    }
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
    NamedBarrier named[16];
    std::vector<unsigned> maxnreg;  // per warpgroup: the cap its last setmaxnreg set (0: none yet)
};

Launch* active = nullptr;

// ----------------------------------------------------------------------------
// counters: what a counted launch's warps ask of shared and global memory
//
// Only modules built with counters=True call note() for their plain loads and stores (g++'s
// -fsanitize=kernel-address instrumentation, whose callbacks are the __asan_* functions below);
// ldmatrix and cp.async call it in every build, and it returns at once unless the launch counts.
// A lane's n-th execution of one instruction (its site: the return address of the call) joins
// the n-th execution of that instruction by the other lanes of its warp: one warp-wide request,
// as SIMT execution of converged lanes issues it. At the end of each block every request is costed
// (evaluate) and added to the launch's totals. counters.py documents the model.

enum Op : int { kOpLoad = 0, kOpStore = 1, kOpLdmatrix = 2, kOpCpAsync = 3, kOpCpAsyncSource = 4 };

struct GlobalRegion {
    std::uintptr_t lo, hi, base;  // the mapped data pages, and where the argument's bytes start
};
std::vector<GlobalRegion> global_regions;  // every live emu_map_guarded buffer

EmuCounters last_counters;

struct SiteKey {
    std::uintptr_t site;
    int op;
    int space;  // 0: dynamic shared, 1: static shared, 2 + i: global_regions[i]
    bool operator==(const SiteKey& o) const { return site == o.site && op == o.op && space == o.space; }
};
struct SiteHash {
    std::size_t operator()(const SiteKey& k) const { return k.site * 1000003u ^ (k.op * 31u + k.space); }
};
struct Request {
    std::uint32_t mask = 0;
    int bytes = 0;
    std::int64_t offset[32];  // from the start of the space (shared window, argument buffer)
};
struct SiteLog {
    std::uint32_t next[32] = {};  // per lane: how many times it has executed the site
    std::vector<Request> requests;
};
struct Counting {
    EmuCounters totals{};
    std::vector<std::unordered_map<SiteKey, SiteLog, SiteHash>> warps;
};

void note(int op, std::uintptr_t site, std::uintptr_t address, int bytes) {
    Launch* l = active;
    if (!l || !l->counting || !l->current || bytes <= 0) return;
    int space;
    std::int64_t offset;
    const auto dyn_lo = reinterpret_cast<std::uintptr_t>(l->shared.data_lo);
    const auto dyn_hi = reinterpret_cast<std::uintptr_t>(l->shared.data_hi);
    const auto static_lo = reinterpret_cast<std::uintptr_t>(__start_emu_shared);
    const auto static_hi = reinterpret_cast<std::uintptr_t>(__stop_emu_shared);
    if (address >= dyn_lo && address < dyn_hi) {
        space = 0;
        offset = static_cast<std::int64_t>(address - reinterpret_cast<std::uintptr_t>(l->shared.base));
    } else if (static_lo && address >= static_lo && address < static_hi) {
        space = 1;
        offset = static_cast<std::int64_t>(address - static_lo);
    } else {
        space = -1;
        for (std::size_t i = 0; i < global_regions.size(); ++i) {
            const GlobalRegion& g = global_regions[i];
            if (address >= g.lo && address < g.hi) {
                space = 2 + static_cast<int>(i);
                offset = static_cast<std::int64_t>(address - g.base);
                break;
            }
        }
        if (space < 0) return;  // the stack (locals), kernel parameters: not memory traffic here
    }
    const Fiber& f = *l->current;
    SiteLog& log = l->counting->warps[f.warp][SiteKey{site, op, space}];
    const std::uint32_t n = log.next[f.lane]++;
    if (n >= log.requests.size()) log.requests.resize(n + 1);
    Request& r = log.requests[n];
    r.mask |= 1u << f.lane;
    r.bytes = std::max(r.bytes, bytes);
    r.offset[f.lane] = offset;
}

std::int64_t floor_div(std::int64_t a, std::int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Cost one warp-wide request (see counters.py): shared memory in wavefronts, phase by phase;
// global memory in 32-byte sectors.
void evaluate(EmuCounters& c, int op, int space, const Request& r) {
    int category;
    if (space < 2) {
        category = op == kOpLoad ? kSharedLoad : op == kOpStore ? kSharedStore
                   : op == kOpLdmatrix ? kLdmatrixCat : op == kOpCpAsync ? kCpAsyncShared : -1;
    } else {
        category = op == kOpLoad ? kGlobalLoad : op == kOpStore ? kGlobalStore
                   : op == kOpCpAsyncSource ? kCpAsyncGlobal : -1;
    }
    if (category < 0) return;
    std::uint64_t* row = c.access[category];
    row[0] += 1;
    row[1] += static_cast<std::uint64_t>(__builtin_popcount(r.mask)) * static_cast<std::uint64_t>(r.bytes);
    std::vector<std::int64_t> units;
    if (space < 2) {
        // lanes per phase: each 8x8 matrix of an ldmatrix (8 row addresses); else as many lanes as
        // 128 bytes hold (32 for accesses of up to 4 bytes, 16 for 8, 8 for 16)
        int width = 4;
        while (width < r.bytes) width *= 2;
        const int phase_lanes = op == kOpLdmatrix ? 8 : std::clamp(128 / width, 1, 32);
        for (int p0 = 0; p0 < 32; p0 += phase_lanes) {
            units.clear();
            for (int lane = p0; lane < p0 + phase_lanes; ++lane) {
                if (!((r.mask >> lane) & 1)) continue;
                const std::int64_t first = floor_div(r.offset[lane], 4);
                for (std::int64_t w = first; w <= floor_div(r.offset[lane] + r.bytes - 1, 4); ++w) units.push_back(w);
            }
            if (units.empty()) continue;
            std::sort(units.begin(), units.end());
            units.erase(std::unique(units.begin(), units.end()), units.end());
            int per_bank[32] = {};
            int wavefronts = 0;
            for (std::int64_t w : units) wavefronts = std::max(wavefronts, ++per_bank[((w % 32) + 32) % 32]);
            row[2] += static_cast<std::uint64_t>(wavefronts);
            row[3] += (units.size() + 31) / 32;
        }
    } else {
        std::vector<std::pair<std::int64_t, std::int64_t>> spans;
        for (int lane = 0; lane < 32; ++lane) {
            if (!((r.mask >> lane) & 1)) continue;
            spans.emplace_back(r.offset[lane], r.offset[lane] + r.bytes);
            const std::int64_t first = floor_div(r.offset[lane], 32);
            for (std::int64_t s = first; s <= floor_div(r.offset[lane] + r.bytes - 1, 32); ++s) units.push_back(s);
        }
        std::sort(units.begin(), units.end());
        units.erase(std::unique(units.begin(), units.end()), units.end());
        std::sort(spans.begin(), spans.end());
        std::int64_t distinct = 0, covered_to = INT64_MIN;
        for (auto [lo, hi] : spans) {
            lo = std::max(lo, covered_to);
            if (hi > lo) distinct += hi - lo;
            covered_to = std::max(covered_to, hi);
        }
        row[2] += units.size();
        row[3] += static_cast<std::uint64_t>((distinct + 31) / 32);
    }
}

// At the end of a block: cost its requests and forget them.
void flush_counts(Launch& l) {
    Counting& c = *l.counting;
    for (auto& warp : c.warps) {
        for (auto& [key, log] : warp)
            for (const Request& r : log.requests)
                if (r.mask) evaluate(c.totals, key.op, key.space, r);
        warp.clear();
    }
}

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

const char* collective_name(int kind) {
    switch (kind) {
        case emu::kSyncWarp: return "__syncwarp";
        case emu::kShflIdx: return "__shfl_sync";
        case emu::kShflUp: return "__shfl_up_sync";
        case emu::kShflDown: return "__shfl_down_sync";
        case emu::kShflXor: return "__shfl_xor_sync";
        case emu::kMma: return "mma.sync";
        case emu::kLdmatrix: return "ldmatrix.sync";
        case emu::kElect: return "elect.sync";
    }
    return "?";
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
    self.state = State::kDone;
    switch_context(self.context, active->scheduler);
    __builtin_unreachable();  // a finished fiber is never resumed
}

void block_until_scheduled(Fiber& self, State state) {
    self.state = state;
    switch_context(self.context, active->scheduler);
}

// The lane whose value `lane` receives, or `lane` itself where CUDA returns the caller's own value.
int source_lane(const Arrival& a, int lane) {
    int first = lane & ~(a.width - 1);  // first lane of this lane's width-wide segment
    long long src;
    switch (a.kind) {
        case emu::kShflIdx: return first + (a.operand & (a.width - 1));
        case emu::kShflUp:
            src = lane - static_cast<long long>(static_cast<unsigned>(a.operand));
            return src >= first ? static_cast<int>(src) : lane;
        case emu::kShflDown:
            src = lane + static_cast<long long>(static_cast<unsigned>(a.operand));
            return src < first + a.width ? static_cast<int>(src) : lane;
        case emu::kShflXor:  // earlier segments may be read, later ones give the caller's own value
            src = lane ^ a.operand;
            return src >= 0 && src < first + a.width ? static_cast<int>(src) : lane;
    }
    return lane;
}

// Complete every warp collective whose lanes have all arrived. Returns whether any did.
bool resolve_warps(Launch& l) {
    bool progressed = false;
    std::size_t n = l.fibers.size();
    for (std::size_t warp_first = 0; warp_first < n; warp_first += 32) {
        unsigned lanes = static_cast<unsigned>(std::min<std::size_t>(32, n - warp_first));
        Fiber* warp = &l.fibers[warp_first];
        std::uint32_t alive = 0, waiting = 0;
        for (unsigned lane = 0; lane < lanes; ++lane) {
            if (warp[lane].state != State::kDone) alive |= 1u << lane;
            if (warp[lane].state == State::kAtWarp) waiting |= 1u << lane;
        }
        std::uint32_t todo = waiting;
        while (todo) {
            int lead = __builtin_ctz(todo);
            const Arrival& a = warp[lead].arrival;
            // Lanes named in the mask that do not exist or have exited are left out, as a GPU does.
            std::uint32_t group = a.mask & alive;
            if ((group & waiting) != group) {  // someone is still on the way
                todo &= ~(1u << lead);
                continue;
            }
            const bool gather = a.kind == emu::kMma || a.kind == emu::kLdmatrix;
            if (gather && group != 0xffffffffu) {
                record_thread(warp[lead]);
                abandon(kWarpMisuse,
                        "warp %zu: %s needs all 32 lanes of the warp, but lanes 0x%08x have exited "
                        "or do not exist (.sync.aligned: every lane executes the same instruction)",
                        warp_first / 32, collective_name(a.kind), ~group);
            }
            for (std::uint32_t g = group; g; g &= g - 1) {
                const Arrival& b = warp[__builtin_ctz(g)].arrival;
                if (gather && b.kind == a.kind && (b.operand != a.operand || b.width != a.width)) {
                    record_thread(warp[lead]);
                    abandon(kWarpMisuse,
                            "warp %zu: lanes %d and %d execute different variants of %s "
                            "(.aligned: every lane must execute the same instruction)",
                            warp_first / 32, lead, __builtin_ctz(g), collective_name(a.kind));
                }
                if (b.kind != a.kind || b.mask != a.mask) {
                    record_thread(warp[lead]);
                    abandon(kWarpMisuse,
                            "warp %zu: lane %d is in %s(mask 0x%08x) while lane %d, named in that mask, "
                            "is in %s(mask 0x%08x); every lane named in a mask must execute the same "
                            "collective with the same mask",
                            warp_first / 32, lead, collective_name(a.kind), a.mask, __builtin_ctz(g),
                            collective_name(b.kind), b.mask);
                }
            }
            if (gather) {
                if (a.kind == emu::kMma && active->counting) ++active->counting->totals.mma;
                for (int to = 0; to < 32; ++to)
                    for (int from = 0; from < 32; ++from)
                        std::memcpy(static_cast<unsigned char*>(warp[to].arrival.gather_dst) + from * a.width,
                                    warp[from].arrival.gather_src, static_cast<std::size_t>(a.width));
                for (int lane = 0; lane < 32; ++lane) warp[lane].state = State::kRunnable;
                todo &= ~group;
                waiting &= ~group;
                progressed = true;
                continue;
            }
            std::uint64_t received[32];
            for (std::uint32_t g = group; g; g &= g - 1) {
                int lane = __builtin_ctz(g);
                if (a.kind == emu::kElect) {  // the lowest lane present, as the ISA's is deterministic
                    received[lane] = static_cast<std::uint64_t>(__builtin_ctz(group));
                    continue;
                }
                int src = source_lane(warp[lane].arrival, lane);
                // Reading a lane that is outside the mask is undefined on a GPU: garbage here.
                received[lane] = (group >> src) & 1 ? warp[src].arrival.payload : kGarbagePayload;
            }
            for (std::uint32_t g = group; g; g &= g - 1) {
                int lane = __builtin_ctz(g);
                warp[lane].arrival.payload = received[lane];
                warp[lane].state = State::kRunnable;
            }
            todo &= ~group;
            waiting &= ~group;
            progressed = true;
        }
    }
    return progressed;
}

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

void resolve_wgmma(Launch& l, std::size_t g, std::size_t first);  // emu_wgmma_runtime.inc
void wgmma_reset_block(Launch& l);

const char* warpgroup_instruction(int kind) { return kind == emu::kWarpgroupWgmma ? "wgmma.mma_async" : "setmaxnreg"; }

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

// Complete every setmaxnreg or wgmma.mma_async whose warpgroup has all arrived (emu_hopper.h,
// emu_wgmma.h). Returns whether any did.
bool resolve_warpgroups(Launch& l) {
    bool progressed = false;
    const std::size_t n = l.fibers.size();
    for (std::size_t g = 0; g * 128 < n; ++g) {
        const std::size_t first = g * 128, last = std::min(n, first + 128);
        std::size_t waiting = 0, alive = 0;
        const Fiber* lead = nullptr;
        for (std::size_t i = first; i < last; ++i) {
            const Fiber& f = l.fibers[i];
            alive += f.state != State::kDone;
            if (f.state == State::kAtWarpgroup && (++waiting, !lead)) lead = &f;
        }
        if (!waiting || waiting != alive) continue;
        if (last - first != 128 || alive != 128) {
            record_thread(*lead);
            abandon(kWarpMisuse,
                    "warpgroup %zu: %s needs the 128 threads of the warpgroup (4 warps from a warp index "
                    "divisible by 4), but %zu of them %s",
                    g, warpgroup_instruction(lead->arrival.kind), 128 - alive, last - first != 128 ? "do not exist (the block is not a multiple of 128 threads)"
                                                        : "have exited");
        }
        if (std::any_of(l.fibers.begin() + first, l.fibers.begin() + last,
                        [](const Fiber& f) { return f.arrival.kind == emu::kWarpgroupWgmma; })) {
            resolve_wgmma(l, g, first);
            progressed = true;
            continue;
        }
        for (std::size_t i = first; i < last; ++i) {
            const Fiber& f = l.fibers[i];
            if (f.arrival.operand != lead->arrival.operand || f.arrival.kind != lead->arrival.kind) {
                record_thread(f);
                abandon(kWarpMisuse,
                        "warpgroup %zu: setmaxnreg.%s %d in thread %u (warp %u) but setmaxnreg.%s %d in thread %u "
                        "(warp %u): every warp of a warpgroup must execute the same setmaxnreg",
                        g, f.arrival.kind ? "inc" : "dec", f.arrival.operand, f.tid.x, f.warp,
                        lead->arrival.kind ? "inc" : "dec", lead->arrival.operand, lead->tid.x, lead->warp);
            }
        }
        const unsigned regs = static_cast<unsigned>(lead->arrival.operand), before = l.maxnreg[g];
        const bool increase = lead->arrival.kind != 0;
        if (before && (increase ? regs < before : regs > before)) {
            record_thread(*lead);
            abandon(kWarpMisuse, "warpgroup %zu: setmaxnreg.%s %u after setmaxnreg set %u: .inc may not lower "
                    "the register cap and .dec may not raise it", g, increase ? "inc" : "dec", regs, before);
        }
        l.maxnreg[g] = regs;
        for (std::size_t i = first; i < last; ++i) l.fibers[i].state = State::kRunnable;
        progressed = true;
    }
    return progressed;
}

void order_pass(Launch& l) {
    std::vector<unsigned>& order = l.pass_order;
    for (unsigned i = 0; i < order.size(); ++i) order[i] = i;
    if (l.config->order == kDescending || l.config->order == kWarpSkew) std::reverse(order.begin(), order.end());
    if (l.config->order == kShuffled) std::shuffle(order.begin(), order.end(), l.rng);
}

void run_block(Launch& l) {
    if (__start_emu_shared) std::memset(__start_emu_shared, kGarbage, __stop_emu_shared - __start_emu_shared);
    std::memset(l.shared.data_lo, kGarbage, l.shared.data_hi - l.shared.data_lo);
    l.mbarriers.clear();
    for (NamedBarrier& b : l.named) b = NamedBarrier{};
    l.maxnreg.assign((l.fibers.size() + 127) / 128, 0);
    wgmma_reset_block(l);
    for (std::size_t i = 0; i < l.fibers.size(); ++i) {
        l.fibers[i].state = State::kRunnable;
        l.fibers[i].copies.clear();
        l.fibers[i].groups_committed = 0;
        l.fibers[i].context.prepare(stacks.stack_lo(i), stacks.bytes);
    }
    auto run = [&l](Fiber& f) {
        emu::builtins.thread_idx = f.tid;
        l.current = &f;
        switch_context(l.scheduler, f.context);
        l.current = nullptr;
    };
    for (;;) {
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
        bool done = true, runnable = false, all_at_barrier = true;
        for (const Fiber& f : l.fibers) {
            done &= f.state == State::kDone;
            runnable |= f.state == State::kRunnable;
            all_at_barrier &= f.state == State::kDone || f.state == State::kAtBarrier;
        }
        if (done) break;
        if (runnable) continue;
        if (!all_at_barrier) report_deadlock(l);
        if (l.counting) ++l.counting->totals.barriers;
        for (Fiber& f : l.fibers)
            if (f.state == State::kAtBarrier) f.state = State::kRunnable;
    }
    if (l.counting) {
        flush_counts(l);
        ++l.counting->totals.ctas;
        l.counting->totals.warps += (l.fibers.size() + 31) / 32;
    }
    long overrun = l.shared.overrun();
    if (overrun >= 0) {
        abandon(kSharedOverrun,
                "block (%u,%u,%u) wrote dynamic shared memory at byte offset %ld, outside the %zu bytes "
                "the launch requested (found after the block ended; the writing thread is unknown)",
                emu::builtins.block_idx.x, emu::builtins.block_idx.y, emu::builtins.block_idx.z, overrun,
                l.shared.bytes);
    }
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
    for (std::size_t b : block_order) {
        emu::builtins.block_idx = uint3{static_cast<unsigned>(b % c.grid[0]),
                                        static_cast<unsigned>(b / c.grid[0] % c.grid[1]),
                                        static_cast<unsigned>(b / (std::size_t{c.grid[0]} * c.grid[1]))};
        run_block(l);
    }
}

// ----------------------------------------------------------------------------
// signals

constexpr int kCaught[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction previous[std::size(kCaught)];
stack_t previous_altstack;

// The launch's time limit: a CPU-time timer of the launching thread, signalling that thread only
// (fibers never preempt one another, so a thread spinning on a flag that another thread sets
// would otherwise hang the launch).
constexpr int kTimerSignal = SIGVTALRM;
#ifndef sigev_notify_thread_id
#define sigev_notify_thread_id _sigev_un._tid
#endif

void on_timer(int, siginfo_t*, void*) {
    if (!active) return;
    if (active->current) record_thread(*active->current);
    std::snprintf(active->report->message, sizeof active->report->message,
                  "the launch ran past its time limit of %g s of CPU time (EmulatedModule's time_limit); "
                  "a thread that spins on memory another thread writes never lets that thread run here "
                  "(fibers are cooperative: wait with a barrier or mbarrier instead)",
                  active->config->time_limit);
    siglongjmp(active->escape, kTimeout);
}

void on_signal(int sig, siginfo_t* info, void* context) {
    if (!active) {  // not raised by a kernel: hand it to whoever handled it before us
        for (std::size_t i = 0; i < std::size(kCaught); ++i)
            if (kCaught[i] == sig) sigaction(sig, &previous[i], nullptr);
        return;
    }
    EmuLaunchReport& r = *active->report;
    auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
    r.signal = sig;
    r.fault_address = address;
#if defined(__x86_64__)
    if (sig == SIGSEGV) {  // bit 1 of the page-fault error code: the access was a write
        auto* uc = static_cast<ucontext_t*>(context);
        r.access = (uc->uc_mcontext.gregs[REG_ERR] & 2) ? kWrite : kRead;
    }
#else
    (void)context;
#endif
    if (active->shared.in_guard(address)) r.where = kDynamicShared;
    else if (stacks.in_guard(address)) r.where = kStack;
    if (active->current) record_thread(*active->current);
    siglongjmp(active->escape, kFault);
}

// The floating-point control state, and the bits that make it flush subnormal operands and results
// to zero. x86's MXCSR (FTZ, DAZ) and AArch64's FPCR.FZ apply to double as well as float, where
// -ftz=true flushes float only.
#if defined(__x86_64__) || defined(__i386__)
unsigned float_control() { return _mm_getcsr(); }
void set_float_control(unsigned c) { _mm_setcsr(c); }
constexpr unsigned kFlushToZero = 0x8040;  // FTZ | DAZ
#elif defined(__aarch64__)
unsigned float_control() { return __builtin_aarch64_get_fpcr(); }
void set_float_control(unsigned c) { __builtin_aarch64_set_fpcr(c); }
constexpr unsigned kFlushToZero = 1u << 24;  // FZ
#else
unsigned float_control() { return 0; }
void set_float_control(unsigned) {}
constexpr unsigned kFlushToZero = 0;  // unknown here: a launch asking for it fails
#endif

void install_handlers() {
    static unsigned char* altstack = nullptr;
    const std::size_t altstack_bytes = 64 * 1024;
    if (!altstack) altstack = static_cast<unsigned char*>(mmap(nullptr, altstack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    stack_t ss{};
    ss.ss_sp = altstack;
    ss.ss_size = altstack_bytes;
    sigaltstack(&ss, &previous_altstack);
    struct sigaction action {};
    action.sa_sigaction = &on_signal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    for (std::size_t i = 0; i < std::size(kCaught); ++i) sigaction(kCaught[i], &action, &previous[i]);
}

void restore_handlers() {
    for (std::size_t i = 0; i < std::size(kCaught); ++i) sigaction(kCaught[i], &previous[i], nullptr);
    sigaltstack(&previous_altstack, nullptr);
}

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

void emu::warp_all_gather(int kind, int variant, const void* mine, void* all, int bytes) {
    Fiber& self = *active->current;
    self.arrival = Arrival{kind, 0xffffffffu, 0, variant, bytes, mine, all};
    block_until_scheduled(self, State::kAtWarp);
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
    if (copy.landed) std::memcpy(copy.dst, copy.data, static_cast<std::size_t>(bytes));
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
        else if (!c.landed) std::memcpy(c.dst, c.data, static_cast<std::size_t>(c.bytes));
    }
    self.copies.resize(kept);
}

void emu::record_access(int op, const void* address, int bytes) {
    if (active && active->counting)
        note(op, reinterpret_cast<std::uintptr_t>(__builtin_return_address(0)),
             reinterpret_cast<std::uintptr_t>(address), bytes);
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
    note(kOpStore, reinterpret_cast<std::uintptr_t>(__builtin_return_address(0)), a, static_cast<int>(n));
}
extern "C" void __asan_handle_no_return() {}

void emu::trap(const char* why) {
    if (active->current) record_thread(*active->current);
    abandon(kTrap, "%s", why);
}

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

Mbarrier& mbarrier_at(void* bar, const char* what) {
    emu::check_shared(bar, 8, 8, what);
    auto it = active->mbarriers.find(reinterpret_cast<std::uintptr_t>(bar));
    if (it == active->mbarriers.end())
        misuse("%s: the mbarrier at %s was not initialised (mbarrier.init) in this block", what,
               shared_place(reinterpret_cast<std::uintptr_t>(bar)).c_str());
    return it->second;
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
    active->mbarriers[address] = Mbarrier{0, count, count, 0};
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
    Mbarrier& b = mbarrier_at(bar, "mbarrier.try_wait.parity");
    Fiber& self = *active->current;
    if ((b.phase & 1u) == (parity & 1u)) {  // the phase of this parity is the current one: not complete
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
        for (Fiber& f : active->fibers)
            if (f.state == State::kAtNamed && f.named_id == id) f.state = State::kRunnable;
        b = NamedBarrier{};
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

#include "emu_wgmma_runtime.inc"

// ----------------------------------------------------------------------------
// what Python calls

EMU_API std::uint64_t emu_page_size() { return page_size(); }

// A buffer of `bytes` between two PROT_NONE pages, flush against the upper one
// (at_end != 0) or the lower one. The rest of its pages is filled with garbage
// so the driver can tell whether a kernel wrote there.
EMU_API std::uint64_t emu_map_guarded(std::uint64_t bytes, int at_end, std::uint64_t* mapping, std::uint64_t* mapping_bytes) {
    std::size_t page = page_size();
    std::size_t data = round_up(bytes, page);
    void* m = mmap(nullptr, data + 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return 0;
    auto* lo = static_cast<unsigned char*>(m);
    mprotect(lo, page, PROT_NONE);
    mprotect(lo + page + data, page, PROT_NONE);
    std::memset(lo + page, kGarbage, data);
    *mapping = reinterpret_cast<std::uint64_t>(lo);
    *mapping_bytes = data + 2 * page;
    unsigned char* start = at_end ? lo + page + data - bytes : lo + page;
    global_regions.push_back({reinterpret_cast<std::uintptr_t>(lo + page),
                              reinterpret_cast<std::uintptr_t>(lo + page + data), reinterpret_cast<std::uintptr_t>(start)});
    return reinterpret_cast<std::uint64_t>(start);
}

EMU_API void emu_unmap(std::uint64_t mapping, std::uint64_t mapping_bytes) {
    const std::uintptr_t data_lo = static_cast<std::uintptr_t>(mapping) + page_size();
    global_regions.erase(std::remove_if(global_regions.begin(), global_regions.end(),
                                        [&](const GlobalRegion& g) { return g.lo == data_lo; }),
                         global_regions.end());
    munmap(reinterpret_cast<void*>(mapping), mapping_bytes);
}

EMU_API int emu_launch(void (*entry)(void**), void** argv, const EmuLaunchConfig* config, EmuLaunchReport* report) {
    std::memset(report, 0, sizeof *report);
    Launch l;
    l.entry = entry;
    l.argv = argv;
    l.config = config;
    l.report = report;
    l.rng.seed(config->seed);
    if (config->flush_denormals && !kFlushToZero) {
        std::snprintf(report->message, sizeof report->message,
                      "-ftz=true: flushing subnormals to zero is not implemented for this CPU");
        return report->status = kResources;
    }
    std::size_t threads = std::size_t{config->block[0]} * config->block[1] * config->block[2];
    if (!stacks.reserve(threads, config->stack_bytes) || !l.shared.map(config->dynamic_shared_bytes)) {
        std::snprintf(report->message, sizeof report->message, "mmap failed for %zu fiber stacks (%s)", threads,
                      std::strerror(errno));
        return report->status = kResources;
    }
    emu::dynamic_shared = l.shared.base;
    install_handlers();
    timer_t timer{};
    bool timed = false;
    struct sigaction previous_timer_action {};
    if (config->time_limit > 0) {
        struct sigaction action {};
        action.sa_sigaction = &on_timer;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        sigaction(kTimerSignal, &action, &previous_timer_action);
        sigevent event{};
        event.sigev_notify = SIGEV_THREAD_ID;
        event.sigev_signo = kTimerSignal;
        event.sigev_notify_thread_id = static_cast<pid_t>(gettid());
        timed = timer_create(CLOCK_THREAD_CPUTIME_ID, &event, &timer) == 0;
        if (timed) {
            itimerspec limit{};
            limit.it_value.tv_sec = static_cast<time_t>(config->time_limit);
            const double fraction = config->time_limit - static_cast<double>(limit.it_value.tv_sec);
            limit.it_value.tv_nsec = static_cast<long>(fraction * 1e9);
            timer_settime(timer, 0, &limit, nullptr);
        }
    }
    // Before run_grid: the fibers' contexts (ucontext) are made from the thread's state as it is then.
    const unsigned float_state = float_control();
    if (config->flush_denormals) set_float_control(float_state | kFlushToZero);
    Counting counting;
    if (config->count) {
        counting.warps.resize((threads + 31) / 32);
        l.counting = &counting;
    }
    active = &l;
    int status = sigsetjmp(l.escape, 1);
    if (status == kOk) run_grid(l);
    active = nullptr;
    set_float_control(float_state);
    if (timed) timer_delete(timer);
    if (config->time_limit > 0) sigaction(kTimerSignal, &previous_timer_action, nullptr);
    restore_handlers();
    l.shared.unmap();
    last_counters = counting.totals;
    return report->status = status;
}

// Unmap this module's fiber stacks. Every module is its own shared library with its own pool, and a
// pool of 1,024 stacks holds 2,048 of the process's 65,530 mappings (vm.max_map_count): the driver
// calls this on the module that launched last whenever another one launches, so that a process that
// loads hundreds of modules (one pytest worker) holds one module's stacks, not all of them.
EMU_API void emu_release_stacks() { stacks.release(); }

// The counters of the last launch (zero unless it was a counted one).
EMU_API void emu_counters(EmuCounters* out) { *out = last_counters; }
