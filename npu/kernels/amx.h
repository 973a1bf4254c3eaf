// What the AMX paths of the CPU kernels share: whether the tile unit is there (compiled for and granted by Linux),
// a tile configuration, the bfloat16 pair packing of probabilities and a coarse exp2; and what the AVX-512 paths
// use too: a float32 exp of non-positive inputs and a 16 x 16 transpose of float32 / 32-bit lanes. Included by
// sources built with -march=native, so APPLIANCE_AMX is defined exactly when this CPU has AMX-BF16 (and AVX512-BF16).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define APPLIANCE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace kernels {

// Linux hands a process the tile state only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); the grant is
// process-wide, so asking once is enough. Without it the first tile instruction is a SIGILL.
inline bool amx_granted() {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
    return granted;
}

struct alignas(64) TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Loads a configuration of eight tiles of 16 rows, tile t `bytes[t]` bytes wide, on the calling thread.
inline void configure_tiles(const uint16_t (&bytes)[8]) {
    TileConfig c;
    std::memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = bytes[t];
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

// 2^t: 2^round(t) x 2^f, |f| <= 1/2, by a degree-4 polynomial (relative error ~4e-5: these probabilities are
// rounded to bfloat16, 4e-3, after it). t of -1e29 (a masked key) gives 0.
inline __m512 exp2_coarse(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(0.00961813f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240227f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693147f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// Two keys' probabilities for 16 lanes, as bfloat16 pairs per lane ((key 2k, key 2k + 1) in one 32-bit word):
// a VNNI row of P^T (a tile's B operand) and the broadcast operand of _mm512_dpbf16_ps.
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even)));
}

}  // namespace kernels
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kernels {

// e^x for x <= 0 in float32 (x below -87 gives about 1e-38, not 0: masked keys are zeroed by the caller):
// 2^n x e^f with n = round(x / ln 2), |f| <= ln 2 / 2, e^f by its Taylor series to f^6 (relative error ~1e-7).
inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), f);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// r[i] lane j <-> r[j] lane i.
inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 16; i += 8) {
        for (int j = 0; j < 4; ++j) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    }
    for (int j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
}

}  // namespace kernels
#endif
