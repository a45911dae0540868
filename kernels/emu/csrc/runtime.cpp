// The kvgate CUDA emulator's runtime: kernel registry and block execution (device memory is in
// memory.cpp). Each block's threads are fibers with their own stacks on one worker
// thread; they switch at every barrier and warp exchange, in an order that rotates between
// forward, reverse and a seeded shuffle, so that a missing __syncthreads reads poisoned shared
// memory (all bits set: NaN as floats). Blocks run in parallel on the worker pool. What an H200
// would refuse fails the launch with a message naming the kernel, block and thread: bad launch
// sizes, too much shared memory or registers, accesses outside every live allocation (a fault
// in the guard pages), shuffle masks that leave out a participating lane, barriers reached by
// only some threads, and deadlocks between them.
#include "runtime.h"

#include <link.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "../include/kvgate_emu.h"

namespace kvgate_emu {

// ---------------------------------------------------------------------------------------------
// Registry

namespace {
std::map<std::string, const KernelInfo*>& kernels() {
    static std::map<std::string, const KernelInfo*> m;
    return m;
}
std::vector<DynSmem>& dyn_arrays() {
    static std::vector<DynSmem> v;
    return v;
}
}  // namespace

std::string fmt(const char* f, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

Registrar::Registrar(const KernelInfo* k, int n) {
    for (int i = 0; i < n; ++i) kernels()[k[i].name] = &k[i];
}

DynRegistrar::DynRegistrar(const DynSmem* d, int n) {
    for (int i = 0; i < n; ++i) dyn_arrays().push_back(d[i]);
}

const KernelInfo* find_kernel(const std::string& name) {
    auto it = kernels().find(name);
    return it == kernels().end() ? nullptr : it->second;
}

// ---------------------------------------------------------------------------------------------
// Fibers

extern "C" void kvgate_emu_switch(void** save_sp, void* to_sp);
#if defined(__x86_64__)
asm(R"(
.text
.p2align 4
.type kvgate_emu_switch,@function
kvgate_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size kvgate_emu_switch, .-kvgate_emu_switch
)");
#else
#error "the kvgate CUDA emulator's fibers are written for x86-64"
#endif

namespace {
constexpr size_t kStack = 64 * 1024;
constexpr size_t kStackSlot = kStack + kPage;  // a guard page below each stack

enum State : uint8_t { kReady, kAtBarrier, kAtWarp, kDone };

struct Fiber {
    void* sp;
    uint3 tid;
    State st;
};

// One pending warp exchange: the lanes of `mask` meet at one intrinsic.
struct Group {
    uint32_t arrived = 0, mask = 0;
    int kind = 0;
    const char* file = nullptr;
    int line = 0;
    uint32_t val[32];
    int src[32];
};

// A warp's pending exchanges (disjoint masks: groups of lanes may exchange independently) and
// each lane's last result.
struct WarpSync {
    Group groups[32];
    int n = 0;
    uint32_t out[32];

    const Group* of_lane(int lane) const {
        for (int i = 0; i < n; ++i)
            if (groups[i].mask >> lane & 1) return &groups[i];
        return nullptr;
    }
};

struct Block {
    const Launch* l;
    uint3 bidx;
    int n;
    Fiber* fibers;
    uint8_t* stacks;
    int done = 0;
    int at_barrier = 0;
    const char* bar_file = nullptr;
    int bar_line = 0;
    WarpSync warps[32];
    bool failed = false;
    std::string err;
    void* sched_sp = nullptr;
    void** params = nullptr;
};

// Everything the runtime keeps per OS thread, initialized to nonzero so that it lives in the
// TLS image (.tdata): the zero-initialized TLS (.tbss) is the kernels' __shared__ memory, which
// every block start poisons.
struct Tls {
    int marker;
    ThreadView view;
    Block* block;
    Fiber* fiber;
    int linear;
    uint8_t* stacks;
    size_t nslots;  // stack slots mapped at `stacks`
    Fiber* fibers;
    uint8_t* shared;  // this thread's .tbss of this library
    size_t shared_len;
    bool shared_known;
    char fault[512];
};
thread_local Tls g_tls = {1, {}, nullptr, nullptr, 0, nullptr, 0, nullptr, nullptr, 0, false, {}};

[[noreturn]] void to_scheduler_forever() {
    Tls& t = g_tls;
    void* dummy;
    kvgate_emu_switch(&dummy, t.block->sched_sp);
    __builtin_unreachable();
}

const char* base_name(const char* file) {
    const char* s = strrchr(file, '/');
    return s ? s + 1 : file;
}

std::string where() {
    Tls& t = g_tls;
    const Block& b = *t.block;
    return fmt("kernel %s, block (%u,%u,%u), thread (%u,%u,%u)", b.l->k->name, b.bidx.x, b.bidx.y, b.bidx.z,
               t.view.thread_idx.x, t.view.thread_idx.y, t.view.thread_idx.z);
}

[[noreturn]] void fail(const std::string& msg) {
    Tls& t = g_tls;
    Block& b = *t.block;
    if (!b.failed) {
        b.failed = true;
        b.err = where() + ": " + msg;
    }
    t.fiber->st = kDone;
    to_scheduler_forever();
}

void yield() {
    Tls& t = g_tls;
    kvgate_emu_switch(&t.fiber->sp, t.block->sched_sp);
}

void fiber_exit() {
    Tls& t = g_tls;
    Block& b = *t.block;
    const int lane = t.linear % 32, warp = t.linear / 32;
    if (b.at_barrier > 0)
        fail(fmt("returned while %d other thread(s) wait at __syncthreads (%s:%d): a barrier reached by "
                 "only some of the block's threads",
                 b.at_barrier, base_name(b.bar_file), b.bar_line));
    if (const Group* g = b.warps[warp].of_lane(lane))
        if (g->arrived)
            fail(fmt("lane %d has returned while lanes 0x%08x of its warp wait for it at a warp exchange (%s:%d)",
                     lane, g->arrived, base_name(g->file), g->line));
    t.fiber->st = kDone;
    b.done++;
    to_scheduler_forever();
}

void fiber_main() {
    Tls& t = g_tls;
    const Launch& l = *t.block->l;
    l.k->invoke(l.k->fn, t.block->params);
    fiber_exit();
}

// A fresh stack that starts in fiber_main when switched to.
void* init_stack(uint8_t* stack_top) {
    uint64_t* sp = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(stack_top) & ~uintptr_t{15});
    *--sp = 0;                                      // fiber_main's (never used) return address
    *--sp = (uint64_t)(uintptr_t)&fiber_main;       // popped by the switch's ret
    for (int i = 0; i < 6; ++i) *--sp = 0;          // rbp rbx r12-r15
    *--sp = 0x037f00001f80ull;                      // mxcsr (low), x87 control word (high)
    return sp;
}

// This thread's .tbss of this library (the kernels' __shared__ variables).
int find_tls(struct dl_phdr_info* info, size_t, void* data) {
    Tls& t = *static_cast<Tls*>(data);
    const uint64_t me = (uint64_t)(uintptr_t)&find_tls;
    bool mine = false;
    const ElfW(Phdr)* tls = nullptr;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type == PT_LOAD && me >= info->dlpi_addr + ph.p_vaddr && me < info->dlpi_addr + ph.p_vaddr + ph.p_memsz)
            mine = true;
        if (ph.p_type == PT_TLS) tls = &ph;
    }
    if (!mine) return 0;
    if (tls && info->dlpi_tls_data) {
        t.shared = static_cast<uint8_t*>(info->dlpi_tls_data) + tls->p_filesz;
        t.shared_len = tls->p_memsz - tls->p_filesz;
    }
    return 1;
}

// Poisons this thread's __shared__ memory: all of it, except that each dynamic array is poisoned
// only up to 4 KiB past what the launch asked for (the rest of its 227 KiB is never meant to be
// touched, and the check after the block looks no further).
void poison_shared(Tls& t, size_t dyn_bytes) {
    if (!t.shared_known) {
        dl_iterate_phdr(&find_tls, &t);
        t.shared_known = true;
    }
    if (!t.shared) return;
    const size_t used = std::min(kDynSmemCap, dyn_bytes + 4096);
    std::vector<std::pair<uint8_t*, uint8_t*>> skip;
    for (const DynSmem& d : dyn_arrays()) {
        uint8_t* a = static_cast<uint8_t*>(d.addr());
        skip.emplace_back(a + used, a + kDynSmemCap);
    }
    std::sort(skip.begin(), skip.end());
    uint8_t* at = t.shared;
    uint8_t* const end = t.shared + t.shared_len;
    for (auto [from, to] : skip) {
        from = std::max(from, at);
        to = std::min(to, end);
        if (from >= to) continue;
        memset(at, 0xff, (size_t)(from - at));
        at = to;
    }
    if (at < end) memset(at, 0xff, (size_t)(end - at));
}

std::atomic<uint64_t> g_launches{0};
std::atomic<int> g_schedule{0};
std::atomic<uint64_t> g_seed{0x9e3779b97f4a7c15ull};

void order_for(int kind, uint64_t seed, int n, std::vector<int>* order) {
    order->resize(n);
    for (int i = 0; i < n; ++i) (*order)[i] = i;
    if (kind == 2) std::reverse(order->begin(), order->end());
    if (kind == 3) {
        uint64_t s = seed | 1;
        for (int i = n - 1; i > 0; --i) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            std::swap((*order)[i], (*order)[s % (uint64_t)(i + 1)]);
        }
    }
}

std::string deadlock_report(const Block& b) {
    std::map<std::string, int> groups;
    for (int i = 0; i < b.n; ++i) {
        const Fiber& f = b.fibers[i];
        if (f.st == kAtBarrier) groups[fmt("__syncthreads (%s:%d)", base_name(b.bar_file), b.bar_line)]++;
        if (f.st == kAtWarp)
            if (const Group* g = b.warps[i / 32].of_lane(i % 32))
                groups[fmt("a warp exchange with mask 0x%08x (%s:%d)", g->mask, base_name(g->file), g->line)]++;
    }
    std::string s = "deadlock:";
    for (auto& [what, count] : groups) s += fmt(" %d thread(s) wait at %s;", count, what.c_str());
    return s + " no thread can go on";
}

// Runs one block on this thread; returns "" or the failure.
std::string run_block(const Launch& l, uint3 bidx, const std::vector<int>& order) {
    Tls& t = g_tls;
    const int n = (int)(l.block[0] * l.block[1] * l.block[2]);
    // Stacks for as many threads as the largest block so far (a power of two, at least 128): each
    // slot is one mapping plus its guard page, so mapping 1024 of them everywhere would cost
    // thousands of the process's mappings.
    if ((size_t)n > t.nslots) {
        size_t want = 128;
        while (want < (size_t)n) want *= 2;
        if (t.stacks) munmap(t.stacks, kStackSlot * t.nslots);
        t.stacks = nullptr;
        t.nslots = 0;
        void* p = mmap(nullptr, kStackSlot * want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (p == MAP_FAILED) return "the emulator cannot map fiber stacks (out of memory or mappings)";
        for (size_t i = 0; i < want; ++i)
            if (mprotect(static_cast<uint8_t*>(p) + i * kStackSlot, kPage, PROT_NONE) != 0) {
                munmap(p, kStackSlot * want);
                return "the emulator cannot protect its fiber stacks' guard pages (too many mappings)";
            }
        t.stacks = static_cast<uint8_t*>(p);
        t.nslots = want;
        if (!t.fibers) t.fibers = new Fiber[kMaxThreadsPerBlock];
    }
    poison_shared(t, l.dyn_smem);
    std::vector<void*> params(l.offsets.size());
    for (size_t i = 0; i < params.size(); ++i)
        params[i] = const_cast<unsigned char*>(l.args.data() + l.offsets[i]);
    Block b;
    b.l = &l;
    b.params = params.data();
    b.bidx = bidx;
    b.n = n;
    b.fibers = t.fibers;
    b.stacks = t.stacks;
    for (int i = 0; i < n; ++i) {
        Fiber& f = b.fibers[i];
        f.tid = uint3{(unsigned)i % l.block[0], (unsigned)(i / l.block[0]) % l.block[1],
                      (unsigned)i / (l.block[0] * l.block[1])};
        f.st = kReady;
        f.sp = init_stack(t.stacks + (size_t)(i + 1) * kStackSlot);
    }
    t.block = &b;
    t.view.block_idx = bidx;
    t.view.block_dim = dim3{l.block[0], l.block[1], l.block[2]};
    t.view.grid_dim = dim3{l.grid[0], l.grid[1], l.grid[2]};
    while (!b.failed && b.done < n) {
        bool ran = false;
        for (int i : order) {
            Fiber& f = b.fibers[i];
            if (f.st != kReady) continue;
            ran = true;
            t.fiber = &f;
            t.linear = i;
            t.view.thread_idx = f.tid;
            kvgate_emu_switch(&b.sched_sp, f.sp);
            if (b.failed) break;
        }
        if (!ran && !b.failed) {
            b.failed = true;
            b.err = fmt("kernel %s, block (%u,%u,%u): ", l.k->name, bidx.x, bidx.y, bidx.z) + deadlock_report(b);
        }
    }
    t.block = nullptr;
    t.fiber = nullptr;
    if (b.failed) return b.err;
    // Writes past the launch's dynamic shared memory land in the poisoned rest of the array.
    for (const DynSmem& d : dyn_arrays()) {
        const uint8_t* a = static_cast<const uint8_t*>(d.addr());
        const size_t end = std::min(kDynSmemCap, l.dyn_smem + 4096);
        for (size_t i = l.dyn_smem; i < end; ++i)
            if (a[i] != 0xff)
                return fmt("kernel %s, block (%u,%u,%u): wrote %s[byte %zu], past the %zu bytes of dynamic shared "
                           "memory the launch asked for",
                           l.k->name, bidx.x, bidx.y, bidx.z, d.name, i, l.dyn_smem);
    }
    return "";
}

// Faults in the device range (or a fiber's stack guard) during a kernel end that kernel's block.
struct sigaction g_old_segv, g_old_bus, g_old_ill, g_old_fpe;

[[noreturn]] void fault_exit() { fail(g_tls.fault); }

void on_fault(int sig, siginfo_t* si, void* uctx) {
    Tls& t = g_tls;
    const uint64_t a = (uint64_t)(uintptr_t)si->si_addr;
    auto* uc = static_cast<ucontext_t*>(uctx);
    if (t.block && t.fiber && !t.block->failed) {
        const bool write = (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;
        const uint64_t stacks = (uint64_t)(uintptr_t)t.stacks;
        const uint8_t* rip = reinterpret_cast<const uint8_t*>(uc->uc_mcontext.gregs[REG_RIP]);
        std::string what;
        if (sig == SIGILL && rip[0] == 0x0f && rip[1] == 0x0b) {
            // ud2: the kernels are built with -fsanitize=alignment trapping.
            what = "misaligned address: a load or store not aligned to the size of its type";
        } else if (sig == SIGILL) {
            what = "illegal instruction (a CPU feature this machine lacks?)";
        } else if (sig == SIGFPE) {
            what = "integer division by zero (or INT_MIN / -1): a GPU returns garbage, the emulator stops";
        } else if (in_device_range(a)) {
            what = fmt("illegal %s: ", write ? "write" : "read") + describe_address(a);
        } else if (a >= stacks && a < stacks + kStackSlot * t.nslots) {
            what = fmt("a thread overflowed its %zu KiB stack", kStack / 1024);
        } else {
            what = fmt("illegal %s of 0x%llx: not device memory (a null or host pointer?)", write ? "write" : "read",
                       (unsigned long long)a);
        }
        {
            snprintf(t.fault, sizeof t.fault, "%s", what.c_str());
            // Resume at fault_exit on the top of this fiber's own stack.
            const size_t slot = (size_t)(t.fiber - t.fibers) + 1;
            const uint64_t top = (stacks + slot * kStackSlot - 256) & ~uint64_t{15};
            uc->uc_mcontext.gregs[REG_RSP] = (greg_t)(top - 8);
            uc->uc_mcontext.gregs[REG_RIP] = (greg_t)(uintptr_t)&fault_exit;
            return;
        }
    }
    if (in_device_range(a)) {
        static const char msg[] = "kvgate cuda emulation: host code touched emulated device memory\n";
        (void)!write(2, msg, sizeof msg - 1);
    }
    struct sigaction& old = sig == SIGBUS ? g_old_bus : sig == SIGILL ? g_old_ill : sig == SIGFPE ? g_old_fpe : g_old_segv;
    if (old.sa_flags & SA_SIGINFO) {
        old.sa_sigaction(sig, si, uctx);
    } else if (old.sa_handler == SIG_IGN || old.sa_handler == SIG_DFL) {
        signal(sig, SIG_DFL);  // the fault repeats and ends the process as usual
    } else {
        old.sa_handler(sig);
    }
}

void install_fault_handler() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = &on_fault;
        // On the worker's alternate stack: a fiber that overflowed its own has no room left.
        sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &g_old_segv);
        sigaction(SIGBUS, &sa, &g_old_bus);
        sigaction(SIGILL, &sa, &g_old_ill);
        sigaction(SIGFPE, &sa, &g_old_fpe);
    });
}

// ---------------------------------------------------------------------------------------------
// Worker pool

class Pool {
  public:
    Pool() {
        unsigned n = std::thread::hardware_concurrency();
        if (const char* v = getenv("KVGATE_EMU_THREADS")) n = (unsigned)strtoul(v, nullptr, 10);
        n = std::max(1u, std::min(n, 64u));
        for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this] { loop(); });
    }

    void run(size_t n, const std::function<void(size_t)>& fn) {
        std::unique_lock<std::mutex> g(mu_);
        job_ = &fn;
        total_ = n;
        next_.store(0);
        active_ = (int)threads_.size();
        ++gen_;
        cv_.notify_all();
        done_cv_.wait(g, [this] { return active_ == 0; });
        job_ = nullptr;
    }

  private:
    void work() {
        for (size_t i; (i = next_.fetch_add(1)) < total_;) (*job_)(i);
    }
    // Only the pool's threads run blocks, so only they hold fiber stacks, each with an alternate
    // signal stack for the fault handler.
    void loop() {
        static constexpr size_t kAltStack = 64 * 1024;
        stack_t alt;
        alt.ss_sp = mmap(nullptr, kAltStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        alt.ss_size = kAltStack;
        alt.ss_flags = 0;
        if (alt.ss_sp != MAP_FAILED) sigaltstack(&alt, nullptr);
        uint64_t seen = 0;
        for (;;) {
            std::unique_lock<std::mutex> g(mu_);
            cv_.wait(g, [&] { return gen_ != seen; });
            seen = gen_;
            g.unlock();
            work();
            g.lock();
            if (--active_ == 0) done_cv_.notify_all();
        }
    }
    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    const std::function<void(size_t)>* job_ = nullptr;
    size_t total_ = 0;
    std::atomic<size_t> next_{0};
    int active_ = 0;
    uint64_t gen_ = 0;
};

Pool& pool() {
    static Pool* p = new Pool;  // never destroyed: its threads outlive static destructors
    return *p;
}
std::mutex g_pool_mu;  // one job at a time
}  // namespace

void parallel_for(size_t n, const std::function<void(size_t)>& fn) {
    std::lock_guard<std::mutex> g(g_pool_mu);
    pool().run(n, fn);
}

void set_schedule(int kind, uint64_t seed) {
    g_schedule.store(kind);
    g_seed.store(seed);
}

ThreadView& view() { return g_tls.view; }

void syncthreads(const char* file, int line) {
    Tls& t = g_tls;
    Block& b = *t.block;
    if (b.at_barrier == 0) {
        b.bar_file = file;
        b.bar_line = line;
    } else if (line != b.bar_line || strcmp(file, b.bar_file) != 0) {
        fail(fmt("waits at __syncthreads (%s:%d) while %d thread(s) wait at another one (%s:%d): divergent barriers",
                 base_name(file), line, b.at_barrier, base_name(b.bar_file), b.bar_line));
    }
    if (b.done > 0)
        fail(fmt("__syncthreads (%s:%d) reached by only some of the block's threads: %d of %d returned before it",
                 base_name(file), line, b.done, b.n));
    b.at_barrier++;
    if (b.at_barrier == b.n) {
        for (int i = 0; i < b.n; ++i)
            if (b.fibers[i].st == kAtBarrier) b.fibers[i].st = kReady;
        b.at_barrier = 0;
        return;
    }
    t.fiber->st = kAtBarrier;
    yield();
}

uint32_t warp_exchange(int kind, uint32_t mask, uint32_t value, int arg, int width, const char* file, int line) {
    static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                  "__syncwarp", "__ballot_sync", "__any_sync", "__all_sync"};
    Tls& t = g_tls;
    Block& b = *t.block;
    const int lane = t.linear % 32, warp = t.linear / 32;
    const int lanes = std::min(32, b.n - warp * 32);
    const char* name = names[kind];
    if (!(mask >> lane & 1))
        fail(fmt("%s (%s:%d) with mask 0x%08x, which leaves out lane %d, the caller", name, base_name(file), line,
                 mask, lane));
    if (lanes < 32 && (mask >> lanes) != 0)
        fail(fmt("%s (%s:%d) with mask 0x%08x names lanes this warp of %d threads does not have", name,
                 base_name(file), line, mask, lanes));
    if (width <= 0 || width > 32 || (width & (width - 1)))
        fail(fmt("%s (%s:%d) with width %d (not a power of two up to 32)", name, base_name(file), line, width));
    WarpSync& w = b.warps[warp];
    Group* g = nullptr;
    for (int i = 0; i < w.n; ++i) {
        Group& x = w.groups[i];
        if (x.mask == mask) {
            g = &x;
        } else if (x.mask & mask) {
            fail(fmt("%s (%s:%d) with mask 0x%08x while lanes 0x%08x of its warp wait at %s (%s:%d) with mask "
                     "0x%08x",
                     name, base_name(file), line, mask, x.arrived, names[x.kind], base_name(x.file), x.line, x.mask));
        }
    }
    if (!g) {
        g = &w.groups[w.n++];
        *g = Group{};
        g->mask = mask;
        g->kind = kind;
        g->file = file;
        g->line = line;
    } else if (kind != g->kind || line != g->line || strcmp(file, g->file) != 0) {
        fail(fmt("%s (%s:%d) while lanes 0x%08x of its warp wait at %s (%s:%d) with the same mask 0x%08x", name,
                 base_name(file), line, g->arrived, names[g->kind], base_name(g->file), g->line, mask));
    }
    for (int l = 0; l < lanes; ++l)
        if ((mask >> l & 1) && b.fibers[warp * 32 + l].st == kDone)
            fail(fmt("%s (%s:%d) with mask 0x%08x, but lane %d has returned", name, base_name(file), line, mask, l));
    // Source lanes as the hardware computes them within each width-wide segment.
    const int seg = lane & ~(width - 1);
    int src = lane;
    switch (kind) {
        case 0: src = seg + (arg & (width - 1)); break;
        case 1: src = lane - arg >= seg ? lane - arg : lane; break;
        case 2: src = lane + arg < seg + width ? lane + arg : lane; break;
        case 3: src = (lane ^ arg) < seg + width ? lane ^ arg : lane; break;
        default: break;
    }
    g->val[lane] = value;
    g->src[lane] = src;
    g->arrived |= 1u << lane;
    if (g->arrived != mask) {
        t.fiber->st = kAtWarp;
        yield();
        return w.out[lane];
    }
    // The last lane in: exchange, wake the others, go on.
    uint32_t ballot = 0;
    for (int l = 0; l < 32; ++l)
        if ((mask >> l & 1) && g->val[l]) ballot |= 1u << l;
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1)) continue;
        if (kind <= 3 && !(mask >> g->src[l] & 1))
            fail(fmt("%s (%s:%d): lane %d reads lane %d, which mask 0x%08x leaves out", name, base_name(file), line,
                     l, g->src[l], mask));
        switch (kind) {
            case 5: w.out[l] = ballot; break;
            case 6: w.out[l] = ballot != 0; break;
            case 7: w.out[l] = ballot == mask; break;
            case 4: w.out[l] = 0; break;
            default: w.out[l] = g->val[g->src[l]]; break;
        }
        if (warp * 32 + l != t.linear) b.fibers[warp * 32 + l].st = kReady;
    }
    *g = w.groups[--w.n];
    return w.out[lane];
}

void trap(const char* what, const char* file, int line) {
    fail(fmt("%s at %s:%d", what, base_name(file), line));
}

// ---------------------------------------------------------------------------------------------
// Launches

Launch make_launch(const KernelInfo* k, const unsigned grid[3], const unsigned block[3], size_t dyn, void** params) {
    Launch l;
    l.k = k;
    for (int i = 0; i < 3; ++i) {
        l.grid[i] = grid[i];
        l.block[i] = block[i];
    }
    l.dyn_smem = dyn;
    size_t off = 0;
    for (int i = 0; i < k->nargs; ++i) {
        off = round_up(off, std::max<size_t>(8, k->arg_aligns[i]));
        l.offsets.push_back(off);
        off += k->arg_sizes[i];
    }
    l.args.resize(off);
    for (int i = 0; i < k->nargs; ++i) memcpy(l.args.data() + l.offsets[i], params[i], k->arg_sizes[i]);
    return l;
}

int check_launch(const Launch& l, size_t static_smem, int regs, size_t max_dyn, std::string* err) {
    const char* name = l.k->name;
    const unsigned long threads = (unsigned long)l.block[0] * l.block[1] * l.block[2];
    if (!l.grid[0] || !l.grid[1] || !l.grid[2] || !threads) {
        *err = fmt("launch of %s with an empty grid (%u,%u,%u) or block (%u,%u,%u)", name, l.grid[0], l.grid[1],
                   l.grid[2], l.block[0], l.block[1], l.block[2]);
        return kInvalidValue;
    }
    if (l.block[0] > 1024 || l.block[1] > 1024 || l.block[2] > 64 || threads > kMaxThreadsPerBlock) {
        *err = fmt("launch of %s with block (%u,%u,%u): %lu threads, an H200 allows at most 1024 per block "
                   "(and 1024 x 1024 x 64)", name, l.block[0], l.block[1], l.block[2], threads);
        return kInvalidValue;
    }
    if (l.grid[1] > 65535 || l.grid[2] > 65535 || l.grid[0] > 2147483647u) {
        *err = fmt("launch of %s with grid (%u,%u,%u): y and z allow at most 65535", name, l.grid[0], l.grid[1],
                   l.grid[2]);
        return kInvalidValue;
    }
    if (l.k->launch_bounds && threads > (unsigned long)l.k->launch_bounds) {
        *err = fmt("launch of %s with %lu threads per block, more than its __launch_bounds__(%d)", name, threads,
                   l.k->launch_bounds);
        return kLaunchOutOfResources;
    }
    if (regs > 0 && (long)regs * (long)round_up(threads, 32) > kRegistersPerSm) {
        *err = fmt("launch of %s with %lu threads of %d registers each: more than the 65536 registers of an SM",
                   name, threads, regs);
        return kLaunchOutOfResources;
    }
    if (l.dyn_smem > max_dyn || static_smem + l.dyn_smem > kMaxSharedPerBlockOptin) {
        *err = fmt("launch of %s with %zu bytes of dynamic shared memory (%zu static): the limit is %zu without "
                   "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) and %zu with it",
                   name, l.dyn_smem, static_smem, kDefaultSharedPerBlock - std::min(static_smem, kDefaultSharedPerBlock),
                   kMaxSharedPerBlockOptin - std::min(static_smem, kMaxSharedPerBlockOptin));
        return kInvalidValue;
    }
    // A pointer argument must point into device (or pinned host) memory: a GPU faults on any other.
    for (int i = 0; i < l.k->nargs; ++i) {
        if (!(l.k->pointer_args >> i & 1)) continue;
        uint64_t p;
        memcpy(&p, l.args.data() + l.offsets[i], 8);
        if (p == 0 || classify(p) != MemKind::Pageable) continue;
        *err = fmt("launch of %s: argument %d is 0x%llx, a host address (not device memory)", name, i,
                   (unsigned long long)p);
        return kIllegalAddress;
    }
    return kSuccess;
}

int execute(const Launch& l, std::string* err) {
    install_fault_handler();
    const uint64_t launch = g_launches.fetch_add(1);
    int kind = g_schedule.load();
    if (kind == 0) kind = 1 + (int)(launch % 3);
    std::vector<int> order;
    order_for(kind, g_seed.load() ^ (launch * 0x9e3779b97f4a7c15ull),
              (int)(l.block[0] * l.block[1] * l.block[2]), &order);
    const size_t blocks = (size_t)l.grid[0] * l.grid[1] * l.grid[2];
    std::mutex mu;
    std::string first;
    std::atomic<bool> stop{false};
    parallel_for(blocks, [&](size_t i) {
        if (stop.load(std::memory_order_relaxed)) return;
        const uint3 bidx{(unsigned)(i % l.grid[0]), (unsigned)(i / l.grid[0] % l.grid[1]),
                         (unsigned)(i / ((size_t)l.grid[0] * l.grid[1]))};
        std::string e = run_block(l, bidx, order);
        if (!e.empty()) {
            std::lock_guard<std::mutex> g(mu);
            if (first.empty()) first = e;
            stop.store(true);
        }
    });
    if (!first.empty()) {
        *err = first;
        if (first.find("misaligned address") != std::string::npos) return kMisalignedAddress;
        return first.find("illegal ") != std::string::npos ? kIllegalAddress : kLaunchFailed;
    }
    // Writes that stayed inside an allocation's page but past its end (or before its start).
    for (int i = 0; i < l.k->nargs; ++i) {
        if (!(l.k->pointer_args >> i & 1)) continue;
        uint64_t p;
        memcpy(&p, l.args.data() + l.offsets[i], 8);
        std::string why;
        if (!allocation_intact(p, &why)) {
            *err = fmt("kernel %s (argument %d): ", l.k->name, i) + why;
            return kIllegalAddress;
        }
    }
    return kSuccess;
}

}  // namespace kvgate_emu

// ---------------------------------------------------------------------------------------------
// Direct entry points (the harness's own tests, no driver involved)

using namespace kvgate_emu;

KVGATE_EMU_API uint64_t kvgate_emu_malloc(size_t bytes) {
    std::string err;
    return dev_alloc(bytes, &err);
}

KVGATE_EMU_API int kvgate_emu_free(uint64_t p) {
    std::string err;
    return dev_free(p, &err);
}

KVGATE_EMU_API void kvgate_emu_set_schedule(int kind, uint64_t seed) { set_schedule(kind, seed); }

// Runs kernel `name` at once; returns a CUresult and writes the failure into err.
KVGATE_EMU_API int kvgate_emu_run(const char* name, const unsigned grid[3], const unsigned block[3], size_t dyn,
                                  size_t max_dyn, void** params, char* err, size_t err_len) {
    std::string e;
    int code = kSuccess;
    const KernelInfo* k = find_kernel(name);
    if (!k) {
        e = std::string("no kernel named ") + name;
        code = kNotFound;
    } else {
        Launch l = make_launch(k, grid, block, dyn, params);
        code = check_launch(l, 0, 0, max_dyn, &e);
        if (code == kSuccess) code = execute(l, &e);
    }
    if (err_len) snprintf(err, err_len, "%s", e.c_str());
    return code;
}
