// The hyper-connections' Sinkhorn normalization for CPU runners (npu.deepseek_v4.hyper.sinkhorn's math, to the bit).
//
// Each hc_pre makes its tokens' hc x hc mixing matrices doubly stochastic with 2 x iters - 1 normalizations:
// columns first, then rows and columns alternately, each x / (sum + eps). As torch ops that is a sum and a division
// per normalization on a few kilobytes, 78 ops per hc_pre with the released 20 iterations: 0.15-0.27 ms per hc_pre on
// one AMD EPYC core, ten hc_pre per decode step of the tiny model, 12-18% of its step (bench/bench_dsv4_parts.py
// --compare-sinkhorn). Here one call does them all (7 us for 8 tokens).
//
// The same bits as hyper.sinkhorn: a column's (row's) sum adds its n entries one after the other and eps last, and
// each division is IEEE float32, rounded to nearest. So this file is compiled without -ffast-math
// (npu/cpu_kernels.py EXACT_SOURCES), which would let the compiler turn a division into a multiplication by a
// reciprocal or reorder the sums. Tokens are worked LANES at a time with the lanes innermost, so the compiler can
// vectorize across tokens without changing any lane's order of operations.
//
// comb and out are [num, n, n] float32, contiguous (out may be comb); n <= MAX_N.

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t MAX_N = 16;

// One block of up to LANES tokens, m[i][j][lane] (row i, column j), normalized in place.
void normalize_block(float* m, int64_t n, int64_t iters, float eps) {
    float s[LANES];
    auto at = [&](int64_t i, int64_t j) { return m + (i * n + j) * LANES; };
    auto columns = [&]() {
        for (int64_t j = 0; j < n; ++j) {
            for (int64_t l = 0; l < LANES; ++l) s[l] = at(0, j)[l];
            for (int64_t i = 1; i < n; ++i)
                for (int64_t l = 0; l < LANES; ++l) s[l] += at(i, j)[l];
            for (int64_t l = 0; l < LANES; ++l) s[l] += eps;
            for (int64_t i = 0; i < n; ++i)
                for (int64_t l = 0; l < LANES; ++l) at(i, j)[l] /= s[l];
        }
    };
    auto rows = [&]() {
        for (int64_t i = 0; i < n; ++i) {
            for (int64_t l = 0; l < LANES; ++l) s[l] = at(i, 0)[l];
            for (int64_t j = 1; j < n; ++j)
                for (int64_t l = 0; l < LANES; ++l) s[l] += at(i, j)[l];
            for (int64_t l = 0; l < LANES; ++l) s[l] += eps;
            for (int64_t j = 0; j < n; ++j)
                for (int64_t l = 0; l < LANES; ++l) at(i, j)[l] /= s[l];
        }
    };
    columns();
    for (int64_t k = 1; k < iters; ++k) {
        rows();
        columns();
    }
}

}  // namespace

extern "C" {

// comb [num, n, n] -> out (doubly stochastic), iters >= 1, 1 <= n <= MAX_N; `threads` OpenMP threads for large num.
void sinkhorn_f32(const float* comb, int64_t num, int64_t n, int64_t iters, float eps, float* out, int threads) {
    const int64_t blocks = (num + LANES - 1) / LANES, nn = n * n;
#pragma omp parallel for schedule(static) num_threads(std::max(1, std::min<int>(threads, int(blocks / 8))))
    for (int64_t b = 0; b < blocks; ++b) {
        float m[MAX_N * MAX_N * LANES];
        const int64_t first = b * LANES, count = std::min(LANES, num - first);
        for (int64_t k = 0; k < nn; ++k)                 // to [i][j][lane]; lanes past num hold 1 (not stored)
            for (int64_t l = 0; l < LANES; ++l) m[k * LANES + l] = l < count ? comb[(first + l) * nn + k] : 1.0f;
        normalize_block(m, n, iters, eps);
        for (int64_t l = 0; l < count; ++l)
            for (int64_t k = 0; k < nn; ++k) out[(first + l) * nn + k] = m[k * LANES + l];
    }
}

}  // extern "C"
