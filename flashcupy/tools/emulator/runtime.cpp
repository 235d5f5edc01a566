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
//                        warpgroup is there (wgmma: runtime/wgmma.h);
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
//
// This file holds the interface with the Python driver (the structures driver.py's abi.py
// mirrors) and the functions Python calls (emu_launch, the guarded argument buffers); the rest
// is in runtime/, one room a part, included below into this one translation unit (a unity build:
// the driver compiles runtime.cpp alone, once per toolchain, and every part shares its anonymous
// namespace): memory.h (guarded stacks and shared memory), fibers.h (the threads and their
// switching), counters.h, warps.h (warp and warpgroup collectives), scheduler.h (blocks, passes,
// barriers, deadlocks), signals.h (faults, the time limit, flush-to-zero), kernel_api.h (what a
// kernel calls), hopper.h (the sm_90 synchronisation model), wgmma.h (wgmma), proxy.h (the async
// proxy: which thread's ordinary shared-memory writes are fenced for wgmma and TMA), tma.h (TMA, and
// flags between blocks) and grid.h (the grid: blocks in order, and blocks parked on flags).

#include <memory>  // before cuda_emu.h, whose __noinline__ macro breaks libstdc++'s <memory>

#define EMU_RUNTIME 1  // emu_hopper.h: the runtime is not a kernel module
#include "cuda_emu.h"
#include "emu_hopper.h"
#include "emu_wgmma.h"
#include "emu_tma.h"

#include <algorithm>
#include <csetjmp>
#include <csignal>
#include <cerrno>
#include <cstdarg>
#include <cstring>
#include <functional>
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
// the interface with the Python driver (mirrored by ctypes structures in abi.py)

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
// The TMA rows (runtime/tma.h) count a box as one request: the bytes it writes to (load) or reads
// from (store) shared memory, at 128 bytes a wavefront; the global sectors its in-bounds elements
// fall in.
enum Category : int {
    kSharedLoad = 0, kSharedStore = 1, kLdmatrixCat = 2, kCpAsyncShared = 3,
    kGlobalLoad = 4, kGlobalStore = 5, kCpAsyncGlobal = 6,
    kTmaLoadShared = 7, kTmaLoadGlobal = 8, kTmaStoreShared = 9, kTmaStoreGlobal = 10, kCategories = 11,
};
struct EmuCounters {
    std::uint64_t access[kCategories][4];  // requests, bytes, cost, ideal
    std::uint64_t barriers;                // __syncthreads() completed, summed over CTAs
    std::uint64_t mma;                     // mma.sync executed, per warp
    std::uint64_t ctas;
    std::uint64_t warps;                   // warps launched, summed over CTAs
    // sm_90 (runtime/wgmma.h, hopper.h) and the softmax's exponentials (emu_tensor_core.h)
    std::uint64_t wgmma;                   // wgmma.mma_async issued, per warpgroup
    std::uint64_t wgmma_rs;                // of them, with A from registers
    std::uint64_t wgmma_flops;             // 2 * 64 * N * 16 each
    std::uint64_t wgmma_shared_bytes;      // operand bytes read from shared memory: A (SS only) and B
    std::uint64_t mbarrier_waits;          // mbarrier.try_wait executed, per thread
    std::uint64_t mbarrier_blocked;        // of them, those whose phase had not completed: they blocked
    std::uint64_t named_barriers;          // named-barrier instances completed (bar.sync / bar.arrive)
    std::uint64_t ex2;                     // ex2.approx executed, per thread
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

// ----------------------------------------------------------------------------
// the parts, in the order they build on one another (each names its room)

#include "runtime/memory.h"
#include "runtime/fibers.h"
#include "runtime/counters.h"
#include "runtime/warps.h"
#include "runtime/scheduler.h"
#include "runtime/signals.h"
#include "runtime/kernel_api.h"
#include "runtime/hopper.h"
#include "runtime/wgmma.h"
#include "runtime/proxy.h"
#include "runtime/tma.h"
#include "runtime/grid.h"

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
    TimeLimit time_limit;
    time_limit.start(config->time_limit);
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
    time_limit.stop();
    restore_handlers();
    l.shared.unmap();
    last_counters = counting.totals;
    return report->status = status;
}

// Unmap this module's fiber stacks. Every module is its own shared library with its own pool, and a
// pool of 1,024 stacks holds 2,048 of the process's 65,530 mappings (vm.max_map_count): the driver
// calls this on the module that launched last whenever another one launches, so that a process that
// loads hundreds of modules (one pytest worker) holds one module's stacks, not all of them.
EMU_API void emu_release_stacks() {
    release_parked_stacks();
    stacks.release();
}

// The counters of the last launch (zero unless it was a counted one).
EMU_API void emu_counters(EmuCounters* out) { *out = last_counters; }
