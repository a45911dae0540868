// __nv_bfloat16 for the kvgate CUDA emulator: the top half of an f32, narrowed as CUDA's
// __float2bfloat16_rn narrows (to nearest, ties to even; NaN becomes 0x7fff).
#pragma once
#include "cuda_fp16.h"

struct __nv_bfloat16 {
    unsigned short __x;
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    const uint32_t x = kvgate_emu::f32_bits(f);
    __nv_bfloat16 b;
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        b.__x = 0x7fffu;
    } else {
        b.__x = (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    }
    return b;
}

inline float __bfloat162float(__nv_bfloat16 b) { return kvgate_emu::bits_f32((uint32_t)b.__x << 16); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return __nv_bfloat16{b}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
