// runtime/counters.h: the room of the performance counters.
//
// Part of runtime.cpp, a unity build: runtime.cpp includes its parts, in order, into one
// translation unit (one object, compiled once per toolchain, as before the split); include
// it nowhere else. It uses what the parts before it declare.
//
// note() joins each lane's memory access into warp-wide requests, evaluate() costs them (shared
// wavefronts, global sectors), flush_counts() at the end of a block. counters.py mirrors EmuCounters
// and documents the model.

namespace {

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

}  // namespace
