// The kvgate CUDA emulator's runtime, shared by the kernel registry, the stand-in driver and
// cuBLAS: the kernel registry, emulated device memory, and kernel execution on fibers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define KVGATE_EMU_API extern "C" __attribute__((visibility("default")))

namespace kvgate_emu {

// CUresult values the emulator returns.
enum Code : int {
    kSuccess = 0,
    kInvalidValue = 1,
    kOutOfMemory = 2,
    kNotInitialized = 3,
    kInvalidDevice = 101,
    kInvalidImage = 200,
    kInvalidContext = 201,
    kInvalidHandle = 400,
    kNotFound = 500,
    kNotReady = 600,
    kIllegalAddress = 700,
    kLaunchOutOfResources = 701,
    kIllegalInstruction = 715,
    kMisalignedAddress = 716,
    kLaunchFailed = 719,
    kNotSupported = 801,
};

// H200 (sm_90) limits the launch checks enforce.
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr size_t kDefaultSharedPerBlock = 48 * 1024;
constexpr size_t kMaxSharedPerBlockOptin = 232448;  // 227 KiB
constexpr int kRegistersPerSm = 65536;
constexpr size_t kDynSmemCap = kMaxSharedPerBlockOptin;
constexpr size_t kPage = 4096;

inline size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

struct KernelInfo {
    const char* name;
    int launch_bounds;  // __launch_bounds__ max threads, 0 when none
    void (*fn)();
    void (*invoke)(void (*)(), void**);
    int nargs;
    const uint16_t* arg_sizes;
    const uint16_t* arg_aligns;
    uint64_t pointer_args;  // bit i: argument i is a pointer
};

template <typename... A>
struct Signature {
    static constexpr uint16_t sizes[sizeof...(A) + 1] = {(uint16_t)sizeof(A)..., 0};
    static constexpr uint16_t aligns[sizeof...(A) + 1] = {(uint16_t)alignof(A)..., 0};
    template <size_t... I>
    static void call(void (*f)(A...), void** p, std::index_sequence<I...>) {
        f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
    }
    static void invoke(void (*raw)(), void** p) {
        call(reinterpret_cast<void (*)(A...)>(raw), p, std::index_sequence_for<A...>{});
    }
    template <size_t... I>
    static constexpr uint64_t pointers(std::index_sequence<I...>) {
        return (uint64_t{0} | ... | ((uint64_t)std::is_pointer<A>::value << I));
    }
};

template <typename... A>
KernelInfo kernel(const char* name, int launch_bounds, void (*f)(A...)) {
    return KernelInfo{name,
                      launch_bounds,
                      reinterpret_cast<void (*)()>(f),
                      &Signature<A...>::invoke,
                      (int)sizeof...(A),
                      Signature<A...>::sizes,
                      Signature<A...>::aligns,
                      Signature<A...>::pointers(std::index_sequence_for<A...>{})};
}

struct Registrar {
    Registrar(const KernelInfo* k, int n);
};
const KernelInfo* find_kernel(const std::string& name);

// The dynamic shared memory arrays (extern __shared__), each kDynSmemCap bytes per worker.
struct DynSmem {
    void* (*addr)();
    const char* name;
};
struct DynRegistrar {
    DynRegistrar(const DynSmem* d, int n);
};

// Emulated device memory: a reserved address range; each allocation sits between
// inaccessible guard pages, its end at a page's end (rounded to 16 bytes), and is made
// inaccessible again when freed.
enum class MemKind { Device, Pinned, Pageable };
uint64_t dev_alloc(size_t bytes, std::string* err);
int dev_free(uint64_t p, std::string* err);
void* host_alloc(size_t bytes);
int host_free(void* p);
MemKind classify(uint64_t p);
// Whether [p, p + bytes) lies inside one live device or pinned allocation; else why not.
bool range_ok(uint64_t p, size_t bytes, std::string* why);
void mem_info(size_t* free_bytes, size_t* total_bytes);
// For the fault handler and the launch checks: whether `a` is in the device range, why an
// address there is not a live allocation's byte, and whether the allocation holding `p` (if any)
// still has its canaries (else why not).
bool in_device_range(uint64_t a);
std::string describe_address(uint64_t a);
bool allocation_intact(uint64_t p, std::string* why);

// printf into a std::string (messages of at most 1 KiB).
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));

// One launch, arguments copied.
struct Launch {
    const KernelInfo* k = nullptr;
    unsigned grid[3] = {1, 1, 1};
    unsigned block[3] = {1, 1, 1};
    size_t dyn_smem = 0;
    std::vector<unsigned char> args;
    std::vector<size_t> offsets;
};

// Checks a launch as an H200 would, given the function's static shared memory, registers and
// dynamic shared memory allowance. Returns a Code; `err` says why.
int check_launch(const Launch& l, size_t static_smem, int regs, size_t max_dyn, std::string* err);
// Builds a Launch from a driver-style parameter array (each params[i] points at argument i).
Launch make_launch(const KernelInfo* k, const unsigned grid[3], const unsigned block[3], size_t dyn,
                   void** params);
// Runs every block; returns a Code (kSuccess, kIllegalAddress, kLaunchFailed, ...).
int execute(const Launch& l, std::string* err);

// Runs fn(i) for i in [0, n) on the worker pool (the caller works too).
void parallel_for(size_t n, const std::function<void(size_t)>& fn);

// Thread orders inside a block: 0 rotates (forward, reverse, seeded shuffle by launch), 1 forward,
// 2 reverse, 3 shuffle.
void set_schedule(int kind, uint64_t seed);

}  // namespace kvgate_emu
