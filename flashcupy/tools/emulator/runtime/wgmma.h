// runtime/wgmma.h: the room of the wgmma model (include/emu_wgmma.h says what it models).
//
// Part of runtime.cpp, a unity build, included after runtime/hopper.h; include it nowhere else.
// It uses the parts' Launch, Fiber, record_thread, abandon, in_shared and the warpgroup rendezvous
// of warps.h's resolve_warpgroups, which hands a completed wgmma meeting to resolve_wgmma here.

#include <limits>

namespace {

// One decoded descriptor: an operand of rows x 16 elements in shared memory.
struct WgmmaOperand {
    std::uint32_t start;  // shared-window address
    std::uint32_t lbo, sbo;
    unsigned span;        // swizzle span in bytes: 16 (none), 32, 64, 128
    bool mn_major;
    int rows;             // 64 for A, N for B
};

// A wgmma.mma_async as the warpgroup issued it: one record that the 128 threads share.
struct WgmmaOp {
    int users;  // threads whose share is still in flight (0: the slot is free)
    int format, n;
    bool rs;
    WgmmaOperand a, b;  // a unused when rs
    std::uint16_t a_regs[64][16];  // rs: A gathered from the warpgroup's registers
    unsigned long epoch;  // the block's barrier epoch when it was issued (proxy.h's ordering check)
};

// One thread's share of an operation in flight.
struct WgmmaPending {
    std::size_t op;  // in wgmma_ops
    float* d;
    bool scale_d;
    bool chained;   // its input is the result of the previous operation in flight into the same d
    long group;     // -1 until wgmma.commit_group
    float c[128];   // the accumulator input (scale-d), taken at issue or from the chained result
};

struct WgmmaThread {
    std::vector<WgmmaPending> pending;
    long groups_committed = 0;
    bool fenced = false;
    bool waited = false;  // has executed a wgmma.wait_group
};

std::vector<WgmmaThread> wgmma_threads;  // per fiber of the block running
std::vector<WgmmaOp> wgmma_ops;          // the block's operations in flight, and free slots

void wgmma_reset_block(Launch& l) {
    wgmma_threads.assign(l.fibers.size(), WgmmaThread{});
    wgmma_ops.clear();
}

std::size_t wgmma_new_op() {
    for (std::size_t i = 0; i < wgmma_ops.size(); ++i)
        if (wgmma_ops[i].users == 0) return i;
    wgmma_ops.emplace_back();
    return wgmma_ops.size() - 1;
}

WgmmaThread& wgmma_self() { return wgmma_threads[static_cast<std::size_t>(active->current - active->fibers.data())]; }

// The two windows of smem_address (emu_wgmma.h): dynamic shared memory from 0, static after it.
std::uintptr_t dynamic_window_lo() { return reinterpret_cast<std::uintptr_t>(active->shared.data_lo); }
std::uintptr_t dynamic_window_bytes() {
    return reinterpret_cast<std::uintptr_t>(active->shared.data_hi) - dynamic_window_lo();
}
std::uintptr_t static_window_lo() { return reinterpret_cast<std::uintptr_t>(__start_emu_shared) & ~std::uintptr_t{1023}; }
std::uintptr_t static_window_base() { return (dynamic_window_bytes() + 1023) & ~std::uintptr_t{1023}; }

// The host pointer of `bytes` at shared-window address `address`, or null if they are not shared memory.
const unsigned char* window_pointer(std::uint64_t address, int bytes) {
    std::uintptr_t p;
    if (address + bytes <= dynamic_window_bytes()) {
        p = dynamic_window_lo() + address;
    } else if (__start_emu_shared && address >= static_window_base()) {
        p = static_window_lo() + (address - static_window_base());
    } else {
        return nullptr;
    }
    return in_shared(p, p + static_cast<std::uintptr_t>(bytes)) ? reinterpret_cast<const unsigned char*>(p) : nullptr;
}

const char* wgmma_format_name(int format) { return format ? "bf16" : "f16"; }

std::string describe(const emu::WgmmaIssue& x) {
    char text[256];
    if (x.rs)
        std::snprintf(text, sizeof text, "m64n%dk16.f32.%s (RS, desc-b 0x%016llx, scale-d %d, trans-b %d)", x.n,
                      wgmma_format_name(x.format), x.desc_b, x.scale_d, x.trans_b);
    else
        std::snprintf(text, sizeof text,
                      "m64n%dk16.f32.%s (SS, desc-a 0x%016llx, desc-b 0x%016llx, scale-d %d, trans-a %d, trans-b %d)",
                      x.n, wgmma_format_name(x.format), x.desc_a, x.desc_b, x.scale_d, x.trans_a, x.trans_b);
    return text;
}

bool same_instruction(const emu::WgmmaIssue& x, const emu::WgmmaIssue& y) {
    return x.format == y.format && x.n == y.n && x.rs == y.rs && x.trans_b == y.trans_b && x.scale_d == y.scale_d &&
           x.desc_b == y.desc_b && (x.rs || (x.trans_a == y.trans_a && x.desc_a == y.desc_a));
}

// Byte address (before the swizzle) of element (mn, k) of an operand: hopper.cuh's layouts.
std::uint64_t unswizzled(const WgmmaOperand& o, int mn, int k) {
    const std::uint64_t s = o.start;
    if (!o.mn_major) {
        if (o.span == 16) return s + (mn % 8) * 16 + (mn / 8) * std::uint64_t{o.sbo} + (k / 8) * std::uint64_t{o.lbo} + (k % 8) * 2;
        return s + (mn % 8) * o.span + (mn / 8) * std::uint64_t{o.sbo} + k * 2;
    }
    if (o.span == 16) return s + (mn % 8) * 2 + (mn / 8) * std::uint64_t{o.sbo} + (k % 8) * 16 + (k / 8) * std::uint64_t{o.lbo};
    const int per_row = static_cast<int>(o.span / 2);
    return s + (mn % per_row) * 2 + (mn / per_row) * std::uint64_t{o.lbo} + (k % 8) * o.span + (k / 8) * std::uint64_t{o.sbo};
}

// The swizzle: the 16-byte chunk bits [4, 4 + b) XOR the bits [7, 7 + b), b = log2(span / 16).
std::uint64_t swizzled(const WgmmaOperand& o, std::uint64_t address) {
    if (o.span == 16) return address;
    const std::uint64_t mask = o.span / 16 - 1;
    return address ^ (((address >> 7) & mask) << 4);
}

// The host pointer of window address `address`, which decode() checked lies in this block's shared memory.
const unsigned char* window_host(std::uint64_t address) {
    return reinterpret_cast<const unsigned char*>(address < dynamic_window_bytes()
        ? dynamic_window_lo() + address : static_window_lo() + (address - static_window_base()));
}

// The first byte of `bytes` at window address w that `reader` may not read through the async proxy (a
// generic write pending on it: runtime/proxy.h's rule), or -1.
long proxy_async_blocked(std::uint64_t w, std::size_t bytes, const Fiber& reader, unsigned long issued);

// Read through the async proxy by `reader`'s share of `op` (runtime/proxy.h checks it; the message, which
// names the operand, written only for a read that fails).
std::uint16_t element(const WgmmaOp& op, const WgmmaOperand& o, int mn, int k, const Fiber& reader) {
    std::uint16_t e;
    const std::uint64_t w = swizzled(o, unswizzled(o, mn, k));
    const unsigned char* p = window_host(w);
    if (proxy_async_blocked(w, 2, reader, op.epoch) >= 0) {
        char what[96];
        std::snprintf(what, sizeof what, "wgmma.mma_async m64n%dk16 (operand %s, completing at wgmma.wait_group)",
                      op.n, &o == &op.a ? "A" : "B");
        proxy_async_read(reinterpret_cast<std::uintptr_t>(p), 2, reader, what, op.epoch);  // ends the launch
    }
    std::memcpy(&e, p, 2);
    return e;
}

// Decode and check one descriptor (of A or B, `rows` rows); on a misuse, end the launch naming `who`.
WgmmaOperand decode(unsigned long long desc, bool mn_major, int rows, const char* which, const Fiber& who) {
    auto fail = [&](const char* format, auto... args) {
        char why[512];
        std::snprintf(why, sizeof why, format, args...);
        record_thread(who);
        abandon(kTrap, "wgmma.mma_async: the descriptor of %s (0x%016llx) %s", which, desc, why);
    };
    constexpr unsigned long long kFields = 0x3FFFull | 0x3FFFull << 16 | 0x3FFFull << 32 | 0x7ull << 49 | 0x3ull << 62;
    if (desc & ~kFields) fail("sets reserved bits 0x%016llx", desc & ~kFields);
    WgmmaOperand o;
    o.start = static_cast<std::uint32_t>(desc & 0x3FFF) << 4;
    o.lbo = static_cast<std::uint32_t>(desc >> 16 & 0x3FFF) << 4;
    o.sbo = static_cast<std::uint32_t>(desc >> 32 & 0x3FFF) << 4;
    const unsigned base_offset = static_cast<unsigned>(desc >> 49 & 7), mode = static_cast<unsigned>(desc >> 62);
    static const unsigned kSpan[4] = {16, 128, 64, 32};
    o.span = kSpan[mode];
    o.mn_major = mn_major;
    o.rows = rows;
    if (base_offset)
        fail("has base offset %u: not modelled (align the tile to its swizzle's %u-byte repeat and keep it 0)",
             base_offset, 8 * o.span);
    if (o.span > 16 && o.start % (8 * o.span) >= o.span)
        fail("starts at shared address 0x%x, %u bytes into the %uB swizzle's %u-byte repeat: a tile must start at a "
             "multiple of %u bytes (plus less than %u, a K step inside the first row)",
             o.start, o.start % (8 * o.span), o.span, 8 * o.span, 8 * o.span, o.span);
    // SBO steps 8-row groups of mn (K-major, MN-major unswizzled) or the two 8-row halves of k
    // (MN-major swizzled); LBO the two 8-column halves of k (unswizzled) or atoms of mn (MN-major swizzled)
    const bool uses_sbo = (o.mn_major && o.span > 16) || rows > 8;
    const bool uses_lbo = o.span == 16 || (o.mn_major && rows > static_cast<int>(o.span / 2));
    if (uses_sbo && o.sbo == 0) fail("has SBO 0, which its %s layout uses", o.mn_major ? "MN-major" : "K-major");
    if (uses_lbo && o.lbo == 0) fail("has LBO 0, which its %s layout uses", o.mn_major ? "MN-major" : "K-major");
    for (int mn = 0; mn < rows; ++mn)
        for (int k = 0; k < 16; ++k) {
            const std::uint64_t at = swizzled(o, unswizzled(o, mn, k));
            if (!window_pointer(at, 2))
                fail("puts element (%d, %d) at shared address 0x%llx, outside this block's shared memory", mn, k,
                     static_cast<unsigned long long>(at));
        }
    return o;
}

// Every thread of warpgroup g (fibers first .. first + 127) waits in wgmma.mma_async: issue it.
void resolve_wgmma(Launch& l, std::size_t g, std::size_t first) {
    const Fiber& lead = l.fibers[first];
    for (std::size_t i = first; i < first + 128; ++i) {
        const Fiber& f = l.fibers[i];
        const Fiber& w = f.arrival.kind == emu::kWarpgroupWgmma ? lead : f;
        if (f.arrival.kind != emu::kWarpgroupWgmma || lead.arrival.kind != emu::kWarpgroupWgmma) {
            record_thread(w);
            abandon(kWarpMisuse, "warpgroup %zu: thread %u (warp %u) is in %s while thread %u (warp %u) is in %s: "
                    "every warp of a warpgroup must execute the same instruction", g, f.tid.x, f.warp,
                    f.arrival.kind == emu::kWarpgroupWgmma ? "wgmma.mma_async" : "setmaxnreg", lead.tid.x, lead.warp,
                    lead.arrival.kind == emu::kWarpgroupWgmma ? "wgmma.mma_async" : "setmaxnreg");
        }
    }
    const auto& x = *static_cast<const emu::WgmmaIssue*>(lead.arrival.gather_src);
    for (std::size_t i = first; i < first + 128; ++i) {
        const Fiber& f = l.fibers[i];
        const auto& y = *static_cast<const emu::WgmmaIssue*>(f.arrival.gather_src);
        if (!same_instruction(x, y)) {
            record_thread(f);
            abandon(kWarpMisuse, "warpgroup %zu: thread %u (warp %u) issues wgmma.mma_async.%s but thread %u (warp %u) "
                    "issues wgmma.mma_async.%s: every warp of a warpgroup must issue the same wgmma",
                    g, f.tid.x, f.warp, describe(y).c_str(), lead.tid.x, lead.warp, describe(x).c_str());
        }
    }
    const std::size_t slot = wgmma_new_op();
    WgmmaOp* op = &wgmma_ops[slot];
    op->users = 128;
    op->format = x.format;
    op->n = x.n;
    op->rs = x.rs != 0;
    op->epoch = l.barrier_epoch;
    if (!op->rs) op->a = decode(x.desc_a, x.trans_a != 0, 64, "A", lead);
    op->b = decode(x.desc_b, x.trans_b != 0, x.n, "B", lead);
    if (l.counting) {  // one wgmma of the warpgroup: its FLOPs and the 16-bit operands it reads from shared memory
        EmuCounters& c = l.counting->totals;
        ++c.wgmma;
        c.wgmma_rs += op->rs;
        c.wgmma_flops += 2ull * 64 * static_cast<unsigned>(x.n) * 16;
        c.wgmma_shared_bytes += (op->rs ? 0 : 64 * 16 * 2) + static_cast<unsigned>(x.n) * 16 * 2;
    }
    if (op->rs) {  // hopper.cuh's A fragment: per warp, mma.sync m16n8k16's
        for (std::size_t i = first; i < first + 128; ++i) {
            const Fiber& f = l.fibers[i];
            const auto& y = *static_cast<const emu::WgmmaIssue*>(f.arrival.gather_src);
            const int r = 16 * static_cast<int>(f.warp % 4) + static_cast<int>(f.lane / 4), c = 2 * static_cast<int>(f.lane % 4);
            for (int j = 0; j < 4; ++j) {
                const int row = r + 8 * (j & 1), col = c + 8 * (j >> 1);
                op->a_regs[row][col] = static_cast<std::uint16_t>(y.a[j] & 0xffffu);
                op->a_regs[row][col + 1] = static_cast<std::uint16_t>(y.a[j] >> 16);
            }
        }
    }
    for (std::size_t i = first; i < first + 128; ++i) {
        Fiber& f = l.fibers[i];
        WgmmaThread& t = wgmma_threads[i];
        const auto& y = *static_cast<const emu::WgmmaIssue*>(f.arrival.gather_src);
        if (!t.fenced) {
            record_thread(f);
            abandon(kTrap, "wgmma.mma_async.%s issued by a thread that has not executed wgmma.fence since %s: "
                    "fence before a warpgroup's first wgmma and after touching its registers",
                    describe(y).c_str(), t.waited ? "its last wgmma.wait_group" : "it started");
        }
        WgmmaPending p{slot, y.d, y.scale_d != 0, false, -1, {}};
        for (const WgmmaPending& q : t.pending) {
            if (q.d != y.d) continue;
            if (wgmma_ops[q.op].n != y.n) {
                record_thread(f);
                abandon(kTrap, "wgmma.mma_async.%s into the accumulators of an m64n%dk16 still in flight: only "
                        "operations of the same shape may chain through the same registers", describe(y).c_str(), wgmma_ops[q.op].n);
            }
            p.chained = true;
        }
        const int count = y.n / 2;
        if (!p.chained) std::memcpy(p.c, y.d, sizeof(float) * static_cast<std::size_t>(count));
        for (int j = 0; j < count; ++j) y.d[j] = std::numeric_limits<float>::quiet_NaN();
        t.pending.push_back(p);
        f.state = State::kRunnable;
    }
}

// `count` elements of operand o from (mn, k) on, which its layout keeps in one 16-byte chunk (the swizzle
// moves whole chunks): k = 8q .. 8q + 7 of a K-major row, mn = 8q + i of an MN-major column. False, with
// nothing read, where the async proxy may not read one of their bytes yet.
bool chunk(const WgmmaOp& op, const WgmmaOperand& o, int mn, int k, int count, std::uint16_t* out, const Fiber& reader) {
    const std::uint64_t w = swizzled(o, unswizzled(o, mn, k));
    const std::size_t bytes = 2 * static_cast<std::size_t>(count);
    if (proxy_async_blocked(w, bytes, reader, op.epoch) >= 0) return false;
    std::memcpy(out, window_host(w), bytes);
    return true;
}

// This thread's operand elements of `op` (A's rows r, r + 8; B's columns 8j + c + v), by chunks where the
// layout allows, each byte checked as element() checks it. False where one may not be read yet.
bool gather(const WgmmaOp& op, const Fiber& f, int r, int c, std::uint16_t (*a)[16], std::uint16_t (*b)[16]) {
    for (int h = 0; h < 2; ++h) {
        if (op.rs) {
            std::memcpy(a[h], op.a_regs[r + 8 * h], sizeof a[h]);
        } else if (!op.a.mn_major) {
            if (!chunk(op, op.a, r + 8 * h, 0, 8, a[h], f) || !chunk(op, op.a, r + 8 * h, 8, 8, a[h] + 8, f)) return false;
        } else {
            for (int k = 0; k < 16; ++k)
                if (!chunk(op, op.a, r + 8 * h, k, 1, a[h] + k, f)) return false;
        }
    }
    for (int j = 0; j < op.n / 8; ++j) {
        std::uint16_t (*col)[16] = b + 2 * j;  // columns 8j + c and 8j + c + 1
        if (!op.b.mn_major) {
            for (int v = 0; v < 2; ++v)
                if (!chunk(op, op.b, 8 * j + c + v, 0, 8, col[v], f) || !chunk(op, op.b, 8 * j + c + v, 8, 8, col[v] + 8, f))
                    return false;
        } else {
            for (int k = 0; k < 16; ++k) {
                std::uint16_t pair[2];
                if (!chunk(op, op.b, 8 * j + c, k, 2, pair, f)) return false;
                col[0][k] = pair[0], col[1][k] = pair[1];
            }
        }
    }
    return true;
}

// This thread's elements of D for one completing operation, as hopper.cuh's accumulator layout.
void wgmma_compute(const WgmmaPending& p, const Fiber& f, float* out) {
    const WgmmaOp& op = wgmma_ops[p.op];
    auto widen = [&op](std::uint16_t e) {
        return static_cast<double>(op.format ? emu::BFloat16::widen(e) : emu::Binary16::widen(e));
    };
    const int r = 16 * static_cast<int>(f.warp % 4) + static_cast<int>(f.lane / 4), c = 2 * static_cast<int>(f.lane % 4);
    std::uint16_t a[2][16], b[256 / 4][16];
    if (!gather(op, f, r, c, a, b)) {  // element by element, in the order of the model, to the first unreadable one
        for (int h = 0; h < 2 && !op.rs; ++h)
            for (int k = 0; k < 16; ++k) element(op, op.a, r + 8 * h, k, f);
        for (int j = 0; j < op.n / 8; ++j)
            for (int v = 0; v < 2; ++v)
                for (int k = 0; k < 16; ++k) element(op, op.b, 8 * j + c + v, k, f);
        misuse("wgmma.mma_async: an operand read by chunks failed where each element passed");
    }
    double A[2][16];
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 16; ++k) A[h][k] = widen(a[h][k]);
    for (int j = 0; j < op.n / 8; ++j)
        for (int v = 0; v < 2; ++v) {
            double B[16];
            for (int k = 0; k < 16; ++k) B[k] = widen(b[2 * j + v][k]);
            for (int h = 0; h < 2; ++h) {
                const int i = 4 * j + 2 * h + v;
                double sum = p.scale_d ? p.c[i] : 0.0;
                for (int k = 0; k < 16; ++k) sum += A[h][k] * B[k];
                out[i] = static_cast<float>(sum);
            }
        }
}

}  // namespace

unsigned emu::shared_window_address(const void* p) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    std::uintptr_t address;
    if (a >= dynamic_window_lo() && a < dynamic_window_lo() + dynamic_window_bytes()) {
        address = a - dynamic_window_lo();
    } else if (__start_emu_shared && a >= reinterpret_cast<std::uintptr_t>(__start_emu_shared) &&
               a < reinterpret_cast<std::uintptr_t>(__stop_emu_shared)) {
        address = static_window_base() + (a - static_window_lo());
    } else {
        misuse("smem_address(%p): not shared memory", p);
    }
    if (address >> 18)
        misuse("smem_address(%p): the emulator's shared window puts it at 0x%lx, past the 2^18 bytes a wgmma "
               "descriptor can address (%lu bytes of dynamic shared memory pages, then the static __shared__ objects)",
               p, static_cast<unsigned long>(address), static_cast<unsigned long>(dynamic_window_bytes()));
    return static_cast<unsigned>(address);
}

void emu::wgmma_mma_async(WgmmaIssue& issue) {
    Fiber& self = *active->current;
    self.arrival = Arrival{kWarpgroupWgmma, 0, 0, 0, static_cast<int>(sizeof issue), &issue, nullptr};
    block_until_scheduled(self, State::kAtWarpgroup);
}

void emu::wgmma_fence() { wgmma_self().fenced = true; }

void emu::wgmma_commit_group() {
    WgmmaThread& t = wgmma_self();
    for (WgmmaPending& p : t.pending)
        if (p.group < 0) p.group = t.groups_committed;
    ++t.groups_committed;
}

void emu::wgmma_wait_group(int pending) {
    // cp_async="eager" (TMA loads land at issue): the other threads run first, as the wait takes time on a
    // GPU, so that a producer released by an empty barrier this thread arrived on before the wait refills
    // the stage now, and the operations below read the refilled tile
    if (active->config->cp_async_eager) block_until_scheduled(*active->current, State::kRunnable);
    WgmmaThread& t = wgmma_self();
    const Fiber& self = *active->current;
    const long complete_below = t.groups_committed - pending;
    t.fenced = false;
    t.waited = true;
    for (std::size_t i = 0; i < t.pending.size();) {
        WgmmaPending& p = t.pending[i];
        if (p.group < 0 || p.group >= complete_below) {
            ++i;
            continue;
        }
        float result[128];
        wgmma_compute(p, self, result);
        const int count = wgmma_ops[p.op].n / 2;
        auto next = std::find_if(t.pending.begin() + static_cast<long>(i) + 1, t.pending.end(),
                                 [&](const WgmmaPending& q) { return q.d == p.d; });
        if (next != t.pending.end()) std::memcpy(next->c, result, sizeof(float) * static_cast<std::size_t>(count));
        else std::memcpy(p.d, result, sizeof(float) * static_cast<std::size_t>(count));
        --wgmma_ops[p.op].users;
        t.pending.erase(t.pending.begin() + static_cast<long>(i));
    }
}
