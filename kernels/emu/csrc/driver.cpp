// The stand-in CUDA driver: the driver API entry points kvgate's backend (through cudarc) calls,
// on the emulator's memory and kernels. One emulated device, "kvgate emulated H200", sm_90.
//
// Streams run in order and lazily: queued work runs only when the host waits for it (a stream,
// event or context synchronize, a synchronous copy, a free) or when a copy to pageable host
// memory needs it, so a result read without synchronizing is the stale value, every time. A
// failed kernel makes the context's error sticky, as on a GPU: every later call returns it, and
// cuGetErrorString gives the emulator's explanation.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "runtime.h"

using namespace kvgate_emu;

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

namespace {

struct Function {
    const KernelInfo* k;
    int regs;
    size_t static_smem;
    size_t max_dyn;
};

struct Module {
    std::vector<std::unique_ptr<Function>> funcs;
};

struct Op {
    std::function<int(std::string*)> run;
};

struct Stream {
    std::deque<Op> queue;
    uint64_t queued = 0;  // ops ever queued
    uint64_t done = 0;    // ops ever run
};

struct Event {
    Stream* stream = nullptr;
    uint64_t at = 0;
    std::chrono::steady_clock::time_point when;
};

struct Driver {
    std::recursive_mutex mu;
    bool initialized = false;
    int sticky = kSuccess;
    std::string sticky_msg;
    std::map<int, std::string> last;  // the last explanation of each error code
    std::set<std::string> interned;   // cuGetErrorString results stay valid
    Stream null_stream;
    std::vector<Stream*> streams;
    // Destroyed streams and events stay allocated: queued work may still name them.
    std::vector<Stream*> retired_streams;
    int ctx_refs = 0;
};

Driver& drv() {
    static Driver* d = new Driver;
    return *d;
}

int g_context_token;  // the one context's handle points here
// Nonzero-initialized, so that it lives in the TLS image and not in the .tbss the harness poisons
// as shared memory: 1 when the context is current on this thread, -1 when not.
thread_local int g_current = -1;

void log_failure(int code, const std::string& msg) {
    fprintf(stderr, "kvgate cuda emulation: error %d: %s\n", code, msg.c_str());
}

// Runs `s`'s queue up to op number `upto`. A failure empties every queue and sticks.
int flush(Stream* s, uint64_t upto) {
    Driver& d = drv();
    while (s->done < upto && !s->queue.empty()) {
        Op op = std::move(s->queue.front());
        s->queue.pop_front();
        s->done++;
        if (d.sticky != kSuccess) continue;
        std::string err;
        const int code = op.run(&err);
        if (code != kSuccess) {
            d.sticky = code;
            d.sticky_msg = err;
            d.last[code] = err;
            log_failure(code, err);
        }
    }
    return d.sticky;
}

int flush_all() {
    Driver& d = drv();
    flush(&d.null_stream, d.null_stream.queued);
    for (Stream* s : d.streams) flush(s, s->queued);
    return d.sticky;
}

Stream* stream_of(void* h) {
    return h ? static_cast<Stream*>(h) : &drv().null_stream;
}

void enqueue(Stream* s, std::function<int(std::string*)> fn) {
    s->queue.push_back(Op{std::move(fn)});
    s->queued++;
}

#define API_ENTRY                                                  \
    Driver& d = drv();                                             \
    std::lock_guard<std::recursive_mutex> guard(d.mu);             \
    if (!d.initialized) return kNotInitialized;                    \
    if (d.sticky != kSuccess) return d.sticky

int fail_now(int code, const std::string& msg) {
    log_failure(code, msg);
    drv().last[code] = msg;
    return code;
}

// A typed copy's sides must be the kinds its name says (the driver checks too).
int check_direction(const char* op, bool dst_device, bool src_device, uint64_t dst, uint64_t src) {
    const bool dd = classify(dst) == MemKind::Device, sd = classify(src) == MemKind::Device;
    if (dd == dst_device && sd == src_device) return kSuccess;
    return fail_now(kInvalidValue, std::string(op) + ": the " + (dd != dst_device ? "destination" : "source") +
                                       " is " + ((dd != dst_device ? dd : sd) ? "device" : "host") +
                                       " memory (swapped arguments?)");
}

// Copies of `bytes` bytes; each side is checked against its allocation when it is device or
// pinned memory.
int copy_checked(uint64_t dst, uint64_t src, size_t bytes, const char* op, std::string* err) {
    std::string why;
    if (classify(dst) != MemKind::Pageable && !range_ok(dst, bytes, &why)) {
        *err = std::string(op) + ": destination: " + why;
        return kInvalidValue;
    }
    if (classify(src) != MemKind::Pageable && !range_ok(src, bytes, &why)) {
        *err = std::string(op) + ": source: " + why;
        return kInvalidValue;
    }
    memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
    return kSuccess;
}

// An asynchronous copy: pageable sources are staged at once (the caller may reuse them), pageable
// destinations are written before the call returns (the driver waits for the stream), pinned and
// device memory are touched only when the stream gets there.
int copy_async(uint64_t dst, uint64_t src, size_t bytes, void* stream, const char* op) {
    if (bytes == 0) return kSuccess;
    Stream* s = stream_of(stream);
    const MemKind dk = classify(dst), sk = classify(src);
    std::string why;
    if (dk != MemKind::Pageable && !range_ok(dst, bytes, &why))
        return fail_now(kInvalidValue, std::string(op) + ": destination: " + why);
    if (sk != MemKind::Pageable && !range_ok(src, bytes, &why))
        return fail_now(kInvalidValue, std::string(op) + ": source: " + why);
    if (dk == MemKind::Pageable) {
        if (const int e = flush(s, s->queued)) return e;
        std::string err;
        const int code = copy_checked(dst, src, bytes, op, &err);
        return code == kSuccess ? code : fail_now(code, err);
    }
    if (sk == MemKind::Pageable) {
        auto staged = std::make_shared<std::vector<unsigned char>>(bytes);
        memcpy(staged->data(), reinterpret_cast<const void*>(src), bytes);
        enqueue(s, [=](std::string* err) { return copy_checked(dst, (uint64_t)staged->data(), bytes, op, err); });
        return kSuccess;
    }
    enqueue(s, [=](std::string* err) { return copy_checked(dst, src, bytes, op, err); });
    return kSuccess;
}

int copy_sync(uint64_t dst, uint64_t src, size_t bytes, const char* op) {
    if (const int e = flush_all()) return e;
    if (bytes == 0) return kSuccess;
    std::string err;
    const int code = copy_checked(dst, src, bytes, op, &err);
    return code == kSuccess ? code : fail_now(code, err);
}

int memset_op(uint64_t dst, unsigned char value, size_t bytes, std::string* err) {
    std::string why;
    if (!range_ok(dst, bytes, &why)) {
        *err = "cuMemsetD8: " + why;
        return kInvalidValue;
    }
    memset(reinterpret_cast<void*>(dst), value, bytes);
    return kSuccess;
}

// Kernel names, registers and static shared memory from a module image: an sm_XX cubin (ELF:
// `.text.<kernel>` sections, registers in the top byte of sh_info, `.nv.shared.<kernel>` sizes)
// or PTX text (`.entry <kernel>(`).
struct ImageKernel {
    int regs = 0;
    size_t static_smem = 0;
};

bool parse_image(const unsigned char* img, std::map<std::string, ImageKernel>* out, std::string* err) {
    if (memcmp(img, "\x7f" "ELF", 4) == 0) {
        if (img[4] != 2) {
            *err = "a 32-bit ELF image";
            return false;
        }
        uint64_t shoff;
        uint16_t shentsize, shnum, shstrndx;
        memcpy(&shoff, img + 0x28, 8);
        memcpy(&shentsize, img + 0x3a, 2);
        memcpy(&shnum, img + 0x3c, 2);
        memcpy(&shstrndx, img + 0x3e, 2);
        auto sh = [&](int i) { return img + shoff + (size_t)i * shentsize; };
        uint64_t stroff;
        memcpy(&stroff, sh(shstrndx) + 24, 8);
        const char* names = reinterpret_cast<const char*>(img + stroff);
        std::map<std::string, size_t> shared;
        for (int i = 0; i < shnum; ++i) {
            uint32_t name, info;
            uint64_t size;
            memcpy(&name, sh(i), 4);
            memcpy(&size, sh(i) + 32, 8);
            memcpy(&info, sh(i) + 44, 4);
            const std::string n = names + name;
            if (n.rfind(".text.", 0) == 0) (*out)[n.substr(6)].regs = (int)(info >> 24);
            if (n.rfind(".nv.shared.", 0) == 0) shared[n.substr(11)] = size;
        }
        for (auto& [name, k] : *out)
            if (shared.count(name)) k.static_smem = shared[name];
        return true;
    }
    const char* text = reinterpret_cast<const char*>(img);
    for (const char* p = strstr(text, ".entry "); p; p = strstr(p + 1, ".entry ")) {
        const char* s = p + 7;
        const char* e = s;
        while (*e && *e != '(' && *e != ' ' && *e != '\n') ++e;
        (*out)[std::string(s, e)] = ImageKernel{};
    }
    if (out->empty()) {
        *err = "neither a cubin nor PTX with .entry points";
        return false;
    }
    return true;
}

struct Attr {
    int id, value;
};
// H200 values of the device attributes (CUdevice_attribute ids).
const Attr kAttrs[] = {
    {1, 1024},        {2, 1024},        {3, 1024},        {4, 64},          {5, 2147483647}, {6, 65535},
    {7, 65535},       {8, 49152},       {9, 65536},       {10, 32},         {11, 2147483647}, {12, 65536},
    {13, 1980000},    {14, 512},        {15, 1},          {16, 132},        {17, 0},          {18, 0},
    {19, 1},          {20, 0},          {31, 1},          {32, 0},          {33, 0},          {34, 0},
    {35, 0},          {36, 2619000},    {37, 6144},       {38, 52428800},   {39, 2048},       {40, 2},
    {41, 1},          {75, 9},          {76, 0},          {78, 1},          {79, 1},          {80, 1},
    {81, 233472},     {82, 65536},      {83, 1},          {84, 1},          {85, 0},          {86, 0},
    {87, 0},          {88, 0},          {89, 1},          {90, 0},          {91, 1},          {95, 1},
    {96, 1},          {97, 232448},     {98, 0},          {99, 1},          {100, 0},         {101, 1},
    {102, 1},         {106, 32},        {111, 1024},      {115, 1},         {116, 0},
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Initialization, devices, contexts

KVGATE_EMU_API CUresult cuInit(unsigned flags) {
    if (flags != 0) return kInvalidValue;
    Driver& d = drv();
    std::lock_guard<std::recursive_mutex> g(d.mu);
    d.initialized = true;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuDriverGetVersion(int* v) {
    if (!v) return kInvalidValue;
    *v = 12080;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuDeviceGetCount(int* n) {
    API_ENTRY;
    if (!n) return kInvalidValue;
    *n = 1;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
    API_ENTRY;
    if (!dev) return kInvalidValue;
    if (ordinal != 0) return kInvalidDevice;
    *dev = 0;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
    API_ENTRY;
    if (dev != 0) return kInvalidDevice;
    if (!name || len <= 0) return kInvalidValue;
    snprintf(name, (size_t)len, "kvgate emulated H200 (CPU)");
    return kSuccess;
}

KVGATE_EMU_API CUresult cuDeviceGetAttribute(int* value, int attr, CUdevice dev) {
    API_ENTRY;
    if (dev != 0) return kInvalidDevice;
    if (!value) return kInvalidValue;
    *value = 0;
    for (const Attr& a : kAttrs)
        if (a.id == attr) *value = a.value;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
    API_ENTRY;
    if (dev != 0) return kInvalidDevice;
    size_t free_bytes;
    mem_info(&free_bytes, bytes);
    return kSuccess;
}

KVGATE_EMU_API CUresult cuDeviceGetUuid(unsigned char* uuid, CUdevice dev) {
    API_ENTRY;
    if (dev != 0 || !uuid) return kInvalidValue;
    memcpy(uuid, "kvgate-emulated!", 16);
    return kSuccess;
}

KVGATE_EMU_API CUresult cuDeviceGetUuid_v2(unsigned char* uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

KVGATE_EMU_API CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice dev) {
    API_ENTRY;
    if (dev != 0) return kInvalidDevice;
    if (!ctx) return kInvalidValue;
    d.ctx_refs++;
    *ctx = &g_context_token;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    Driver& d = drv();
    std::lock_guard<std::recursive_mutex> g(d.mu);
    if (dev != 0) return kInvalidDevice;
    if (d.ctx_refs > 0 && --d.ctx_refs == 0) flush_all();
    return kSuccess;
}

KVGATE_EMU_API CUresult cuCtxSetCurrent(void* ctx) {
    if (ctx && ctx != &g_context_token) return kInvalidContext;
    g_current = ctx ? 1 : -1;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuCtxGetCurrent(void** ctx) {
    if (!ctx) return kInvalidValue;
    *ctx = g_current == 1 ? &g_context_token : nullptr;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuCtxGetDevice(CUdevice* dev) {
    if (!dev) return kInvalidValue;
    *dev = 0;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuCtxSynchronize() {
    API_ENTRY;
    return flush_all();
}

KVGATE_EMU_API CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuCtxSetLimit(int, size_t) { return kSuccess; }
KVGATE_EMU_API CUresult cuCtxGetLimit(size_t* v, int) {
    if (v) *v = 0;
    return kSuccess;
}
KVGATE_EMU_API CUresult cuCtxSetCacheConfig(int) { return kSuccess; }
KVGATE_EMU_API CUresult cuCtxGetCacheConfig(int* c) {
    if (c) *c = 0;
    return kSuccess;
}
KVGATE_EMU_API CUresult cuCtxSetFlags(unsigned) { return kSuccess; }

KVGATE_EMU_API CUresult cuGetErrorName(CUresult code, const char** out) {
    if (!out) return kInvalidValue;
    switch (code) {
        case kSuccess: *out = "CUDA_SUCCESS"; break;
        case kInvalidValue: *out = "CUDA_ERROR_INVALID_VALUE"; break;
        case kOutOfMemory: *out = "CUDA_ERROR_OUT_OF_MEMORY"; break;
        case kNotInitialized: *out = "CUDA_ERROR_NOT_INITIALIZED"; break;
        case kInvalidDevice: *out = "CUDA_ERROR_INVALID_DEVICE"; break;
        case kInvalidImage: *out = "CUDA_ERROR_INVALID_IMAGE"; break;
        case kInvalidContext: *out = "CUDA_ERROR_INVALID_CONTEXT"; break;
        case kInvalidHandle: *out = "CUDA_ERROR_INVALID_HANDLE"; break;
        case kNotFound: *out = "CUDA_ERROR_NOT_FOUND"; break;
        case kNotReady: *out = "CUDA_ERROR_NOT_READY"; break;
        case kIllegalAddress: *out = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
        case kLaunchOutOfResources: *out = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"; break;
        case kLaunchFailed: *out = "CUDA_ERROR_LAUNCH_FAILED"; break;
        case kMisalignedAddress: *out = "CUDA_ERROR_MISALIGNED_ADDRESS"; break;
        case kNotSupported: *out = "CUDA_ERROR_NOT_SUPPORTED"; break;
        default: *out = "CUDA_ERROR_UNKNOWN"; return kInvalidValue;
    }
    return kSuccess;
}

// The emulator's explanation of the last failure with this code (emulated), else the name.
KVGATE_EMU_API CUresult cuGetErrorString(CUresult code, const char** out) {
    if (!out) return kInvalidValue;
    Driver& d = drv();
    std::lock_guard<std::recursive_mutex> g(d.mu);
    const char* name = nullptr;
    cuGetErrorName(code, &name);
    auto it = d.last.find(code);
    const std::string why = d.sticky == code ? d.sticky_msg : (it == d.last.end() ? "" : it->second);
    *out = d.interned.insert(std::string(name ? name : "CUDA_ERROR_UNKNOWN") + " (emulated)" + (why.empty() ? "" : ": " + why))
               .first->c_str();
    return kSuccess;
}

// ---------------------------------------------------------------------------------------------
// Memory

KVGATE_EMU_API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    API_ENTRY;
    if (!free_bytes || !total) return kInvalidValue;
    mem_info(free_bytes, total);
    return kSuccess;
}

KVGATE_EMU_API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    API_ENTRY;
    if (!p || bytes == 0) return kInvalidValue;
    std::string err;
    *p = dev_alloc(bytes, &err);
    return *p ? kSuccess : fail_now(kOutOfMemory, err);
}

KVGATE_EMU_API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, void*) { return cuMemAlloc_v2(p, bytes); }

KVGATE_EMU_API CUresult cuMemFree_v2(CUdeviceptr p) {
    Driver& d = drv();
    std::lock_guard<std::recursive_mutex> g(d.mu);
    flush_all();
    std::string err;
    const int code = dev_free(p, &err);
    return code == kSuccess ? code : fail_now(code, "cuMemFree: " + err);
}

KVGATE_EMU_API CUresult cuMemFreeAsync(CUdeviceptr p, void* stream) {
    Driver& d = drv();
    std::lock_guard<std::recursive_mutex> g(d.mu);
    enqueue(stream_of(stream), [p](std::string* err) {
        std::string why;
        const int code = dev_free(p, &why);
        if (code != kSuccess) *err = "cuMemFreeAsync: " + why;
        return code;
    });
    return kSuccess;
}

KVGATE_EMU_API CUresult cuMemHostAlloc(void** pp, size_t bytes, unsigned) {
    API_ENTRY;
    if (!pp) return kInvalidValue;
    *pp = host_alloc(bytes);
    return *pp ? kSuccess : kOutOfMemory;
}

KVGATE_EMU_API CUresult cuMemAllocHost_v2(void** pp, size_t bytes) { return cuMemHostAlloc(pp, bytes, 0); }

KVGATE_EMU_API CUresult cuMemFreeHost(void* p) {
    Driver& d = drv();
    std::lock_guard<std::recursive_mutex> g(d.mu);
    flush_all();
    return host_free(p);
}

KVGATE_EMU_API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* dp, void* p, unsigned) {
    if (!dp) return kInvalidValue;
    *dp = (CUdeviceptr)p;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    API_ENTRY;
    if (const int e = check_direction("cuMemcpyHtoD", true, false, dst, (uint64_t)src)) return e;
    return copy_sync(dst, (uint64_t)src, n, "cuMemcpyHtoD");
}
KVGATE_EMU_API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    API_ENTRY;
    if (const int e = check_direction("cuMemcpyDtoH", false, true, (uint64_t)dst, src)) return e;
    return copy_sync((uint64_t)dst, src, n, "cuMemcpyDtoH");
}
KVGATE_EMU_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    API_ENTRY;
    if (const int e = check_direction("cuMemcpyDtoD", true, true, dst, src)) return e;
    return copy_sync(dst, src, n, "cuMemcpyDtoD");
}
KVGATE_EMU_API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    API_ENTRY;
    return copy_sync(dst, src, n, "cuMemcpy");
}
KVGATE_EMU_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
    API_ENTRY;
    if (const int e = check_direction("cuMemcpyHtoDAsync", true, false, dst, (uint64_t)src)) return e;
    return copy_async(dst, (uint64_t)src, n, s, "cuMemcpyHtoDAsync");
}
KVGATE_EMU_API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
    API_ENTRY;
    if (const int e = check_direction("cuMemcpyDtoHAsync", false, true, (uint64_t)dst, src)) return e;
    return copy_async((uint64_t)dst, src, n, s, "cuMemcpyDtoHAsync");
}
KVGATE_EMU_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    API_ENTRY;
    if (const int e = check_direction("cuMemcpyDtoDAsync", true, true, dst, src)) return e;
    return copy_async(dst, src, n, s, "cuMemcpyDtoDAsync");
}
KVGATE_EMU_API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    API_ENTRY;
    return copy_async(dst, src, n, s, "cuMemcpyAsync");
}

KVGATE_EMU_API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    API_ENTRY;
    if (const int e = flush_all()) return e;
    std::string err;
    const int code = memset_op(dst, v, n, &err);
    return code == kSuccess ? code : fail_now(code, err);
}

KVGATE_EMU_API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void* s) {
    API_ENTRY;
    std::string why;
    if (!range_ok(dst, n, &why)) return fail_now(kInvalidValue, "cuMemsetD8Async: " + why);
    enqueue(stream_of(s), [=](std::string* err) { return memset_op(dst, v, n, err); });
    return kSuccess;
}

// ---------------------------------------------------------------------------------------------
// Streams and events

KVGATE_EMU_API CUresult cuStreamCreate(void** out, unsigned) {
    API_ENTRY;
    if (!out) return kInvalidValue;
    Stream* s = new Stream;
    d.streams.push_back(s);
    *out = s;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuStreamCreateWithPriority(void** out, unsigned flags, int) { return cuStreamCreate(out, flags); }

KVGATE_EMU_API CUresult cuStreamDestroy_v2(void* h) {
    Driver& d = drv();
    std::lock_guard<std::recursive_mutex> g(d.mu);
    Stream* s = static_cast<Stream*>(h);
    auto it = std::find(d.streams.begin(), d.streams.end(), s);
    if (it == d.streams.end()) return kInvalidHandle;
    flush(s, s->queued);  // a destroyed stream's work still completes
    d.streams.erase(it);
    d.retired_streams.push_back(s);
    return kSuccess;
}

KVGATE_EMU_API CUresult cuStreamSynchronize(void* h) {
    API_ENTRY;
    Stream* s = stream_of(h);
    return flush(s, s->queued);
}

KVGATE_EMU_API CUresult cuStreamQuery(void* h) { return cuStreamSynchronize(h); }

KVGATE_EMU_API CUresult cuStreamWaitEvent(void* h, void* ev, unsigned) {
    API_ENTRY;
    Event* e = static_cast<Event*>(ev);
    if (!e) return kInvalidHandle;
    Stream* other = e->stream;
    const uint64_t at = e->at;
    if (other && other != stream_of(h)) enqueue(stream_of(h), [other, at](std::string*) { return flush(other, at); });
    return kSuccess;
}

KVGATE_EMU_API CUresult cuLaunchHostFunc(void* h, void (*fn)(void*), void* data) {
    API_ENTRY;
    enqueue(stream_of(h), [fn, data](std::string*) {
        fn(data);
        return kSuccess;
    });
    return kSuccess;
}

KVGATE_EMU_API CUresult cuEventCreate(void** out, unsigned) {
    API_ENTRY;
    if (!out) return kInvalidValue;
    *out = new Event;
    return kSuccess;
}

// Events are never freed: a queued record may still write into one (cudarc records, then drops).
KVGATE_EMU_API CUresult cuEventDestroy_v2(void* ev) { return ev ? kSuccess : kInvalidHandle; }

KVGATE_EMU_API CUresult cuEventRecord(void* ev, void* h) {
    API_ENTRY;
    Event* e = static_cast<Event*>(ev);
    if (!e) return kInvalidHandle;
    Stream* s = stream_of(h);
    enqueue(s, [e](std::string*) {
        e->when = std::chrono::steady_clock::now();
        return kSuccess;
    });
    e->stream = s;
    e->at = s->queued;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuEventRecordWithFlags(void* ev, void* h, unsigned) { return cuEventRecord(ev, h); }

KVGATE_EMU_API CUresult cuEventSynchronize(void* ev) {
    API_ENTRY;
    Event* e = static_cast<Event*>(ev);
    if (!e) return kInvalidHandle;
    return e->stream ? flush(e->stream, e->at) : kSuccess;
}

// A query is where a polling host sees progress: the stream runs up to the event.
KVGATE_EMU_API CUresult cuEventQuery(void* ev) { return cuEventSynchronize(ev); }

KVGATE_EMU_API CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
    API_ENTRY;
    Event* a = static_cast<Event*>(start);
    Event* b = static_cast<Event*>(end);
    if (!ms || !a || !b) return kInvalidValue;
    if (a->stream && a->stream->done < a->at) return kNotReady;
    if (b->stream && b->stream->done < b->at) return kNotReady;
    *ms = std::chrono::duration<float, std::milli>(b->when - a->when).count();
    return kSuccess;
}

KVGATE_EMU_API CUresult cuEventElapsedTime_v2(float* ms, void* start, void* end) { return cuEventElapsedTime(ms, start, end); }

// ---------------------------------------------------------------------------------------------
// Modules and launches

KVGATE_EMU_API CUresult cuModuleLoadData(void** out, const void* image) {
    API_ENTRY;
    if (!out || !image) return kInvalidValue;
    std::map<std::string, ImageKernel> found;
    std::string err;
    if (!parse_image(static_cast<const unsigned char*>(image), &found, &err))
        return fail_now(kInvalidImage, "cuModuleLoadData: " + err);
    auto* m = new Module;
    for (auto& [name, info] : found) {
        const KernelInfo* k = find_kernel(name);
        if (!k) continue;  // looked up by name later: a miss is cuModuleGetFunction's error
        m->funcs.push_back(std::unique_ptr<Function>(
            new Function{k, info.regs, info.static_smem, kDefaultSharedPerBlock - std::min(info.static_smem, kDefaultSharedPerBlock)}));
    }
    // Names the image has and the emulator lacks: remember them for the error below.
    for (auto& [name, info] : found)
        if (!find_kernel(name)) d.last[kNotFound] = "cuModuleLoadData: kernel " + name + " has no emulated build";
    *out = m;
    return kSuccess;
}

KVGATE_EMU_API CUresult cuModuleUnload(void* mod) {
    delete static_cast<Module*>(mod);
    return kSuccess;
}

KVGATE_EMU_API CUresult cuModuleGetFunction(void** out, void* mod, const char* name) {
    API_ENTRY;
    Module* m = static_cast<Module*>(mod);
    if (!out || !m || !name) return kInvalidValue;
    for (auto& f : m->funcs)
        if (strcmp(f->k->name, name) == 0) {
            *out = f.get();
            return kSuccess;
        }
    // A miss is an answer, not a failure (the backend probes every module for every kernel): no log.
    d.last[kNotFound] = std::string("cuModuleGetFunction: no kernel ") + name + " in this module (or no emulated build of it)";
    return kNotFound;
}

KVGATE_EMU_API CUresult cuFuncGetAttribute(int* v, int attr, void* fn) {
    API_ENTRY;
    Function* f = static_cast<Function*>(fn);
    if (!v || !f) return kInvalidValue;
    switch (attr) {
        case 0: *v = f->k->launch_bounds ? f->k->launch_bounds : 1024; break;  // MAX_THREADS_PER_BLOCK
        case 1: *v = (int)f->static_smem; break;                                // SHARED_SIZE_BYTES
        case 4: *v = f->regs; break;                                           // NUM_REGS
        case 5: *v = 90; break;                                                // PTX_VERSION
        case 6: *v = 90; break;                                                // BINARY_VERSION
        case 8: *v = (int)f->max_dyn; break;                                   // MAX_DYNAMIC_SHARED_SIZE_BYTES
        default: *v = 0;
    }
    return kSuccess;
}

KVGATE_EMU_API CUresult cuFuncSetAttribute(void* fn, int attr, int value) {
    API_ENTRY;
    Function* f = static_cast<Function*>(fn);
    if (!f) return kInvalidHandle;
    if (attr == 8) {
        if (value < 0 || (size_t)value + f->static_smem > kMaxSharedPerBlockOptin)
            return fail_now(kInvalidValue, "cuFuncSetAttribute: dynamic shared memory above the H200's 227 KiB");
        f->max_dyn = (size_t)value;
    }
    return kSuccess;
}

KVGATE_EMU_API CUresult cuFuncSetCacheConfig(void*, int) { return kSuccess; }

KVGATE_EMU_API CUresult cuLaunchKernel(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                       unsigned bz, unsigned smem, void* stream, void** params, void** extra) {
    API_ENTRY;
    Function* f = static_cast<Function*>(fn);
    if (!f) return kInvalidHandle;
    if (extra) return fail_now(kNotSupported, "cuLaunchKernel: the `extra` argument form is not emulated");
    if (!params && f->k->nargs > 0) return kInvalidValue;
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    auto launch = std::make_shared<Launch>(make_launch(f->k, grid, block, smem, params));
    std::string err;
    const int code = check_launch(*launch, f->static_smem, f->regs, f->max_dyn, &err);
    if (code != kSuccess) return fail_now(code, err);
    enqueue(stream_of(stream), [launch](std::string* e) { return execute(*launch, e); });
    return kSuccess;
}

// Host side of the emulator for tests: the sticky failure's message, and a reset.
KVGATE_EMU_API const char* kvgate_emu_last_failure() {
    Driver& d = drv();
    std::lock_guard<std::recursive_mutex> g(d.mu);
    return d.sticky == kSuccess ? "" : d.sticky_msg.c_str();
}

// cuBLAS's work goes on the driver's streams (cublas.cpp).
int kvgate_emu_enqueue(void* stream, std::function<int(std::string*)> fn) {
    Driver& d = drv();
    std::lock_guard<std::recursive_mutex> g(d.mu);
    if (d.sticky != kSuccess) return d.sticky;
    enqueue(stream_of(stream), std::move(fn));
    return kSuccess;
}
