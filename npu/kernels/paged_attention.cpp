// Decode attention over a paged KV cache, reading K and V pages in place (no gather), for CPU runners.
//
// Layout (npu/qwen3/runner.py): one layer's pool is [2 * pages, block_size, kv_heads * head_dim]; page p's K plane
// is block 2p and its V plane block 2p + 1. Row r (one query token of one sequence) attends to the first
// lengths[r] tokens of its pages pages[r * width ...]. Queries are [rows, heads, head_dim]; a kv head serves
// heads / kv_heads query heads (GQA). Scores, softmax and sums are float32 for bf16 and fp32 alike.
//
// One task is one row (or, with fewer rows than threads, a row's share of its kv heads): a page's K (then V)
// plane is converted to float32 once and read by every query head of the task (GQA: query head i reads kv
// head i / (heads / kv_heads)). Tasks are split over the caller's OpenMP threads
// (the libgomp torch has loaded, so one thread pool); each thread keeps its scores, heads x max_len floats,
// in the caller's `scratch` ([threads, heads x max_len], a torch tensor, so the startup profile counts it).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "floats.h"

namespace {

using kernels::narrow;
using kernels::widen;

// Start loading a page's K (which = 0) or V (1) plane while the one before it is read: pages are scattered,
// so the hardware prefetcher stops at each page's end.
template <typename T>
inline void prefetch_plane(const T* pool, const int64_t* table, int64_t page, int64_t len, int64_t block_size,
                           int64_t plane, int which) {
    if (page * block_size >= len) return;
    const char* p = reinterpret_cast<const char*>(pool + (2 * table[page] + which) * plane);
    for (int64_t b = 0; b < plane * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

constexpr int64_t kGrain = 1 << 17;

// HD > 0: head_dim known at compile time (the common 64 and 128), so a head's accumulator stays in registers
// across a page's tokens; HD = 0 reads it from `head_dim`.
template <typename T, int HD>
void decode_attention(const T* query, const T* pool, const int64_t* pages, const int64_t* lengths, T* out,
                      float* scratch, int64_t rows, int64_t width, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_len, float scale, int threads) {
    const int64_t hd = HD > 0 ? HD : head_dim;
    const int64_t group = heads / kv_heads, token_stride = kv_heads * hd, plane = block_size * token_stride;
    // Under kGrain multiply-adds the caller's thread runs it alone (waking another costs more than the work);
    // with fewer rows than threads (batch 1, long contexts) each row's kv heads are split into parts too.
    if (rows * max_len * heads * hd < kGrain) threads = 1;
    const int64_t parts = rows >= threads ? 1 : std::min<int64_t>(kv_heads, (threads + rows - 1) / rows);
#pragma omp parallel num_threads(threads)
    {
        // A page's plane converted to float32 once, then read by every query head (L1-resident).
        std::vector<float> q(heads * hd), acc(heads * hd), staged(plane), total(heads);
        float* const scores = scratch + omp_get_thread_num() * heads * max_len;   // the caller's, per thread
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * parts; ++task) {
            const int64_t r = task / parts, part = task % parts;
            const int64_t h0 = part * kv_heads / parts * group, h1 = (part + 1) * kv_heads / parts * group;
            const int64_t c0 = h0 / group * hd, c1 = h1 / group * hd;          // this part's columns of a token
            const int64_t len = lengths[r];
            const int64_t* table = pages + r * width;
            for (int64_t i = h0 * hd; i < h1 * hd; ++i) q[i] = widen(query[r * heads * hd + i]) * scale;
            for (int64_t page = 0; page * block_size < len; ++page) {          // scores = q . k
                prefetch_plane(pool, table, page + 1, len, block_size, plane, 0);
                const int64_t first = page * block_size, n = std::min(block_size, len - first);
                const T* k = pool + 2 * table[page] * plane;
                for (int64_t t = 0; t < n; ++t)
                    for (int64_t c = c0; c < c1; ++c) staged[t * token_stride + c] = widen(k[t * token_stride + c]);
                for (int64_t h = h0; h < h1; ++h) {
                    const float* __restrict__ qh = q.data() + h * hd;
                    const float* __restrict__ kh = staged.data() + (h / group) * hd;
                    float* __restrict__ sh = scores + h * len + first;
                    for (int64_t t = 0; t < n; ++t) {
                        float s = 0.f;
#pragma omp simd reduction(+ : s)
                        for (int64_t d = 0; d < hd; ++d) s += qh[d] * kh[t * token_stride + d];
                        sh[t] = s;
                    }
                }
            }
            for (int64_t h = h0; h < h1; ++h) {                                 // softmax, unnormalised
                float* sh = scores + h * len;
                float top = sh[0];
                for (int64_t t = 1; t < len; ++t) top = sh[t] > top ? sh[t] : top;
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; ++t) { sh[t] = std::exp(sh[t] - top); sum += sh[t]; }
                total[h] = sum;
            }
            std::fill(acc.begin() + h0 * hd, acc.begin() + h1 * hd, 0.f);
            for (int64_t page = 0; page * block_size < len; ++page) {          // acc += p . v
                prefetch_plane(pool, table, page + 1, len, block_size, plane, 1);
                const int64_t first = page * block_size, n = std::min(block_size, len - first);
                const T* v = pool + (2 * table[page] + 1) * plane;
                for (int64_t t = 0; t < n; ++t)
                    for (int64_t c = c0; c < c1; ++c) staged[t * token_stride + c] = widen(v[t * token_stride + c]);
                for (int64_t h = h0; h < h1; ++h) {
                    float* __restrict__ ah = acc.data() + h * hd;
                    const float* __restrict__ vh = staged.data() + (h / group) * hd;
                    const float* __restrict__ ph = scores + h * len + first;
#if defined(__AVX512F__)
                    // The head's accumulator in four registers: GCC kept the local array below on the stack, a
                    // store and reload per token (perf annotate); 7% of the bf16 kernel at 64 rows x 192-320 tokens.
                    if constexpr (HD == 64) {
                        __m512 a0 = _mm512_loadu_ps(ah), a1 = _mm512_loadu_ps(ah + 16);
                        __m512 a2 = _mm512_loadu_ps(ah + 32), a3 = _mm512_loadu_ps(ah + 48);
                        for (int64_t t = 0; t < n; ++t) {
                            const __m512 p = _mm512_set1_ps(ph[t]);
                            const float* vt = vh + t * token_stride;
                            a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt), a0);
                            a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 16), a1);
                            a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 32), a2);
                            a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 48), a3);
                        }
                        _mm512_storeu_ps(ah, a0);
                        _mm512_storeu_ps(ah + 16, a1);
                        _mm512_storeu_ps(ah + 32, a2);
                        _mm512_storeu_ps(ah + 48, a3);
                        continue;
                    }
#endif
                    if constexpr (HD > 0) {                 // a local array (in registers where the compiler keeps it)
                        float a[HD];
                        for (int64_t d = 0; d < HD; ++d) a[d] = ah[d];
                        for (int64_t t = 0; t < n; ++t) {
                            const float p = ph[t];
#pragma omp simd
                            for (int64_t d = 0; d < HD; ++d) a[d] += p * vh[t * token_stride + d];
                        }
                        for (int64_t d = 0; d < HD; ++d) ah[d] = a[d];
                    } else {
                        for (int64_t t = 0; t < n; ++t) {
                            const float p = ph[t];
#pragma omp simd
                            for (int64_t d = 0; d < hd; ++d) ah[d] += p * vh[t * token_stride + d];
                        }
                    }
                }
            }
            T* o = out + r * heads * hd;
            for (int64_t h = h0; h < h1; ++h)
                for (int64_t d = 0; d < hd; ++d) narrow(o + h * hd + d, acc[h * hd + d] / total[h]);
        }
    }
}

template <typename T>
void dispatch(const T* q, const T* pool, const int64_t* pages, const int64_t* lengths, T* out, float* scratch,
              int64_t rows, int64_t width, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
              int64_t max_len, float scale, int threads) {
    if (head_dim == 64)
        decode_attention<T, 64>(q, pool, pages, lengths, out, scratch, rows, width, heads, kv_heads, head_dim, block_size, max_len, scale, threads);
    else if (head_dim == 128)
        decode_attention<T, 128>(q, pool, pages, lengths, out, scratch, rows, width, heads, kv_heads, head_dim, block_size, max_len, scale, threads);
    else
        decode_attention<T, 0>(q, pool, pages, lengths, out, scratch, rows, width, heads, kv_heads, head_dim, block_size, max_len, scale, threads);
}

}  // namespace

extern "C" {
void paged_decode_attention_f32(const float* q, const float* pool, const int64_t* pages, const int64_t* lengths,
                                float* out, float* scratch, int64_t rows, int64_t width, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t max_len, float scale,
                                int threads) {
    dispatch(q, pool, pages, lengths, out, scratch, rows, width, heads, kv_heads, head_dim, block_size, max_len, scale, threads);
}
void paged_decode_attention_bf16(const uint16_t* q, const uint16_t* pool, const int64_t* pages,
                                 const int64_t* lengths, uint16_t* out, float* scratch, int64_t rows, int64_t width,
                                 int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                 int64_t max_len, float scale, int threads) {
    dispatch(q, pool, pages, lengths, out, scratch, rows, width, heads, kv_heads, head_dim, block_size, max_len, scale, threads);
}
}
