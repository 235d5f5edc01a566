// runtime/warps.h: the room of warp and warpgroup collectives.
//
// Part of runtime.cpp, a unity build: runtime.cpp includes its parts, in order, into one
// translation unit (one object, compiled once per toolchain, as before the split); include
// it nowhere else. It uses what the parts before it declare.
//
// Completing the collectives whose lanes have all arrived: __syncwarp, the shuffles, elect.sync,
// the warp-wide gathers of mma.sync and ldmatrix (resolve_warps), and setmaxnreg's warpgroup
// rendezvous (resolve_warpgroups); the scheduler calls both after every pass.

namespace {

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
                // once, into lane 0's buffer: the lanes read it before any of them can complete the
                // warp's next meeting, which needs all 32 there
                std::vector<unsigned char>& all = warp[0].gathered;
                const std::size_t records = 32 * static_cast<std::size_t>(a.width);
                all.resize(records + a.payload);
                std::memset(all.data() + records, 0, a.payload);
                for (int from = 0; from < 32; ++from)
                    std::memcpy(all.data() + from * a.width, warp[from].arrival.gather_src, static_cast<std::size_t>(a.width));
                for (int to = 0; to < 32; ++to) warp[to].arrival.gather_dst = all.data();
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

void resolve_wgmma(Launch& l, std::size_t g, std::size_t first);  // runtime/wgmma.h
void wgmma_reset_block(Launch& l);
void proxy_reset_block(Launch& l);  // runtime/proxy.h

const char* warpgroup_instruction(int kind) { return kind == emu::kWarpgroupWgmma ? "wgmma.mma_async" : "setmaxnreg"; }

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
                    g, warpgroup_instruction(lead->arrival.kind), 128 - alive,
                    last - first != 128 ? "do not exist (the block is not a multiple of 128 threads)" : "have exited");
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

}  // namespace
