// float32 <-> bfloat16 for the CPU kernels: bfloat16 is the high half of a float32; narrowing rounds to nearest
// even, as torch does (NaN stays NaN). Checked with integer ops, so -ffast-math cannot drop the NaN case.
#pragma once
#include <cstdint>
#include <cstring>

namespace kernels {

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline void narrow(float* dst, float x) { *dst = x; }
inline void narrow(uint16_t* dst, float x) {       // branch-free, so loops over it vectorize
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    *dst = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

}  // namespace kernels
