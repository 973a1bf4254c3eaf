// Elementwise parts of a decoder layer on CPU, fused: RMS norm (optionally after the residual add), the
// per-head q/k RMS norm with its weight and RoPE, and SiLU(gate) x up. torch runs each as several ops that
// each read and write the activations (an RMS norm of [64, 512] bf16 is about ten ops and 120 us on the
// benchmark machine); one pass here. Rounding follows torch's composite ops step by step: math in float32,
// the result rounded to T wherever torch would store a T tensor, so bf16 outputs match torch's to the bit
// except where a float32 sum is added in another order. Rows are split over the caller's OpenMP threads.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "floats.h"

namespace {

using kernels::narrow;
using kernels::widen;

template <typename T>
inline float round_as(float x) {                  // x stored as a T and read back
    T t;
    narrow(&t, x);
    return widen(t);
}

// Below this many elements a call runs on the caller's thread alone, as torch's at::parallel_for does below
// its grain size: waking a second thread costs more than the work (a decode step of a small model makes a
// dozen such calls).
constexpr int64_t kGrain = 32768;
inline int team(int64_t work, int threads) { return work >= kGrain ? threads : 1; }

// 1 / sqrt(mean(x^2) + eps) over n floats.
inline float inv_rms(const float* x, int64_t n, float eps) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
    return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// torch.rms_norm with a weight (its fused CPU kernel): x * inv_rms * weight in float32, rounded once.
template <typename T>
inline void norm_row(const float* x, int64_t n, const T* weight, float eps, T* out) {
    const float r = inv_rms(x, n, eps);
    for (int64_t i = 0; i < n; ++i) narrow(out + i, x[i] * r * widen(weight[i]));
}

template <typename T>
void rms_norm(const T* x, int64_t rows, int64_t dim, const T* weight, float eps, T* out, int threads) {
#pragma omp parallel num_threads(team(rows * dim, threads))
    {
        float* row = new float[dim];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t i = 0; i < dim; ++i) row[i] = widen(x[r * dim + i]);
            norm_row(row, dim, weight, eps, out + r * dim);
        }
        delete[] row;
    }
}

// x += delta (rounded to T, as torch's add), then out = rms_norm(x).
template <typename T>
void add_rms_norm(T* x, const T* delta, int64_t rows, int64_t dim, const T* weight, float eps, T* out, int threads) {
#pragma omp parallel num_threads(team(rows * dim, threads))
    {
        float* row = new float[dim];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            T* xr = x + r * dim;
            for (int64_t i = 0; i < dim; ++i) {
                narrow(xr + i, widen(xr[i]) + widen(delta[r * dim + i]));
                row[i] = widen(xr[i]);
            }
            norm_row(row, dim, weight, eps, out + r * dim);
        }
        delete[] row;
    }
}

// In place on the first heads x head_dim columns of each token's row of qkv (row stride `stride`): each head
// RMS-normed, times its weight row, then rotated: out = t * cos + swap_halves(t) * sin, where rope holds each
// token's cos row then its signed sin row (-sin | sin), [tokens, 2, head_dim].
template <typename T>
void qk_norm_rope(T* qkv, int64_t tokens, int64_t stride, int64_t heads, int64_t head_dim, const T* weight,
                  const T* rope, float eps, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel num_threads(team(tokens * heads * head_dim, threads))
    {
        float* t = new float[2 * head_dim];
        float* h = t + head_dim;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < tokens; ++n) {
            const T* cos = rope + n * 2 * head_dim;
            const T* sin = cos + head_dim;
            for (int64_t j = 0; j < heads; ++j) {
                T* x = qkv + n * stride + j * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) h[d] = widen(x[d]);
                const float r = inv_rms(h, head_dim, eps);
                for (int64_t d = 0; d < head_dim; ++d)
                    t[d] = round_as<T>(round_as<T>(h[d] * r) * widen(weight[j * head_dim + d]));
                for (int64_t d = 0; d < half; ++d)              // swap_halves(t): the second half first
                    narrow(x + d, round_as<T>(t[d] * widen(cos[d])) + round_as<T>(t[d + half] * widen(sin[d])));
                for (int64_t d = half; d < head_dim; ++d)
                    narrow(x + d, round_as<T>(t[d] * widen(cos[d])) + round_as<T>(t[d - half] * widen(sin[d])));
            }
        }
        delete[] t;
    }
}

// out = silu(gate) * up for gate_up = [rows, gate | up], each `inter` wide (silu rounded to T first, as torch).
template <typename T>
void silu_and_mul(const T* gate_up, int64_t rows, int64_t inter, T* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(team(rows * inter, threads))
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * inter;
        const T* u = g + inter;
        for (int64_t i = 0; i < inter; ++i) {
            const float x = widen(g[i]);
            narrow(out + r * inter + i, round_as<T>(x / (1.f + std::exp(-x))) * widen(u[i]));
        }
    }
}

}  // namespace

#define NORM_ENTRY_POINTS(SUFFIX, T)                                                                              \
    void rms_norm_##SUFFIX(const T* x, int64_t rows, int64_t dim, const T* weight, float eps, T* out,            \
                           int threads) {                                                                         \
        rms_norm(x, rows, dim, weight, eps, out, threads);                                                       \
    }                                                                                                             \
    void add_rms_norm_##SUFFIX(T* x, const T* delta, int64_t rows, int64_t dim, const T* weight, float eps,       \
                               T* out, int threads) {                                                             \
        add_rms_norm(x, delta, rows, dim, weight, eps, out, threads);                                            \
    }                                                                                                             \
    void qk_norm_rope_##SUFFIX(T* qkv, int64_t tokens, int64_t stride, int64_t heads, int64_t head_dim,          \
                               const T* weight, const T* rope, float eps, int threads) {                         \
        qk_norm_rope(qkv, tokens, stride, heads, head_dim, weight, rope, eps, threads);                         \
    }                                                                                                             \
    void silu_and_mul_##SUFFIX(const T* gate_up, int64_t rows, int64_t inter, T* out, int threads) {             \
        silu_and_mul(gate_up, rows, inter, out, threads);                                                        \
    }

extern "C" {
NORM_ENTRY_POINTS(f32, float)
NORM_ENTRY_POINTS(bf16, uint16_t)
}
