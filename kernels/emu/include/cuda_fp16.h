// __half for the kvgate CUDA emulator: IEEE binary16 storage, conversions rounded as CUDA's
// intrinsics round (__float2half_rn: to nearest, ties to even; NaN becomes 0x7fff).
#pragma once
#include <cstdint>
#include <cstring>

struct __half {
    unsigned short __x;
};

namespace kvgate_emu {
inline uint32_t f32_bits(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return b;
}
inline float bits_f32(uint32_t b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}
}  // namespace kvgate_emu

inline __half __float2half_rn(float f) {
    uint32_t x = kvgate_emu::f32_bits(f);
    const unsigned short sign = (unsigned short)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    __half h;
    if (x > 0x7f800000u) {  // NaN
        h.__x = 0x7fffu;
    } else if (x >= 0x477ff000u) {  // rounds to infinity (or is infinite)
        h.__x = sign | 0x7c00u;
    } else if (x < 0x33000001u) {  // at most half the smallest subnormal: ties to even (zero)
        h.__x = sign;
    } else if (x < 0x38800000u) {  // a binary16 subnormal
        const uint32_t m = (x & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)(x >> 23);
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) ++r;
        h.__x = sign | (unsigned short)r;
    } else {
        uint32_t r = (x - 0x38000000u) >> 13;
        const uint32_t rem = x & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
        h.__x = sign | (unsigned short)r;
    }
    return h;
}

inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.__x & 0x8000u) << 16;
    const uint32_t e = (h.__x >> 10) & 0x1fu, m = h.__x & 0x3ffu;
    if (e == 0x1f) return kvgate_emu::bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        if (m == 0) return kvgate_emu::bits_f32(sign);
        float v = (float)m * (1.0f / 16777216.0f);  // m * 2^-24, exact
        return sign ? -v : v;
    }
    return kvgate_emu::bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
