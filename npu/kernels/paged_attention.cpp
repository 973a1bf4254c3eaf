// Decode attention over a paged KV cache, reading K and V pages in place (no gather), for CPU runners.
//
// Layout (npu/qwen3/runner.py): one layer's pool is [2 * pages, block_size, kv_heads * head_dim]; page p's K plane
// is block 2p and its V plane block 2p + 1. Row r (one query token of one sequence) attends to the first
// lengths[r] tokens of its pages pages[r * width ...]. Queries are [rows, heads, head_dim]; a kv head serves
// heads / kv_heads query heads (GQA). Scores, softmax and sums are float32 for bf16 and fp32 alike.
//
// One task is one row (or, with fewer rows than threads, a row's share of its kv heads); tasks are split over the
// caller's OpenMP threads (the libgomp torch has loaded, so one thread pool). A bfloat16 pool may instead be in the
// kv-pairs layout (npu/kernels/kv_pairs.cpp), which paged_decode_attention_pairs_bf16 reads. Three paths:
// - decode_attention_one_pass (AVX-512, head_dim 64 or 128: every model this project ships): one pass over the row's
//   pages with an online softmax, 16 keys at a time (below);
// - decode_attention (any head_dim, any x86-64): two passes, scores then P.V; a page's K (then V) plane converted to
//   float32 once (bfloat16; float32 is read in place) and read by every query head of the task (GQA: query head i
//   reads kv head i / (heads / kv_heads)); each thread keeps its scores, heads x max_len floats, in the caller's
//   `scratch` ([threads, heads x max_len], a torch tensor, so the startup profile counts it);
// - decode_attention_amx: bfloat16 on a CPU with AMX, which the caller picks itself (the scores and P.V on the tile
//   unit, a task per row's kv head).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "floats.h"

namespace {

using kernels::narrow;
using kernels::widen;
#if defined(__AVX512F__)
using kernels::exp_nonpositive;
#endif

// Start loading a page's K (which = 0) or V (1) plane into L2 while the one before it is read: pages are scattered,
// so the hardware prefetcher stops at each page's end.
template <typename T>
inline void prefetch_plane(const T* pool, const int64_t* table, int64_t page, int64_t len, int64_t block_size,
                           int64_t plane, int which) {
    if (page * block_size >= len) return;
    const char* p = reinterpret_cast<const char*>(pool + (2 * table[page] + which) * plane);
    for (int64_t b = 0; b < plane * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 2);
}

constexpr int64_t kGrain = 1 << 17;

// A page plane's first n token rows, columns c0..c1, as float32: bfloat16 widened into `staged` (same layout), float32
// read in place (the copy was 3-5% of a float32 6 x 768 workload's CPU time on an AMD EPYC).
template <typename T>
inline const float* as_float(const T* plane, int64_t n, int64_t c0, int64_t c1, int64_t token_stride,
                             std::vector<float>& staged) {
    if constexpr (std::is_same_v<T, float>) {
        return plane;
    } else {
        for (int64_t t = 0; t < n; ++t)
            for (int64_t c = c0; c < c1; ++c) staged[t * token_stride + c] = widen(plane[t * token_stride + c]);
        return staged.data();
    }
}

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
                const float* const kf = as_float(pool + 2 * table[page] * plane, n, c0, c1, token_stride, staged);
                for (int64_t h = h0; h < h1; ++h) {
                    const float* __restrict__ qh = q.data() + h * hd;
                    const float* __restrict__ kh = kf + (h / group) * hd;
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
                const float* const vf = as_float(pool + (2 * table[page] + 1) * plane, n, c0, c1, token_stride, staged);
                for (int64_t h = h0; h < h1; ++h) {
                    float* __restrict__ ah = acc.data() + h * hd;
                    const float* __restrict__ vh = vf + (h / group) * hd;
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

#if defined(__AVX512F__)
// The one-pass path (AVX-512, head_dim 64 or 128): a task walks its row's pages once, 16 keys at a time, with an
// online softmax (a running max and sum per query head, the accumulator rescaled when the max rises). Per block and
// kv head: K^T built by 16 x 16 register transposes (float32 dims, or bfloat16 dim pairs for _mm512_dpbf16_ps where
// the CPU has AVX512-BF16), so each query head's 16 scores are one vector (no reduction across lanes); then P.V with
// a head's accumulator in registers (bfloat16: two keys per _mm512_dpbf16_ps, P rounded to bfloat16 as on the AMX
// path). Keys past a row's length are masked in the scores and their V rows never read, so a NaN in an unwritten row
// cannot reach the output.
// What made it faster inside a model is the prefetch: a decode step meets each layer's pages cold, and the two-pass
// kernel's burst of a whole page's prefetches (128 lines) at once was mostly lost, so half of a layer call waited on
// loads (a call over cached rows took 0.48 ms, the same call in a step 0.85-0.95). Here the next page's K and V lines
// are requested a few at a time between this page's heads. AMD EPYC (Zen 4), 2 threads, alternating steps in one
// process: 6 x 768 bf16 at 64 rows x ~250 keys 1.26 -> 0.74-0.79 ms per layer call (the step 34.4 -> 31.4 ms); 12 x
// 1024 bf16 at 32 rows 1.00 -> 0.80 ms; 6 x 768 float32 1.28 -> 1.19 ms. Over cached rows alone: 0.74 -> 0.53 ms.
// The lines are requested into L2 (prefetcht1), not L1: with prefetcht0 the misses in flight were capped by L1's miss
// buffers (AMD EPYC Zen 4, in a model's decode steps, bench/ab_decode_attention.py: 12 x 1024 bf16 at 64 rows x 192-232
// keys 1.11 -> 0.73 ms per layer call, 6 x 768 float32 1.24 -> 0.98; pages one or two ahead were slower either way).
// A pool in the kv-pairs layout (PAIRED) skips both reorderings: the block's K^T and V pairs are the page's own words.
// AMD EPYC, 12 x 1024 bf16 (16 / 4 heads), 64 rows x 192-222 keys, two runners taking decode steps in turn
// (bench/ab_kv_layout.py, three runs): 0.68-0.96 -> 0.65-0.74 ms per layer call, the step 1-2.5% shorter.
constexpr int64_t kPagesAhead = 1;      // the page whose lines are requested while this one is read

// 16 float32 of a bfloat16 or float32 row.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#if defined(__AVX512BF16__)
constexpr bool kPairs = true;      // bfloat16 scores by dim pairs (_mm512_dpbf16_ps)
#else
constexpr bool kPairs = false;     // bfloat16 widened to float32 first
#endif

// K^T of one block: kt[d][key] for 16 keys (rows[key], nullptr past the length: zeros). For bfloat16 with kPairs,
// kt holds 32-bit words (two dims each), [HD / 2][16]; else float32 [HD][16].
template <typename T, int HD>
inline void transpose_keys(const T* const rows[16], float* kt) {
    constexpr bool pairs = kPairs && std::is_same_v<T, uint16_t>;
    constexpr int per = pairs ? 32 : 16;           // dims per 16-lane load
    __m512 r[16];
    for (int c = 0; c < HD / per; ++c) {
        for (int t = 0; t < 16; ++t) {
            if (rows[t] == nullptr) r[t] = _mm512_setzero_ps();
            else if constexpr (pairs) r[t] = _mm512_loadu_ps(reinterpret_cast<const float*>(rows[t] + c * 32));
            else r[t] = load16(rows[t] + c * 16);
        }
        kernels::transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_store_ps(kt + (c * 16 + j) * 16, r[j]);
    }
}

// The 16 scores of NH query heads (q rows HD apart: float32 scaled, or bfloat16 pair words) against K^T, two
// independent sums per head (the multiply-add latency). K^T's rows (a dim, or a dim pair) are `stride` floats
// apart: 16 in the kernel's own buffer, block_size where a pool keeps its pages' K in pairs (kv_pairs).
template <typename T, int HD, int NH>
inline void head_scores(const float* kt, int64_t stride, const float* qf, const uint32_t* qw, __m512* out) {
    __m512 a[NH], b[NH];
    for (int h = 0; h < NH; ++h) a[h] = b[h] = _mm512_setzero_ps();
    if constexpr (kPairs && std::is_same_v<T, uint16_t>) {
#if defined(__AVX512BF16__)
        for (int w = 0; w < HD / 2; w += 2) {
            const __m512bh k0 = reinterpret_cast<__m512bh>(_mm512_loadu_ps(kt + w * stride));
            const __m512bh k1 = reinterpret_cast<__m512bh>(_mm512_loadu_ps(kt + (w + 1) * stride));
            for (int h = 0; h < NH; ++h) {
                const uint32_t* pair = qw + h * HD / 2 + w;
                a[h] = _mm512_dpbf16_ps(a[h], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[0])), k0);
                b[h] = _mm512_dpbf16_ps(b[h], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[1])), k1);
            }
        }
#endif
    } else {
        for (int d = 0; d < HD; d += 2) {
            const __m512 k0 = _mm512_loadu_ps(kt + d * stride), k1 = _mm512_loadu_ps(kt + (d + 1) * stride);
            for (int h = 0; h < NH; ++h) {
                a[h] = _mm512_fmadd_ps(_mm512_set1_ps(qf[h * HD + d]), k0, a[h]);
                b[h] = _mm512_fmadd_ps(_mm512_set1_ps(qf[h * HD + d + 1]), k1, b[h]);
            }
        }
    }
    for (int h = 0; h < NH; ++h) out[h] = _mm512_add_ps(a[h], b[h]);
}

// acc (one head, HD floats) = acc * alpha + sum over the block's keys of p[t] * v[t].
template <int HD>
inline void head_values(float* acc, float alpha, const float* p, const float* const v[16], int keys) {
    __m512 a[HD / 16];
    const __m512 s = _mm512_set1_ps(alpha);
    for (int i = 0; i < HD / 16; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), s);
    for (int t = 0; t < keys; ++t) {
        const __m512 pt = _mm512_set1_ps(p[t]);
        for (int i = 0; i < HD / 16; ++i) a[i] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v[t] + 16 * i), a[i]);
    }
    for (int i = 0; i < HD / 16; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}

#if defined(__AVX512BF16__)
// bfloat16: V rows of a block as key pairs interleaved per dim (vp[pair][HD][2], rows past `keys` zeros), so
// P.V takes two keys per _mm512_dpbf16_ps; P rounded to bfloat16 as on the AMX path.
template <int HD>
inline void pair_values(const uint16_t* const v[16], int keys, uint16_t* vp) {
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int j = 0; 2 * j < keys; ++j) {
        const uint16_t* a = v[2 * j];
        const uint16_t* b = 2 * j + 1 < keys ? v[2 * j + 1] : nullptr;
        uint16_t* dst = vp + j * HD * 2;
        for (int d = 0; d < HD; d += 32) {
            const __m512i va = _mm512_loadu_si512(a + d);
            const __m512i vb = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
            _mm512_store_si512(reinterpret_cast<__m512i*>(dst + 2 * d), _mm512_permutex2var_epi16(va, low, vb));
            _mm512_store_si512(reinterpret_cast<__m512i*>(dst + 2 * d + 32), _mm512_permutex2var_epi16(va, high, vb));
        }
    }
}

// acc (one head, HD floats) = acc * alpha + sum over key pairs of (p[2j], p[2j + 1]) . vp[j]. With an odd number of
// keys the last pair's second key is past the row's length: its half of each word is read as zero (p is zero there,
// but 0 x NaN is NaN, and a pool's unwritten slots hold anything).
template <int HD>
inline void head_values_pairs(float* acc, float alpha, __m512 e, const uint16_t* vp, int keys) {
    alignas(32) uint32_t pw[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(pw), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    __m512 a[HD / 16];
    const __m512 s = _mm512_set1_ps(alpha);
    for (int i = 0; i < HD / 16; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), s);
    for (int j = 0; 2 * j < keys; ++j) {
        const __m512bh pj = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pw[j]));
        const __mmask32 both = 2 * j + 1 < keys ? 0xFFFFFFFFu : 0x55555555u;
        for (int i = 0; i < HD / 16; ++i)
            a[i] = _mm512_dpbf16_ps(a[i], pj, reinterpret_cast<__m512bh>(
                _mm512_maskz_loadu_epi16(both, vp + j * HD * 2 + 32 * i)));
    }
    for (int i = 0; i < HD / 16; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif

// PAIRED (bfloat16 with AVX512-BF16 only): the pool keeps its pages in the kv-pairs layout (npu/kernels/kv_pairs.cpp),
// so a block's K^T and V pairs are read where they lie instead of built per call.
template <typename T, int HD, bool PAIRED = false>
void decode_attention_one_pass(const T* query, const T* pool, const int64_t* pages, const int64_t* lengths, T* out,
                               int64_t rows, int64_t width, int64_t heads, int64_t kv_heads, int64_t block_size,
                               int64_t max_len, float scale, int threads) {
    constexpr bool pairs = kPairs && std::is_same_v<T, uint16_t>;
    static_assert(!PAIRED || pairs, "the kv-pairs layout is read by the AVX512-BF16 path alone");
    const int64_t group = heads / kv_heads, token_stride = kv_heads * HD, plane = block_size * token_stride;
    if (rows * max_len * heads * HD < kGrain) threads = 1;
    const int64_t parts = rows >= threads ? 1 : std::min<int64_t>(kv_heads, (threads + rows - 1) / rows);
#pragma omp parallel num_threads(threads)
    {
        alignas(64) float kt[HD * 16];                 // K^T of the block and kv head at hand
        alignas(64) float vs[16 * HD];                 // its V rows as float32 (bfloat16 only)
        alignas(64) float p[16];
        alignas(64) uint16_t vpairs[pairs ? 16 * HD : 1];   // V of the block as key pairs (bfloat16 only)
        const T* vrows_raw[16];
        std::vector<float> qf(heads * HD), acc(heads * HD), top(heads), sum(heads);
        std::vector<uint32_t> qw(heads * HD / 2);
        const T* krows[16];
        const float* vrows[16];
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * parts; ++task) {
            const int64_t r = task / parts, part = task % parts;
            const int64_t g0 = part * kv_heads / parts, g1 = (part + 1) * kv_heads / parts;
            const int64_t len = lengths[r];
            const int64_t* table = pages + r * width;
            const T* q = query + r * heads * HD;
            for (int64_t i = g0 * group * HD; i < g1 * group * HD; ++i) {
                acc[i] = 0.f;
                if constexpr (!pairs) qf[i] = widen(q[i]) * scale;    // bfloat16 pairs: scaled after the sums
            }
            if constexpr (pairs) std::memcpy(qw.data(), q, sizeof(uint16_t) * heads * HD);
            std::fill(top.begin(), top.end(), -1e30f);
            std::fill(sum.begin(), sum.end(), 0.f);
            for (int64_t page = 0; page < kPagesAhead; ++page) {
                prefetch_plane(pool, table, page, len, block_size, plane, 0);
                prefetch_plane(pool, table, page, len, block_size, plane, 1);
            }
            for (int64_t page = 0; page * block_size < len; ++page) {
                // the page kPagesAhead ahead (its K and V planes are contiguous): its lines requested a few at a
                // time between this page's heads, so the misses in flight stay within what the core tracks
                const int64_t ahead = page + kPagesAhead;
                const char* pf = ahead * block_size < len
                    ? reinterpret_cast<const char*>(pool + 2 * table[ahead] * plane) : nullptr;
                const int64_t pf_lines = pf ? 2 * plane * static_cast<int64_t>(sizeof(T)) / 64 : 0;
                const int64_t slots = (g1 - g0) * group * ((std::min(block_size, len - page * block_size) + 15) / 16);
                const int64_t per_slot = (pf_lines + slots - 1) / std::max<int64_t>(1, slots);
                int64_t pf_next = 0;
                const T* const kp = pool + 2 * table[page] * plane;
                const T* const vp = kp + plane;
                const int64_t first = page * block_size, n = std::min(block_size, len - first);
                for (int64_t t0 = 0; t0 < n; t0 += 16) {
                    const int keys = static_cast<int>(std::min<int64_t>(16, n - t0));
                    const __mmask16 valid = static_cast<__mmask16>((1u << keys) - 1);
                    for (int64_t g = g0; g < g1; ++g) {
                        const float* kblock = kt;               // K^T of the block: 16 keys per dim (pair) row
                        int64_t kstride = 16;
                        const uint16_t* vblock = vpairs;        // V of the block as key pairs (bfloat16 pairs)
                        if constexpr (PAIRED) {
                            kblock = reinterpret_cast<const float*>(kp + g * HD * block_size + 2 * t0);
                            kstride = block_size;
                            vblock = reinterpret_cast<const uint16_t*>(vp + g * HD * block_size + t0 * HD);
                        } else {
                            for (int t = 0; t < 16; ++t)
                                krows[t] = t < keys ? kp + (t0 + t) * token_stride + g * HD : nullptr;
                            transpose_keys<T, HD>(krows, kt);
                            for (int t = 0; t < keys; ++t) {
                                const T* v = vp + (t0 + t) * token_stride + g * HD;
                                if constexpr (pairs) {
                                    vrows_raw[t] = v;
                                } else if constexpr (std::is_same_v<T, float>) {
                                    vrows[t] = v;
                                } else {
                                    for (int i = 0; i < HD / 16; ++i)
                                        _mm512_store_ps(vs + t * HD + 16 * i, load16(v + 16 * i));
                                    vrows[t] = vs + t * HD;
                                }
                            }
#if defined(__AVX512BF16__)
                            if constexpr (pairs) pair_values<HD>(vrows_raw, keys, vpairs);
#endif
                        }
                        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += 4) {
                            __m512 s[4];
                            const float* qh = qf.data() + h0 * HD;
                            const uint32_t* qwh = qw.data() + h0 * HD / 2;
                            const int64_t nh = std::min<int64_t>(4, (g + 1) * group - h0);
                            switch (nh) {
                                case 4: head_scores<T, HD, 4>(kblock, kstride, qh, qwh, s); break;
                                case 3: head_scores<T, HD, 3>(kblock, kstride, qh, qwh, s); break;
                                case 2: head_scores<T, HD, 2>(kblock, kstride, qh, qwh, s); break;
                                default: head_scores<T, HD, 1>(kblock, kstride, qh, qwh, s); break;
                            }
                            for (int64_t i = 0; i < nh; ++i) {
                                const int64_t h = h0 + i;
                                for (int64_t l = 0; l < per_slot && pf_next < pf_lines; ++l, ++pf_next)
                                    __builtin_prefetch(pf + pf_next * 64, 0, 2);
                                __m512 x = pairs ? _mm512_mul_ps(s[i], _mm512_set1_ps(scale)) : s[i];
                                x = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), valid, x);
                                const float m = std::max(top[h], _mm512_reduce_max_ps(x));
                                const float alpha = std::exp(top[h] - m);
                                top[h] = m;
                                const __m512 e =
                                    _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(x, _mm512_set1_ps(m))));
                                sum[h] = sum[h] * alpha + _mm512_reduce_add_ps(e);
#if defined(__AVX512BF16__)
                                if constexpr (pairs) {
                                    head_values_pairs<HD>(acc.data() + h * HD, alpha, e, vblock, keys);
                                    continue;
                                }
#endif
                                _mm512_store_ps(p, e);
                                head_values<HD>(acc.data() + h * HD, alpha, p, vrows, keys);
                            }
                        }
                    }
                }
            }
            T* o = out + r * heads * HD;
            for (int64_t h = g0 * group; h < g1 * group; ++h) {
                const float inv = 1.f / sum[h];
                for (int64_t d = 0; d < HD; ++d) narrow(o + h * HD + d, acc[h * HD + d] * inv);
            }
        }
    }
}
#endif

#if defined(APPLIANCE_AMX)
constexpr int64_t kAhead = 32;   // keys prefetched ahead of pass 1

// The bfloat16 decode path on the tile unit (head_dim 64 or 128, up to 16 query heads per kv head, block_size a
// multiple of 16). One task is one row's kv head: its G query heads read each key once. Every tile is 16 rows x
// 64 bytes; lanes (columns or rows) past G hold zeros or values nobody reads. Two passes over the row's keys:
//   1. S^T = K.Q^T: A = 16 keys x 32 dims of K read in place from the page (no copy), B = Q^T in VNNI pairs
//      (tiles 3-4, and 5-6 for head_dim 128, loaded once per task), C = [16 keys][16 lanes] (tile 0), stored to
//      the task's scores. Then the max over every key, one vector per key (G heads in its lanes).
//   2. per 32 keys: probabilities exp2(x c - max c) (no running rescale: the max is known), summed; as bfloat16
//      pairs of keys, transposed to P [heads][32 keys] (A, tile 2); V's key pairs interleaved per dimension (B,
//      tile 7: staged, zeros past the length, so a NaN in an unwritten row cannot reach the sum); O += P.V into
//      C tiles 0, 1, 5, 6 (head_dim 64: resident across the whole row) or, for 128, two at a time added into memory.
void decode_attention_amx(const uint16_t* query, const uint16_t* pool, const int64_t* pages, const int64_t* lengths,
                          uint16_t* out, float* scratch, int64_t rows, int64_t width, int64_t heads, int64_t kv_heads,
                          int64_t hd, int64_t block_size, int64_t max_len, float scale, int threads) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * hd, plane = block_size * token_stride;
    const int64_t padded_len = (max_len + 31) / 32 * 32;
    const bool resident = hd == 64;
    if (rows * kv_heads < threads) threads = static_cast<int>(std::max<int64_t>(1, rows * kv_heads));
    // a row's kv heads on one thread, one after another: their K and V share the token rows' cache lines, which
    // the hardware prefetchers fetch together
    const int64_t kv_chunk = rows >= threads ? kv_heads : 1;
#pragma omp parallel num_threads(threads)
    {
        kernels::configure_tiles({64, 64, 64, 64, 64, 64, 64, 64});
        alignas(64) uint32_t qt[4 * 16 * 16];                      // Q^T chunks: [hd / 2 pairs][16 lanes]
        alignas(64) float pa[16 * 16];                             // P of a block: [16 heads][16 key pairs]
        alignas(64) uint16_t vs[16 * 128 * 2];                     // V of a block: [16 key pairs][hd][2]
        alignas(64) float o[16 * 128], part[16 * 32];              // [16 heads][hd]; two chunks of a block
        float* const st = scratch + omp_get_thread_num() * padded_len * 16;   // the caller's: [keys][16 lanes]
        std::memset(qt, 0, sizeof qt);
        const __m512 none = _mm512_set1_ps(-1e30f), c = _mm512_set1_ps(scale * 1.44269504f);
        // lane-wise interleave of two rows' 32 values: (a0, b0, a1, b1, ...) for the low 16, then the high 16
        const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                             37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
#pragma omp for schedule(dynamic, kv_chunk)
        for (int64_t task = 0; task < rows * kv_heads; ++task) {
            const int64_t r = task / kv_heads, g = task % kv_heads, len = lengths[r];
            const int64_t* table = pages + r * width;
            auto key_row = [&](int64_t t, int which) {           // token t's K (0) or V (1) row of kv head g
                return pool + (2 * table[t / block_size] + which) * plane + (t % block_size) * token_stride + g * hd;
            };
            // pages are scattered, so the hardware prefetcher stops at each one: the K and V rows kAhead keys
            // ahead are requested while these are read (V is read again in pass 2, from cache by then)
            auto prefetch = [&](int64_t t0) {
                if (t0 >= len) return;
                for (int which = 0; which < 2; ++which) {
                    const char* row = reinterpret_cast<const char*>(key_row(t0, which));
                    for (int64_t t = 0; t < std::min<int64_t>(16, len - t0); ++t)
                        for (int64_t b = 0; b < hd * 2; b += 64) __builtin_prefetch(row + t * token_stride * 2 + b);
                }
            };
            const uint32_t* qw = reinterpret_cast<const uint32_t*>(query + (r * heads + g * group) * hd);
            for (int64_t w = 0; w < hd / 2; ++w)
                for (int64_t h = 0; h < group; ++h) qt[w * 16 + h] = qw[h * (hd / 2) + w];
            _tile_loadd(3, qt, 64);
            _tile_loadd(4, qt + 256, 64);
            if (!resident) {
                _tile_loadd(5, qt + 512, 64);
                _tile_loadd(6, qt + 768, 64);
            }
            for (int64_t t = 0; t < kAhead; t += 16) prefetch(t);
            __m512 top = none;
            for (int64_t t0 = 0; t0 < len; t0 += 16) {          // pass 1: scores, 16 keys (one page's part) per tile
                prefetch(t0 + kAhead);
                const uint16_t* k = key_row(t0, 0);
                _tile_zero(0);
                _tile_loadd(2, k, token_stride * 2);
                _tile_dpbf16ps(0, 2, 3);
                _tile_loadd(7, k + 32, token_stride * 2);
                _tile_dpbf16ps(0, 7, 4);
                if (!resident) {
                    _tile_loadd(2, k + 64, token_stride * 2);
                    _tile_dpbf16ps(0, 2, 5);
                    _tile_loadd(7, k + 96, token_stride * 2);
                    _tile_dpbf16ps(0, 7, 6);
                }
                _tile_stored(0, st + t0 * 16, 64);
                if (t0 >= 16) for (int64_t t = t0 - 16; t < t0; ++t) top = _mm512_max_ps(top, _mm512_load_ps(st + t * 16));
            }
            for (int64_t t = std::max<int64_t>(0, (len - 1) / 16 * 16); t < len; ++t)   // the last tile's keys
                top = _mm512_max_ps(top, _mm512_load_ps(st + t * 16));
            const __m512 tc = _mm512_mul_ps(top, c);
            __m512 sum = _mm512_setzero_ps();
            if (resident) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(5);
                _tile_zero(6);
            } else {
                std::memset(o, 0, sizeof(float) * 16 * hd);
            }
            for (int64_t t0 = 0; t0 < len; t0 += 32) {           // pass 2
                const int64_t keys = std::min<int64_t>(32, len - t0);
                __m512 pairs[16];
                for (int64_t j = 0; j < 32; j += 2) {
                    const __m512 x0 = j < keys ? _mm512_load_ps(st + (t0 + j) * 16) : none;
                    const __m512 x1 = j + 1 < keys ? _mm512_load_ps(st + (t0 + j + 1) * 16) : none;
                    const __m512 p0 = kernels::exp2_coarse(_mm512_fmsub_ps(x0, c, tc));
                    const __m512 p1 = kernels::exp2_coarse(_mm512_fmsub_ps(x1, c, tc));
                    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                    pairs[j / 2] = _mm512_castsi512_ps(kernels::bf16_pairs(p0, p1));
                    uint16_t* dst = vs + (j / 2) * hd * 2;       // this pair's V rows, interleaved per dimension
                    const uint16_t* a = j < keys ? key_row(t0 + j, 1) : nullptr;
                    const uint16_t* b = j + 1 < keys ? key_row(t0 + j + 1, 1) : nullptr;
                    for (int64_t d = 0; d < hd; d += 32) {
                        const __m512i va = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
                        const __m512i vb = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
                        _mm512_store_si512(reinterpret_cast<__m512i*>(dst + 2 * d), _mm512_permutex2var_epi16(va, low, vb));
                        _mm512_store_si512(reinterpret_cast<__m512i*>(dst + 2 * d + 32),
                                           _mm512_permutex2var_epi16(va, high, vb));
                    }
                }
                kernels::transpose16(pairs);                     // [pair][head] -> [head][pair]
                for (int i = 0; i < 16; ++i) _mm512_store_ps(pa + i * 16, pairs[i]);
                _tile_loadd(2, pa, 64);
                if (resident) {
                    _tile_loadd(7, vs, hd * 4);
                    _tile_dpbf16ps(0, 2, 7);
                    _tile_loadd(7, vs + 32, hd * 4);
                    _tile_dpbf16ps(1, 2, 7);
                    _tile_loadd(7, vs + 64, hd * 4);
                    _tile_dpbf16ps(5, 2, 7);
                    _tile_loadd(7, vs + 96, hd * 4);
                    _tile_dpbf16ps(6, 2, 7);
                    continue;
                }
                for (int64_t d0 = 0; d0 < hd; d0 += 32) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(7, vs + 2 * d0, hd * 4);
                    _tile_dpbf16ps(0, 2, 7);
                    _tile_loadd(7, vs + 2 * d0 + 32, hd * 4);
                    _tile_dpbf16ps(1, 2, 7);
                    _tile_stored(0, part, 128);
                    _tile_stored(1, part + 16, 128);
                    for (int64_t h = 0; h < group; ++h)
                        for (int64_t d = 0; d < 32; ++d) o[h * hd + d0 + d] += part[h * 32 + d];
                }
            }
            if (resident) {
                _tile_stored(0, o, hd * 4);
                _tile_stored(1, o + 16, hd * 4);
                _tile_stored(5, o + 32, hd * 4);
                _tile_stored(6, o + 48, hd * 4);
            }
            alignas(64) float total[16];
            _mm512_store_ps(total, sum);
            uint16_t* dst = out + (r * heads + g * group) * hd;
            for (int64_t h = 0; h < group; ++h) {
                const float inv = 1.0f / total[h];
                for (int64_t d = 0; d < hd; ++d) narrow(dst + h * hd + d, o[h * hd + d] * inv);
            }
        }
        _tile_release();
    }
}
#endif

template <typename T>
void dispatch(const T* q, const T* pool, const int64_t* pages, const int64_t* lengths, T* out, float* scratch,
              int64_t rows, int64_t width, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
              int64_t max_len, float scale, int threads) {
#if defined(__AVX512F__)
    if (head_dim == 64)
        return decode_attention_one_pass<T, 64>(q, pool, pages, lengths, out, rows, width, heads, kv_heads, block_size,
                                                max_len, scale, threads);
    if (head_dim == 128)
        return decode_attention_one_pass<T, 128>(q, pool, pages, lengths, out, rows, width, heads, kv_heads, block_size,
                                                 max_len, scale, threads);
#endif
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

// A pool in the kv-pairs layout (kv_pairs_layout() == 1; npu/kv_pairs.py): head_dim 64 or 128, block_size a multiple
// of 16. The caller checks both.
void paged_decode_attention_pairs_bf16(const uint16_t* q, const uint16_t* pool, const int64_t* pages,
                                       const int64_t* lengths, uint16_t* out, float* scratch, int64_t rows,
                                       int64_t width, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                       int64_t block_size, int64_t max_len, float scale, int threads) {
#if defined(__AVX512BF16__)
    if (head_dim == 64)
        decode_attention_one_pass<uint16_t, 64, true>(q, pool, pages, lengths, out, rows, width, heads, kv_heads,
                                                      block_size, max_len, scale, threads);
    else
        decode_attention_one_pass<uint16_t, 128, true>(q, pool, pages, lengths, out, rows, width, heads, kv_heads,
                                                       block_size, max_len, scale, threads);
#endif
}

// 1: this build reads and writes pools in the kv-pairs layout (bfloat16 dot products by AVX512-BF16).
int kv_pairs_layout() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

// The tile-unit path (decode_attention_amx): the caller checks paged_decode_amx() and the shape limits first, and
// passes scratch of [threads][max_len rounded up to 32][16] floats.
void paged_decode_attention_amx_bf16(const uint16_t* q, const uint16_t* pool, const int64_t* pages,
                                     const int64_t* lengths, uint16_t* out, float* scratch, int64_t rows,
                                     int64_t width, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                     int64_t block_size, int64_t max_len, float scale, int threads) {
#if defined(APPLIANCE_AMX)
    decode_attention_amx(q, pool, pages, lengths, out, scratch, rows, width, heads, kv_heads, head_dim, block_size,
                         max_len, scale, threads);
#endif
}

// 1: this build has the tile-unit decode path and Linux granted the tile state (asked here, once).
int paged_decode_amx() {
#if defined(APPLIANCE_AMX)
    return kernels::amx_granted() ? 1 : 0;
#else
    return 0;
#endif
}
}
