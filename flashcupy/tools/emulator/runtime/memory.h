// runtime/memory.h: the room of guarded memory.
//
// Part of runtime.cpp, a unity build: runtime.cpp includes its parts, in order, into one
// translation unit (one object, compiled once per toolchain, as before the split); include
// it nowhere else. It uses what the parts before it declare.
//
// The garbage byte fresh memory holds, the fiber stacks (a PROT_NONE page below each) and the
// block's dynamic shared memory (guard pages on both sides, garbage in the slack). The argument
// buffers (emu_map_guarded) are runtime.cpp's, beside the rest of what Python calls.

namespace {

constexpr unsigned char kGarbage = 0xff;  // NaN in every float format, -1 in every integer
constexpr std::uint64_t kGarbagePayload = ~0ull;

std::size_t page_size() {
    static const std::size_t size = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    return size;
}

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

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

}  // namespace
