// runtime/tma.h: the room of the TMA model (include/emu_tma.h says what it models).
//
// Part of runtime.cpp, a unity build, included after runtime/wgmma.h; include it nowhere else.
// It uses hopper.h's misuse and mbarrier_complete_tx_async, wgmma.h's shared window and swizzle, and
// counters.h's global_regions (the guarded argument buffers), proxy.h's async-proxy checks.

namespace {

struct TmaBox {
    const emu::TmaMapLayout* map;
    int rank;
    unsigned span;                 // swizzle span in bytes: 16 (none), 32, 64, 128
    std::uint32_t count[5];        // elements of the box along each dim: ceil(box / element stride)
    std::uint64_t elements, bytes;
};

const char* tma_swizzle_name(unsigned span) {
    return span == 128 ? "128B" : span == 64 ? "64B" : span == 32 ? "32B" : "none";
}

TmaBox tma_box(const void* map, int rank, const char* what) {
    const auto* m = static_cast<const emu::TmaMapLayout*>(map);
    if (reinterpret_cast<std::uintptr_t>(map) % 64)
        misuse("%s: the tensor map at %p is not 64-byte aligned", what, map);
    if (m->magic != emu::kTmaMagic)
        misuse("%s: the tensor map's bytes are not an emulator tensor map (magic 0x%08x): make it with "
               "flashcupy.tools.emulator.encode_tiled and pass it as a `const __grid_constant__ TensorMap`",
               what, m->magic);
    if (static_cast<int>(m->rank) != rank)
        misuse("%s: a %dd instruction on a tensor map of rank %u", what, rank, m->rank);
    TmaBox b{m, rank, 16u << (m->swizzle & 3), {1, 1, 1, 1, 1}, 1, 0};  // 0 none, 1 32B, 2 64B, 3 128B
    for (int d = 0; d < rank; ++d) {
        b.count[d] = (m->box[d] + m->element_strides[d] - 1) / m->element_strides[d];
        b.elements *= b.count[d];
    }
    b.bytes = b.elements * m->element_bytes;
    return b;
}

// The destination (or source) in shared memory: 128-byte aligned (the CUDA programming guide's
// requirement for tensor copies, whatever the swizzle), the whole box inside.
std::uint32_t tma_check_shared(const TmaBox& b, const void* smem, const char* what, const char* role) {
    const unsigned align = 128;
    const auto p = reinterpret_cast<std::uintptr_t>(smem);
    if (!in_shared(p, p + 1) || p % align)
        misuse("%s: the shared-memory %s %p is not %u-byte aligned shared memory (swizzle %s)", what,
               role, smem, align, tma_swizzle_name(b.span));
    if (!in_shared(p, p + b.bytes))
        misuse("%s: the box of %llu bytes at %p reaches outside this block's shared memory", what,
               static_cast<unsigned long long>(b.bytes), smem);
    return emu::shared_window_address(smem);
}

// The host pointer of box element `e` (linear, dim 0 fastest) at `smem` (window address `window`).
unsigned char* tma_shared_element(const TmaBox& b, unsigned char* smem, std::uint32_t window, std::uint64_t e) {
    WgmmaOperand o{};
    o.span = b.span;
    const std::uint64_t at = window + e * b.map->element_bytes;
    return smem + (swizzled(o, at) - window);
}

// The global address of box element `e` at `coords`, or 0 when it lies outside the tensor.
std::uintptr_t tma_global_element(const TmaBox& b, const int* coords, std::uint64_t e, const char* what) {
    const emu::TmaMapLayout& m = *b.map;
    std::uint64_t offset = 0;
    for (int d = 0; d < b.rank; ++d) {
        const long c = coords[d] + static_cast<long>(e % b.count[d]) * m.element_strides[d];
        e /= b.count[d];
        if (c < 0 || c >= static_cast<long>(m.dims[d])) return 0;
        offset += static_cast<std::uint64_t>(c) * (d == 0 ? m.element_bytes : m.strides[d - 1]);
    }
    const std::uintptr_t a = static_cast<std::uintptr_t>(m.address + offset);
    for (const GlobalRegion& g : global_regions)
        if (a >= g.base && a + m.element_bytes <= g.hi) return a;
    misuse("%s: the tensor map puts an element at %p (byte %llu from its global address 0x%llx), outside every "
           "array argument of the launch: its dims or strides reach past the array it was made from", what,
           reinterpret_cast<void*>(a), static_cast<unsigned long long>(offset),
           static_cast<unsigned long long>(m.address));
}

// A counted launch's TMA box (counters.py, "TMA"): one request in its shared row (`shared`, the
// bytes the box writes or reads there, at 128 bytes a wavefront: the unit moves whole lines, its bank
// conflicts are not modelled) and one in its global row (`global`: the 32-byte sectors its in-bounds
// elements fall in, from the start of their argument's bytes, as note() counts them; ideal, the
// sectors of those bytes). Elements outside the tensor move no global bytes.
struct TmaCount {
    std::vector<std::int64_t> sectors;
    std::uint64_t bytes = 0;

    void element(std::uintptr_t a, unsigned element_bytes) {
        for (const GlobalRegion& g : global_regions)
            if (a >= g.lo && a < g.hi) {
                const auto offset = static_cast<std::int64_t>(a - g.base);
                for (std::int64_t s = floor_div(offset, 32); s <= floor_div(offset + element_bytes - 1, 32); ++s)
                    sectors.push_back(s);
                bytes += element_bytes;
                return;
            }
    }

    void add(int shared, int global, const TmaBox& b) {
        std::uint64_t* s = active->counting->totals.access[shared];
        const std::uint64_t lines = (b.bytes + 127) / 128;
        s[0] += 1, s[1] += b.bytes, s[2] += lines, s[3] += lines;
        std::sort(sectors.begin(), sectors.end());
        sectors.erase(std::unique(sectors.begin(), sectors.end()), sectors.end());
        std::uint64_t* g = active->counting->totals.access[global];
        g[0] += 1, g[1] += bytes, g[2] += sectors.size(), g[3] += (bytes + 31) / 32;
    }
};

// The copy of one load's box into shared memory, then its complete_tx on its barrier (the async proxy's)
void tma_land(const PendingTmaLoad& p) {
    const char* what = "cp.async.bulk.tensor (tma_load)";
    const TmaBox b = tma_box(p.map, p.rank, what);
    const std::uint32_t window = emu::shared_window_address(p.dst);
    auto* smem = static_cast<unsigned char*>(p.dst);
    for (std::uint64_t e = 0; e < b.elements; ++e) {
        unsigned char* to = tma_shared_element(b, smem, window, e);
        const std::uintptr_t from = tma_global_element(b, p.coords, e, what);
        if (from) std::memcpy(to, reinterpret_cast<const void*>(from), b.map->element_bytes);
        else std::memset(to, 0, b.map->element_bytes);
        proxy_async_write(reinterpret_cast<std::uintptr_t>(to), b.map->element_bytes);
    }
    emu::mbarrier_complete_tx_async(reinterpret_cast<void*>(p.bar), static_cast<unsigned>(b.bytes));
}

void land_tma_loads(std::uintptr_t bar) {
    auto& loads = active->tma_loads;
    for (std::size_t i = 0; i < loads.size();) {
        if (loads[i].bar != bar) {
            ++i;
            continue;
        }
        const PendingTmaLoad p = loads[i];
        loads.erase(loads.begin() + static_cast<long>(i));
        tma_land(p);
    }
}

// As the scheduler finds no thread that can run: the loads in flight on barriers that a thread waits on
// land (their copies complete on their own; one issued after its waiter blocked lands here). Whether any did.
bool land_awaited_tma_loads() {
    bool landed = false;
    for (const Fiber& f : active->fibers) {
        if (f.state != State::kAtMbarrier) continue;
        const std::size_t before = active->tma_loads.size();
        land_tma_loads(f.mbarrier);
        landed |= active->tma_loads.size() != before;
    }
    return landed;
}

}  // namespace

// Checked at issue (the map, the destination, every element's place); the box lands when a thread
// waits on the barrier (land_tma_loads), or with cp_async="eager" at once
void emu::tma_load(void* dst, const void* map, int rank, const int* coords, void* bar) {
    const char* what = "cp.async.bulk.tensor (tma_load)";
    const TmaBox b = tma_box(map, rank, what);
    const std::uint32_t window = tma_check_shared(b, dst, what, "destination");
    mbarrier_at(bar, what);  // the barrier must exist before the copy starts
    auto* smem = static_cast<unsigned char*>(dst);
    TmaCount count;
    for (std::uint64_t e = 0; e < b.elements; ++e) {
        unsigned char* to = tma_shared_element(b, smem, window, e);
        if (!in_shared(reinterpret_cast<std::uintptr_t>(to), reinterpret_cast<std::uintptr_t>(to) + b.map->element_bytes))
            misuse("%s: box element %llu lands at %p after the %s swizzle, outside shared memory", what,
                   static_cast<unsigned long long>(e), static_cast<void*>(to), tma_swizzle_name(b.span));
        const std::uintptr_t from = tma_global_element(b, coords, e, what);
        if (active->counting && from) count.element(from, b.map->element_bytes);
    }
    if (active->counting) count.add(kTmaLoadShared, kTmaLoadGlobal, b);
    PendingTmaLoad p{dst, map, rank, {0, 0, 0, 0, 0}, reinterpret_cast<std::uintptr_t>(bar)};
    for (int d = 0; d < rank; ++d) p.coords[d] = coords[d];
    // cp_async="eager": the box lands now, the earliest the hardware may write it, so that a stage refilled
    // while a wgmma that reads it is still in flight (an empty barrier arrived on before the wait that
    // covers the wgmma) gives that wgmma the new tile: it reads its operands at that wait, the latest
    if (active->config->cp_async_eager) tma_land(p);
    else active->tma_loads.push_back(p);
}

// Checked at issue (the map, the source, every element's place, the async proxy); the box is read from
// shared memory and written to global memory when a wait_group.read covers its group, the latest the
// hardware may read it: a source overwritten before that wait is stored as overwritten.
void emu::tma_store(const void* map, int rank, const int* coords, const void* src) {
    const char* what = "cp.async.bulk.tensor store (tma_store)";
    const TmaBox b = tma_box(map, rank, what);
    const std::uint32_t window = tma_check_shared(b, src, what, "source");
    auto* smem = static_cast<unsigned char*>(const_cast<void*>(src));
    TmaCount count;
    std::vector<std::pair<std::uintptr_t, const unsigned char*>> copies;  // (global, shared) per element inside
    for (std::uint64_t e = 0; e < b.elements; ++e) {
        const unsigned char* from = tma_shared_element(b, smem, window, e);
        if (!in_shared(reinterpret_cast<std::uintptr_t>(from), reinterpret_cast<std::uintptr_t>(from) + b.map->element_bytes))
            misuse("%s: box element %llu is read from %p after the %s swizzle, outside shared memory", what,
                   static_cast<unsigned long long>(e), static_cast<const void*>(from), tma_swizzle_name(b.span));
        proxy_async_read(reinterpret_cast<std::uintptr_t>(from), b.map->element_bytes, *active->current, what,
                         active->barrier_epoch);
        const std::uintptr_t to = tma_global_element(b, coords, e, what);
        if (to) copies.emplace_back(to, from);
        if (active->counting && to) count.element(to, b.map->element_bytes);
    }
    const unsigned bytes = b.map->element_bytes;
    auto taken = std::make_shared<std::vector<unsigned char>>(copies.size() * bytes);
    auto places = std::make_shared<std::vector<std::pair<std::uintptr_t, const unsigned char*>>>(std::move(copies));
    active->current->bulk.push_back({[places, taken, bytes] {
        for (std::size_t i = 0; i < places->size(); ++i) std::memcpy(taken->data() + i * bytes, (*places)[i].second, bytes);
    }, [places, taken, bytes] {
        for (std::size_t i = 0; i < places->size(); ++i)
            std::memcpy(reinterpret_cast<void*>((*places)[i].first), taken->data() + i * bytes, bytes);
    }, -1});
    ++active->current->bulk_open;
    if (active->counting) count.add(kTmaStoreShared, kTmaStoreGlobal, b);
}

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: checked at issue (size and both addresses
// 16-byte aligned, the source inside shared memory and fenced for the async proxy as a store's, the
// destination inside one array argument); the source is read and added into the destination when a
// wait_group.read covers its bulk group, the latest the hardware may read it, so a source overwritten
// before that wait is added as overwritten (and a reduce never waited for is the exit's error).
void emu::bulk_reduce_add_f32(float* dst, const float* src, unsigned bytes) {
    const char* what = "cp.reduce.async.bulk .add.f32 (bulk_reduce_add_f32)";
    const auto s = reinterpret_cast<std::uintptr_t>(src), d = reinterpret_cast<std::uintptr_t>(dst);
    if (bytes == 0 || bytes % 16) misuse("%s: %u bytes, not a positive multiple of 16", what, bytes);
    if (s % 16 || d % 16) misuse("%s: the source %p or the destination %p is not 16-byte aligned", what, src, dst);
    if (!in_shared(s, s + bytes))
        misuse("%s: the source %p (%u bytes) is not inside this block's shared memory", what, src, bytes);
    bool inside = false;
    for (const GlobalRegion& g : global_regions) inside |= d >= g.base && d + bytes <= g.hi;
    if (!inside)
        misuse("%s: the destination %p (%u bytes) is not inside one array argument of the launch", what, dst, bytes);
    proxy_async_read(s, bytes, *active->current, what, active->barrier_epoch);
    Fiber& self = *active->current;
    if (self.acquired_unfenced)
        misuse("%s after a flag_wait (ld.acquire) without fence.proxy.async.global since: the reduce-add, in "
               "the async proxy, is not ordered after the acquire", what);
    auto taken = std::make_shared<std::vector<float>>(bytes / 4);
    self.bulk.push_back({[s, taken] { std::memcpy(taken->data(), reinterpret_cast<const void*>(s), taken->size() * 4); },
                         [d, taken] {
                             auto* to = reinterpret_cast<float*>(d);
                             for (std::size_t e = 0; e < taken->size(); ++e) to[e] += (*taken)[e];
                         }, -1});
    ++self.bulk_open;
    if (active->counting) {  // the store rows: the same unit, the same direction (counters.py, "TMA")
        TmaCount count;
        for (std::uintptr_t a = d; a < d + bytes; a += 4) count.element(a, 4);
        TmaBox b{};
        b.bytes = bytes;
        count.add(kTmaStoreShared, kTmaStoreGlobal, b);
    }
}

// A thread must wait for its bulk groups' reads before it exits (fibers.h), as a CTA's shared memory may
// be the next CTA's once it has.
void emu::tma_commit_group() {
    Fiber& self = *active->current;
    for (PendingBulk& r : self.bulk)
        if (r.group < 0) r.group = self.bulk_committed;
    ++self.bulk_committed;
    self.bulk_open = 0;
    ++self.bulk_reading;
}

// The groups older than the newest `pending` have read their sources (.read: their stores and
// reduce-adds read them now, in issue order) or completed (no .read: read if not yet, then written into
// global memory, in issue order; the thread must run fence.proxy.async.global before a flag_release_add
// publishes them, as the writes were the async proxy's).
void emu::tma_wait_group(int pending, bool read_only) {
    if (pending < 0 || pending > 7)
        misuse("cp.async.bulk.wait_group%s %d: N must be in [0, 7]", read_only ? ".read" : "", pending);
    Fiber& self = *active->current;
    self.bulk_reading = std::min(self.bulk_reading, pending);
    const long done = self.bulk_committed - self.bulk_reading;
    std::vector<PendingBulk> later;
    for (PendingBulk& op : self.bulk) {
        const bool covered = op.group >= 0 && op.group < done;
        if (covered && !op.read_done) op.read(), op.read_done = true;
        if (covered && !read_only) op.write(), self.written_unfenced = true;
        else later.push_back(std::move(op));
    }
    self.bulk = std::move(later);
}

namespace {
// The end of a block: every bulk store and reduce-add not yet complete lands (read, if no wait did, then
// written), thread by thread in issue order.
void complete_bulk_writes(Launch& l) {
    for (Fiber& f : l.fibers) {
        for (PendingBulk& op : f.bulk) {
            if (!op.read_done) op.read();
            op.write();
        }
        f.bulk.clear();
    }
}

// ----------------------------------------------------------------------------
// flags in global memory, between blocks (emu_hopper.h's flag_wait, flag_release_add)

void check_flag(const int* flag, const char* what) {
    const auto a = reinterpret_cast<std::uintptr_t>(flag);
    bool inside = false;
    for (const GlobalRegion& g : global_regions) inside |= a >= g.base && a + sizeof(int) <= g.hi;
    if (!inside || a % alignof(int)) misuse("%s: the flag at %p is not an aligned int inside an array argument", what, flag);
}
}  // namespace

void emu::flag_wait(const int* flag, int value) {
    check_flag(flag, "flag_wait (ld.acquire.gpu)");
    Fiber& self = *active->current;
    self.acquired_unfenced = true;
    if (*flag >= value) return;
    self.flag = flag;
    self.flag_value = value;
    block_until_scheduled(self, State::kAtFlag);  // scheduler.h wakes it once *flag >= value
}

void emu::flag_release_add(int* flag, int value) {
    const char* what = "flag_release_add (red.release.gpu)";
    check_flag(flag, what);
    Fiber& self = *active->current;
    if (!self.bulk.empty())
        misuse("%s with %zu bulk store(s) or reduce-add(s) of this thread not complete (cp.async.bulk.wait_group 0, "
               "not .read, completes them): a block that acquires the flag may not see their writes", what,
               self.bulk.size());
    if (self.written_unfenced)
        misuse("%s after bulk writes completed without fence.proxy.async.global since: they are the async "
               "proxy's, the release the generic proxy's", what);
    *flag += value;
}

void emu::fence_proxy_async_global() {
    Fiber& self = *active->current;
    self.acquired_unfenced = self.written_unfenced = false;
}
