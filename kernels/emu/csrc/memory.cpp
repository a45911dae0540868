// Emulated device memory for the kvgate CUDA emulator: a reserved 256 GiB address range in which
// each allocation sits between inaccessible guard gaps, ends at a page's end (rounded to 16
// bytes), and has canaries in its slack; freed allocations become inaccessible and are never
// reused, so any access outside a live allocation faults or trips a canary. Pinned host memory
// is tracked beside it, for copies and launch checks.
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "runtime.h"

namespace kvgate_emu {


namespace {
constexpr size_t kGuard = 16 * kPage;  // inaccessible gap before each allocation
constexpr size_t kArenaBytes = size_t{1} << 38;  // 256 GiB of address space, reserved only
constexpr unsigned char kUninit = 0xff;           // fresh device memory reads as NaN
constexpr unsigned char kCanary = 0xcd;           // slack between an allocation and its page

struct Alloc {
    uint64_t ptr;
    size_t size;
    uint64_t region;  // first accessible page
    size_t span;      // accessible bytes from region
    uint64_t id;
    bool live;
    bool pinned;
};

struct Memory {
    std::mutex mu;
    uint8_t* base = nullptr;
    size_t next = 0;
    size_t live_bytes = 0;
    size_t limit = 0;
    uint64_t next_id = 1;
    std::map<uint64_t, Alloc> device;  // by ptr, freed ones kept for messages
    std::map<uint64_t, Alloc> pinned;  // by ptr
};

Memory& memory() {
    static Memory* m = [] {
        auto* m = new Memory;
        void* p = mmap(nullptr, kArenaBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            fprintf(stderr, "kvgate cuda emulation: cannot reserve the device address range\n");
            abort();
        }
        m->base = static_cast<uint8_t*>(p);
        size_t gib = 4;
        if (const char* v = getenv("KVGATE_EMU_MEMORY_GIB")) gib = std::max<size_t>(1, strtoull(v, nullptr, 10));
        m->limit = gib << 30;
        return m;
    }();
    return *m;
}

bool in_arena(uint64_t a) {
    Memory& m = memory();
    return a >= (uint64_t)m.base && a < (uint64_t)m.base + kArenaBytes;
}

// The allocation (device or pinned, live or freed) whose accessible pages hold `a`, or the
// nearest ones on each side.
const Alloc* containing(const std::map<uint64_t, Alloc>& map, uint64_t a) {
    auto it = map.upper_bound(a);
    if (it == map.begin()) return nullptr;
    --it;
    return a < it->second.ptr + it->second.size ? &it->second : nullptr;
}


bool canaries_intact(const Alloc& a, std::string* why) {
    const uint8_t* region = reinterpret_cast<const uint8_t*>(a.region);
    const uint8_t* start = reinterpret_cast<const uint8_t*>(a.ptr);
    for (const uint8_t* p = region; p < start; ++p)
        if (*p != kCanary) {
            *why = fmt("%zu bytes before the start of allocation #%llu (%zu bytes at 0x%llx) were written",
                       (size_t)(start - p), (unsigned long long)a.id, a.size, (unsigned long long)a.ptr);
            return false;
        }
    const uint8_t* end = start + a.size;
    for (const uint8_t* p = end; p < region + a.span; ++p)
        if (*p != kCanary) {
            *why = fmt("%zu bytes past the end of allocation #%llu (%zu bytes at 0x%llx) were written",
                       (size_t)(p - end) + 1, (unsigned long long)a.id, a.size, (unsigned long long)a.ptr);
            return false;
        }
    return true;
}
}  // namespace

uint64_t dev_alloc(size_t bytes, std::string* err) {
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.mu);
    if (m.live_bytes + bytes > m.limit) {
        *err = fmt("out of emulated device memory: %zu bytes live, %zu more asked, %zu in all "
                   "(KVGATE_EMU_MEMORY_GIB)", m.live_bytes, bytes, m.limit);
        return 0;
    }
    const size_t data = round_up(std::max<size_t>(bytes, 1), 16);
    const size_t span = round_up(data, kPage);
    if (m.next + kGuard + span + kGuard > kArenaBytes) {
        *err = "the emulated device address range is used up";
        return 0;
    }
    uint8_t* region = m.base + m.next + kGuard;  // a guard gap before, the next one's after
    m.next += kGuard + span;
    if (mprotect(region, span, PROT_READ | PROT_WRITE) != 0) {
        *err = "mprotect failed: the host is out of memory";
        return 0;
    }
    uint8_t* ptr = region + span - data;
    memset(region, kCanary, span);
    memset(ptr, kUninit, bytes);
    Alloc a{(uint64_t)ptr, bytes, (uint64_t)region, span, m.next_id++, true, false};
    m.device[a.ptr] = a;
    m.live_bytes += bytes;
    return a.ptr;
}

int dev_free(uint64_t p, std::string* err) {
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.mu);
    auto it = m.device.find(p);
    if (it == m.device.end() || !it->second.live) {
        *err = it == m.device.end() ? fmt("free of 0x%llx, which no allocation starts at", (unsigned long long)p)
                                    : fmt("second free of allocation #%llu", (unsigned long long)it->second.id);
        return kInvalidValue;
    }
    Alloc& a = it->second;
    std::string why;
    const bool intact = canaries_intact(a, &why);
    a.live = false;
    m.live_bytes -= a.size;
    madvise(reinterpret_cast<void*>(a.region), a.span, MADV_DONTNEED);
    mprotect(reinterpret_cast<void*>(a.region), a.span, PROT_NONE);
    if (!intact) {
        *err = why;
        return kIllegalAddress;
    }
    return kSuccess;
}

void* host_alloc(size_t bytes) {
    const size_t span = round_up(std::max<size_t>(bytes, 1), kPage);
    void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.mu);
    Alloc a{(uint64_t)p, bytes, (uint64_t)p, span, m.next_id++, true, true};
    m.pinned[a.ptr] = a;
    return p;
}

int host_free(void* p) {
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.mu);
    auto it = m.pinned.find((uint64_t)p);
    if (it == m.pinned.end()) return kInvalidValue;
    munmap(p, it->second.span);
    m.pinned.erase(it);
    return kSuccess;
}

MemKind classify(uint64_t p) {
    if (in_arena(p)) return MemKind::Device;
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.mu);
    auto it = m.pinned.upper_bound(p);
    if (it != m.pinned.begin()) {
        --it;
        if (p < it->second.ptr + std::max<size_t>(it->second.size, 1)) return MemKind::Pinned;
    }
    return MemKind::Pageable;
}

namespace {
// Why [p, p + bytes) is not inside one live allocation ("" when it is). Caller holds m.mu.
std::string range_problem(Memory& m, uint64_t p, size_t bytes) {
    const std::map<uint64_t, Alloc>& map = in_arena(p) ? m.device : m.pinned;
    auto it = map.upper_bound(p);
    const Alloc* before = nullptr;
    if (it != map.begin()) before = &std::prev(it)->second;
    if (before && p >= before->ptr && p < before->ptr + before->size) {
        if (!before->live)
            return fmt("allocation #%llu (%zu bytes at 0x%llx) was freed", (unsigned long long)before->id,
                       before->size, (unsigned long long)before->ptr);
        if (p + bytes <= before->ptr + before->size) return "";
        return fmt("%zu bytes at offset %llu of allocation #%llu (%zu bytes at 0x%llx) run %llu bytes past its end",
                   bytes, (unsigned long long)(p - before->ptr), (unsigned long long)before->id, before->size,
                   (unsigned long long)before->ptr, (unsigned long long)(p + bytes - before->ptr - before->size));
    }
    // In the gap between two allocations: name the nearer one.
    const Alloc* after = it != map.end() ? &it->second : nullptr;
    const uint64_t past = before && p >= before->ptr + before->size ? p - (before->ptr + before->size) : ~0ull;
    const uint64_t ahead = after && p < after->ptr ? after->ptr - p : ~0ull;
    if (past < kGuard && past <= ahead)
        return fmt("0x%llx is at offset %llu of allocation #%llu, which has %zu bytes (at 0x%llx)%s",
                   (unsigned long long)p, (unsigned long long)(p - before->ptr), (unsigned long long)before->id,
                   before->size, (unsigned long long)before->ptr, before->live ? ": past the end" : " and was freed");
    if (ahead < kGuard)
        return fmt("0x%llx is %llu bytes before the start of allocation #%llu (%zu bytes at 0x%llx)",
                   (unsigned long long)p, (unsigned long long)(after->ptr - p), (unsigned long long)after->id,
                   after->size, (unsigned long long)after->ptr);
    return fmt("0x%llx is in no %s allocation", (unsigned long long)p, in_arena(p) ? "device" : "pinned host");
}
}  // namespace

bool range_ok(uint64_t p, size_t bytes, std::string* why) {
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.mu);
    std::string problem = range_problem(m, p, std::max<size_t>(bytes, 1));
    if (problem.empty()) return true;
    *why = problem;
    return false;
}

void mem_info(size_t* free_bytes, size_t* total_bytes) {
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.mu);
    *total_bytes = m.limit;
    *free_bytes = m.limit - m.live_bytes;
}

bool in_device_range(uint64_t a) { return in_arena(a); }

std::string describe_address(uint64_t a) {
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.mu);
    return range_problem(m, a, 1);
}

bool allocation_intact(uint64_t p, std::string* why) {
    if (!in_arena(p)) return true;
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.mu);
    const Alloc* a = containing(m.device, p);
    return !(a && a->live) || canaries_intact(*a, why);
}

}  // namespace kvgate_emu
