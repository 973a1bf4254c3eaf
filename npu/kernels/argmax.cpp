// The greedy sampler's argmax over rows of logits on CPU: for each row of [rows, vocab] the first index of its
// largest value, a NaN counting as larger than any number (the first NaN wins), which is numpy's and torch's rule.
//
// Why a kernel: numpy's argmax runs on one thread and has no bfloat16, so bf16 logits were widened to float32
// first; at batch 64 over a 32k vocabulary that took 0.6-0.8 ms of a 7.8 ms bf16 decode step of the 4 x 512
// benchmark model. Here each row is read as it is (bf16 widened in registers) in two vectorised passes: its
// maximum (and whether it holds a NaN), then the first 64-element chunk holding that maximum, searched one by
// one. Rows are split over the caller's OpenMP threads. NaN is tested on the bits, as -ffast-math builds
// assume no NaN in float compares.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "floats.h"

namespace {

using kernels::widen;

inline bool is_nan(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return (u & 0x7fffffffu) > 0x7f800000u;
}
inline bool is_nan(uint16_t x) { return (x & 0x7fffu) > 0x7f80u; }

constexpr int64_t kChunk = 64;
constexpr int64_t kGrain = 1 << 16;       // below this many elements one thread does it all

template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
    float top = widen(x[0]);
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (int64_t i = 0; i < n; ++i) {
        const float v = widen(x[i]);
        top = v > top ? v : top;
        nan |= is_nan(x[i]);
    }
    if (nan) {
        for (int64_t i = 0; i < n; ++i)
            if (is_nan(x[i])) return i;
    }
    for (int64_t c = 0; c < n; c += kChunk) {
        const int64_t end = std::min(n, c + kChunk);
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = c; i < end; ++i) hit |= widen(x[i]) == top;
        if (hit) {
            for (int64_t i = c; i < end; ++i)
                if (widen(x[i]) == top) return i;
        }
    }
    return 0;       // not reached: top is one of the row's values
}

template <typename T>
void argmax_rows(const T* logits, int64_t rows, int64_t vocab, int64_t row_stride, int64_t* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(rows * vocab >= kGrain ? threads : 1)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(logits + r * row_stride, vocab);
}

}  // namespace

extern "C" {
void argmax_rows_f32(const float* logits, int64_t rows, int64_t vocab, int64_t row_stride, int64_t* out,
                     int threads) {
    argmax_rows(logits, rows, vocab, row_stride, out, threads);
}
void argmax_rows_bf16(const uint16_t* logits, int64_t rows, int64_t vocab, int64_t row_stride, int64_t* out,
                      int threads) {
    argmax_rows(logits, rows, vocab, row_stride, out, threads);
}
}
