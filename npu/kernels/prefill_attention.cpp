// Causal attention of prefill chunks for CPU runners: a flash-attention forward (online softmax over 32-key
// blocks) over packed variable-length sequences, GQA, float32 scores and sums.
//
// Layout (npu/qwen3/runner.py): q rows of the layer's activations (row stride q_stride; query head h at
// q + h * head_dim); sequence s is q rows starts[s] .. starts[s + 1]; out is [rows, heads, head_dim]. Its keys
// (struct Keys) are either its own (chunks from position 0: k and v rows of the same activations, kv head g at
// k + g * head_dim) or the first kv_lengths[s] tokens of its pages in a paged pool (chunks after cached tokens; the
// pool already holds the chunk's own; a bfloat16 pool in the kv-pairs layout, npu/kernels/kv_pairs.cpp, is read by
// the AVX512-BF16 path, which copies its words instead of packing them). The rows are the sequence's last positions:
// row i attends to keys 0 .. kv_length - rows + i. Query head h reads kv head h / (heads / kv_heads).
//
// Two phases in one parallel region: (1) every (sequence, kv head)'s K (and, for the bfloat16 paths or from pages,
// V) is packed into the caller's `scratch` (a torch tensor, so the startup profile counts it: keys rounded up to 32
// with zeros x kv_heads x head_dim x 4 bytes, plus the V rows from pages); (2) tasks of 16 query rows of one head,
// costliest first (the causal mask makes a task's cost grow with its position), dynamically over torch's OpenMP
// threads.
//
// Four paths compute the same thing (the caller picks one; tests run each against float64 attention):
//   kPortable  plain loops, both dtypes (bf16 widened): any CPU, any head_dim.
//   kAvx512    float32 with AVX-512 FMA register blocks (4 rows x 32 keys, 4 rows x 64 columns): head_dim % 64 == 0.
//   kAmx       bfloat16 on the AMX tile unit (task_amx: transposed, so a vector holds one key's scores for the 16
//              rows), P rounded to bfloat16 as torch's flash kernel does: head_dim % 32 == 0 up to 256. Linux grants
//              a process the AMX state only on request (prefill_attention_paths asks).
//   kAvx512Bf16  bfloat16 on CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and later): kAvx512's register blocks
//              with _mm512_dpbf16_ps, two dimensions or two keys per instruction, P rounded to bfloat16 as on the
//              tile path: head_dim % 32 == 0 up to 256. (torch's SDPA there runs MKL's bf16 GEMM, which on a
//              non-Intel CPU widens to float32 and calls SGEMM.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__) || defined(__AMX_TILE__)
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
#if defined(APPLIANCE_AMX)
using kernels::bf16_pairs;
using kernels::exp2_coarse;
#endif

constexpr int64_t kRows = 16;        // query rows per task: one AMX tile's rows
constexpr int64_t kBlock = 32;       // keys per online-softmax step: one tile row of bfloat16
constexpr int64_t kMaxHead = 256;
constexpr float kNone = -1e30f;      // the running max before any key (finite: -ffast-math assumes no infinities)

enum Path { kPortable = 0, kAvx512 = 1, kAmx = 2, kAvx512Bf16 = 3 };

inline int64_t padded(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

// Scores s [kRows][kBlock] of query rows q0.. (nrows of them) against keys t0.. become probabilities (masked
// keys 0; rows past nrows all 0), the running max m and sum l are updated, and alpha gets the factor the
// earlier output accumulator is scaled by.
inline void online_softmax(float* s, int64_t nrows, int64_t q0, int64_t t0, float scale, float* m, float* l,
                           float* alpha) {
    for (int64_t i = 0; i < kRows; ++i) {
        float* row = s + i * kBlock;
        const int64_t visible = i < nrows ? std::min<int64_t>(kBlock, q0 + i - t0 + 1) : 0;
        if (visible <= 0) {
            std::memset(row, 0, kBlock * sizeof(float));
            alpha[i] = 1.0f;
            continue;
        }
        float top = m[i];
#pragma omp simd reduction(max : top)
        for (int64_t j = 0; j < visible; ++j) {
            row[j] *= scale;
            top = std::max(top, row[j]);
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < visible; ++j) {
            row[j] = std::exp(row[j] - top);
            sum += row[j];
        }
        for (int64_t j = visible; j < kBlock; ++j) row[j] = 0.0f;
        alpha[i] = std::exp(m[i] - top);
        l[i] = l[i] * alpha[i] + sum;
        m[i] = top;
    }
}

#if defined(__AVX512F__)
// online_softmax in AVX-512 registers (a 32-key row is two vectors). With `probs` set (the bfloat16 paths) the
// probabilities go there as bfloat16 rows of 32, else back into s.
inline void online_softmax_avx512(float* s, int64_t nrows, int64_t q0, int64_t t0, float scale, float* m, float* l,
                                  float* alpha, uint16_t* probs) {
    const __m512 vscale = _mm512_set1_ps(scale), none = _mm512_set1_ps(kNone);
    for (int64_t i = 0; i < (nrows + 3) / 4 * 4; ++i) {        // the rows of the callers' 4-row groups
        float* row = s + i * kBlock;
        const int64_t visible = i < nrows ? std::min<int64_t>(kBlock, q0 + i - t0 + 1) : 0;
        __m512 p0 = _mm512_setzero_ps(), p1 = p0;
        if (visible <= 0) {
            alpha[i] = 1.0f;
        } else {
            const __mmask16 k0 = visible >= 16 ? 0xffff : (1u << visible) - 1;
            const __mmask16 k1 = visible >= 32 ? 0xffff : visible > 16 ? (1u << (visible - 16)) - 1 : 0;
            const __m512 s0 = _mm512_mask_mul_ps(none, k0, _mm512_load_ps(row), vscale);
            const __m512 s1 = _mm512_mask_mul_ps(none, k1, _mm512_load_ps(row + 16), vscale);
            const float top = std::max(m[i], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
            const __m512 vtop = _mm512_set1_ps(top);
            p0 = _mm512_maskz_mov_ps(k0, exp_nonpositive(_mm512_sub_ps(s0, vtop)));
            p1 = _mm512_maskz_mov_ps(k1, exp_nonpositive(_mm512_sub_ps(s1, vtop)));
            alpha[i] = std::exp(m[i] - top);
            l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
            m[i] = top;
        }
#if defined(__AVX512BF16__)
        if (probs != nullptr) {
            _mm512_store_si512(reinterpret_cast<__m512i*>(probs + i * kBlock),
                               reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
            continue;
        }
#endif
        _mm512_store_ps(row, p0);
        _mm512_store_ps(row + 16, p1);
    }
}
#endif

struct Shape {
    int64_t heads, kv_heads, hd, q_stride, kv_stride;
    float scale;
};

// Where a sequence's keys are: rows of the layer's activations (chunks from position 0: their own keys), or the
// pages of a paged pool (chunks after cached tokens: the pool already holds the chunk's own keys too).
template <typename T>
struct Keys {
    const T* k;                    // activations: K and V rows, `stride` elements apart, sequence s from starts[s]
    const T* v;
    const int64_t* starts;
    const T* pool;                 // or a pool of [2 x pages][block_size][stride] (K plane 2p, V plane 2p + 1)
    const int64_t* pages;          // [seqs][width] page ids
    int64_t width, block_size, stride;
    bool pairs = false;            // the pool's planes in the kv-pairs layout (npu/kernels/kv_pairs.cpp; bfloat16 with
                                   // AVX512-BF16 alone, block_size a multiple of 16): row() does not apply

    // key t of sequence s: its K (which = 0) or V (1) row, kv head 0
    const T* row(int64_t s, int64_t t, int which) const {
        if (pool == nullptr) return (which ? v : k) + (starts[s] + t) * stride;
        return pool + ((2 * pages[s * width + t / block_size] + which) * block_size + t % block_size) * stride;
    }
};

// K of one (sequence, kv head) as float32 [hd][padded len] (keys along rows: 16 keys per vector load).
template <typename T>
void pack_k_columns(const Keys<T>& keys, int64_t s, int64_t g, int64_t len, const Shape& sh, float* dst) {
    const int64_t lp = padded(len);
    for (int64_t t0 = 0; t0 < lp; t0 += 16) {              // 16 keys at a time, so the reads stay in a few lines
        for (int64_t t = t0; t < std::min(t0 + 16, len); ++t) {
            const T* row = keys.row(s, t, 0) + g * sh.hd;
            for (int64_t d = 0; d < sh.hd; ++d) dst[d * lp + t] = widen(row[d]);
        }
        for (int64_t t = std::max(t0, len); t < t0 + 16; ++t)
            for (int64_t d = 0; d < sh.hd; ++d) dst[d * lp + t] = 0.0f;
    }
}

// V of one (sequence, kv head) copied to contiguous rows [len][hd] (the paged case: the vector paths read V by rows).
template <typename T>
void pack_v_rows(const Keys<T>& keys, int64_t s, int64_t g, int64_t len, const Shape& sh, T* dst) {
    for (int64_t t = 0; t < len; ++t) std::memcpy(dst + t * sh.hd, keys.row(s, t, 1) + g * sh.hd, sh.hd * sizeof(T));
}

// The output rows of one task: accumulator / sum, narrowed into out.
template <typename T>
inline void write_rows(T* out, const float* o, const float* l, int64_t nrows, int64_t h, const Shape& sh) {
    for (int64_t i = 0; i < nrows; ++i) {
        const float inv = 1.0f / l[i];
        T* dst = out + i * sh.heads * sh.hd + h * sh.hd;
#pragma omp simd
        for (int64_t d = 0; d < sh.hd; ++d) narrow(dst + d, o[i * sh.hd + d] * inv);
    }
}

// One task on plain loops: query rows q0..q0+nrows of head h, at positions shift + q0..; kt is the kv head's
// packed K, v its V rows (v_stride elements apart).
template <typename T>
void task_portable(const T* q, const float* kt, const T* v, int64_t v_stride, int64_t lp, int64_t shift, int64_t q0,
                   int64_t nrows, int64_t h, const Shape& sh, T* out) {
    float qf[kRows * kMaxHead], o[kRows * kMaxHead], s[kRows * kBlock], m[kRows], l[kRows], alpha[kRows];
    for (int64_t i = 0; i < nrows; ++i)
        for (int64_t d = 0; d < sh.hd; ++d) qf[i * sh.hd + d] = widen(q[(q0 + i) * sh.q_stride + h * sh.hd + d]);
    std::fill(o, o + kRows * sh.hd, 0.0f);
    std::fill(m, m + kRows, kNone);
    std::fill(l, l + kRows, 0.0f);
    const int64_t pos0 = shift + q0, last = pos0 + nrows - 1;
    for (int64_t t0 = 0; t0 <= last; t0 += kBlock) {
        for (int64_t i = 0; i < nrows; ++i) {
            float* row = s + i * kBlock;
            for (int64_t j = 0; j < kBlock; ++j) row[j] = 0.0f;
            for (int64_t d = 0; d < sh.hd; ++d) {
                const float qd = qf[i * sh.hd + d];
                const float* kd = kt + d * lp + t0;
#pragma omp simd
                for (int64_t j = 0; j < kBlock; ++j) row[j] += qd * kd[j];
            }
        }
        online_softmax(s, nrows, pos0, t0, sh.scale, m, l, alpha);
        const int64_t upto = std::min<int64_t>(kBlock, last - t0 + 1);
        for (int64_t i = 0; i < nrows; ++i) {
            float* oi = o + i * sh.hd;
#pragma omp simd
            for (int64_t d = 0; d < sh.hd; ++d) oi[d] *= alpha[i];
            for (int64_t j = 0; j < upto; ++j) {
                const float p = s[i * kBlock + j];
                const T* vj = v + (t0 + j) * v_stride;
#pragma omp simd
                for (int64_t d = 0; d < sh.hd; ++d) oi[d] += p * widen(vj[d]);
            }
        }
    }
    write_rows(out + q0 * sh.heads * sh.hd, o, l, nrows, h, sh);
}

#if defined(__AVX512F__)
// The start of a vector-path task: its query rows of head h copied into `rows` ([kRows][hd], the rows past nrows
// zeros, so a 4-row group reads no garbage), and its accumulator, running max and sum reset.
template <typename T>
inline void begin_task(const T* q, int64_t q0, int64_t nrows, int64_t h, const Shape& sh, T* rows, float* o, float* m,
                       float* l) {
    const int64_t hd = sh.hd;
    for (int64_t i = 0; i < kRows; ++i) {
        if (i < nrows) std::memcpy(rows + i * hd, q + (q0 + i) * sh.q_stride + h * hd, hd * sizeof(T));
        else std::memset(rows + i * hd, 0, hd * sizeof(T));
    }
    std::fill(o, o + kRows * hd, 0.0f);
    std::fill(m, m + kRows, kNone);
    std::fill(l, l + kRows, 0.0f);
}

// The float32 task with AVX-512 register blocks; head_dim % 64 == 0.
void task_avx512(const float* q, const float* kt, const float* v, int64_t v_stride, int64_t lp, int64_t shift,
                 int64_t q0, int64_t nrows, int64_t h, const Shape& sh, float* out) {
    alignas(64) float qf[kRows * kMaxHead], o[kRows * kMaxHead], s[kRows * kBlock];
    float m[kRows], l[kRows], alpha[kRows];
    const int64_t hd = sh.hd;
    begin_task(q, q0, nrows, h, sh, qf, o, m, l);
    const int64_t pos0 = shift + q0, last = pos0 + nrows - 1;
    const int64_t row_groups = (nrows + 3) / 4;
    for (int64_t t0 = 0; t0 <= last; t0 += kBlock) {
        for (int64_t g = 0; g < row_groups; ++g) {          // scores: 4 rows x 32 keys in 8 registers
            const float* qg = qf + g * 4 * hd;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                   a31 = a00;
            for (int64_t d = 0; d < hd; ++d) {
                const __m512 k0 = _mm512_loadu_ps(kt + d * lp + t0), k1 = _mm512_loadu_ps(kt + d * lp + t0 + 16);
                __m512 b = _mm512_set1_ps(qg[d]);
                a00 = _mm512_fmadd_ps(b, k0, a00); a01 = _mm512_fmadd_ps(b, k1, a01);
                b = _mm512_set1_ps(qg[hd + d]);
                a10 = _mm512_fmadd_ps(b, k0, a10); a11 = _mm512_fmadd_ps(b, k1, a11);
                b = _mm512_set1_ps(qg[2 * hd + d]);
                a20 = _mm512_fmadd_ps(b, k0, a20); a21 = _mm512_fmadd_ps(b, k1, a21);
                b = _mm512_set1_ps(qg[3 * hd + d]);
                a30 = _mm512_fmadd_ps(b, k0, a30); a31 = _mm512_fmadd_ps(b, k1, a31);
            }
            float* sg = s + g * 4 * kBlock;
            _mm512_store_ps(sg, a00); _mm512_store_ps(sg + 16, a01);
            _mm512_store_ps(sg + 32, a10); _mm512_store_ps(sg + 48, a11);
            _mm512_store_ps(sg + 64, a20); _mm512_store_ps(sg + 80, a21);
            _mm512_store_ps(sg + 96, a30); _mm512_store_ps(sg + 112, a31);
        }
        online_softmax_avx512(s, nrows, pos0, t0, sh.scale, m, l, alpha, nullptr);
        const int64_t upto = std::min<int64_t>(kBlock, last - t0 + 1);
        for (int64_t g = 0; g < row_groups; ++g) {          // P.V: 4 rows x 64 columns in 16 registers
            const float* pg = s + g * 4 * kBlock;
            for (int64_t c = 0; c < hd; c += 64) {
                float* og = o + g * 4 * hd + c;
                __m512 acc[4][4];
                for (int r = 0; r < 4; ++r) {
                    const __m512 f = _mm512_set1_ps(alpha[g * 4 + r]);
                    for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_mul_ps(f, _mm512_load_ps(og + r * hd + 16 * u));
                }
                for (int64_t j = 0; j < upto; ++j) {
                    const float* vj = v + (t0 + j) * v_stride + c;
                    const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16),
                                 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
                    for (int r = 0; r < 4; ++r) {
                        const __m512 p = _mm512_set1_ps(pg[r * kBlock + j]);
                        acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
                        acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
                        acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
                        acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
                    }
                }
                for (int r = 0; r < 4; ++r)
                    for (int u = 0; u < 4; ++u) _mm512_store_ps(og + r * hd + 16 * u, acc[r][u]);
            }
        }
    }
    write_rows(out + q0 * sh.heads * hd, o, l, nrows, h, sh);
}
#endif

#if defined(__AVX512BF16__)
// K and V of one (sequence, kv head) for the AVX512-BF16 path, as 32-bit words of two bfloat16, padding keys zeros:
//   kp [hd / 2][padded len]: word (w, t) holds dimensions 2w and 2w + 1 of key t, so one load gives 16 keys' pairs,
//      dotted with a query's broadcast pair;
//   vp [padded len / 2][hd]: word (j, d) holds dimension d of keys 2j and 2j + 1, dotted with a row's broadcast
//      pair of probabilities.
// A pool in the kv-pairs layout holds each page's part of both already: a page's K words are copied a pair row at a
// time, its V words in one piece, and what lies past len (a partly written page, the padding) is zeroed.
void copy_bf16_pairs(const Keys<uint16_t>& keys, int64_t s, int64_t g, int64_t len, const Shape& sh, uint32_t* kp,
                     uint32_t* vp) {
    const int64_t lp = padded(len), hd = sh.hd, words = hd / 2, bs = keys.block_size;
    const int64_t plane_words = bs * sh.kv_heads * hd / 2, head_words = bs * hd / 2;
    const uint32_t* const pool = reinterpret_cast<const uint32_t*>(keys.pool);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t page = keys.pages[s * keys.width + t0 / bs], n = std::min(bs, len - t0);
        const uint32_t* const k = pool + 2 * page * plane_words + g * head_words;
        for (int64_t w = 0; w < words; ++w) std::memcpy(kp + w * lp + t0, k + w * bs, n * sizeof(uint32_t));
        std::memcpy(vp + t0 / 2 * hd, k + plane_words, (n + 1) / 2 * hd * sizeof(uint32_t));
        if (n % 2)                                         // the last pair's second key is past len
            for (int64_t d = 0; d < hd; ++d) vp[(t0 + n) / 2 * hd + d] &= 0xFFFFu;
    }
    for (int64_t w = 0; w < words; ++w) std::memset(kp + w * lp + len, 0, (lp - len) * sizeof(uint32_t));
    std::memset(vp + (len + 1) / 2 * hd, 0, (lp / 2 - (len + 1) / 2) * hd * sizeof(uint32_t));
}

void pack_bf16_pairs(const Keys<uint16_t>& keys, int64_t s, int64_t g, int64_t len, const Shape& sh, uint32_t* kp,
                     uint32_t* vp) {
    if (keys.pairs) return copy_bf16_pairs(keys, s, g, len, sh, kp, vp);
    const int64_t lp = padded(len), hd = sh.hd, words = hd / 2;
    for (int64_t t0 = 0; t0 < lp; t0 += 16) {               // 16 keys x 16 words, transposed in registers
        for (int64_t w0 = 0; w0 < words; w0 += 16) {
            __m512 r[16];
            for (int64_t i = 0; i < 16; ++i)
                r[i] = t0 + i < len ? _mm512_loadu_ps(keys.row(s, t0 + i, 0) + g * hd + 2 * w0) : _mm512_setzero_ps();
            kernels::transpose16(r);
            for (int64_t j = 0; j < 16; ++j) _mm512_storeu_ps(kp + (w0 + j) * lp + t0, r[j]);
        }
    }
    for (int64_t t = 0; t < lp; t += 2) {
        uint32_t* dst = vp + t / 2 * hd;
        if (t >= len) {
            std::memset(dst, 0, hd * sizeof(uint32_t));
            continue;
        }
        const uint16_t* even = keys.row(s, t, 1) + g * hd;
        const uint16_t* odd = t + 1 < len ? keys.row(s, t + 1, 1) + g * hd : nullptr;
        for (int64_t d = 0; d < hd; d += 16) {             // (even[d], odd[d]) as one word, 16 dimensions at a time
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d)));
            const __m512i hi = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + d)))
                                   : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

// P.V for 4 rows x U vectors of 16 columns from column c: acc = o x alpha + sum over key pairs of P pair . V pair.
template <int U>
inline void pv_block_bf16(const uint32_t* pw, const uint32_t* vp, int64_t hd, int64_t pairs, const float* alpha,
                          float* og) {
    __m512 acc[4][U];
    for (int r = 0; r < 4; ++r) {
        const __m512 f = _mm512_set1_ps(alpha[r]);
        for (int u = 0; u < U; ++u) acc[r][u] = _mm512_mul_ps(f, _mm512_load_ps(og + r * hd + 16 * u));
    }
    for (int64_t j = 0; j < pairs; ++j) {
        __m512bh v[U];
        for (int u = 0; u < U; ++u) v[u] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vp + j * hd + 16 * u));
        for (int r = 0; r < 4; ++r) {
            const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pw[r * kBlock / 2 + j])));
            for (int u = 0; u < U; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], v[u], p);
        }
    }
    for (int r = 0; r < 4; ++r)
        for (int u = 0; u < U; ++u) _mm512_store_ps(og + r * hd + 16 * u, acc[r][u]);
}

// The bfloat16 task on AVX512-BF16: task_avx512's blocks (4 rows x 32 keys of scores, 4 rows x 64 columns of P.V)
// with each instruction taking two dimensions (scores) or two keys (P.V); kp and vp as pack_bf16_pairs lays them.
void task_avx512_bf16(const uint16_t* q, const uint32_t* kp, const uint32_t* vp, int64_t lp, int64_t shift,
                      int64_t q0, int64_t nrows, int64_t h, const Shape& sh, uint16_t* out) {
    alignas(64) uint32_t qw[kRows * kMaxHead / 2];
    alignas(64) float o[kRows * kMaxHead], s[kRows * kBlock];
    alignas(64) uint16_t probs[kRows * kBlock];
    float m[kRows], l[kRows], alpha[kRows];
    const int64_t hd = sh.hd, words = hd / 2;
    begin_task(q, q0, nrows, h, sh, reinterpret_cast<uint16_t*>(qw), o, m, l);
    const int64_t pos0 = shift + q0, last = pos0 + nrows - 1;
    const int64_t row_groups = (nrows + 3) / 4;
    for (int64_t t0 = 0; t0 <= last; t0 += kBlock) {
        for (int64_t g = 0; g < row_groups; ++g) {          // scores: 4 rows x 32 keys in 8 registers
            const uint32_t* qg = qw + g * 4 * words;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                   a31 = a00;
            for (int64_t w = 0; w < words; ++w) {
                const __m512bh k0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + w * lp + t0));
                const __m512bh k1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + w * lp + t0 + 16));
                __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(qg[w])));
                a00 = _mm512_dpbf16_ps(a00, k0, b); a01 = _mm512_dpbf16_ps(a01, k1, b);
                b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(qg[words + w])));
                a10 = _mm512_dpbf16_ps(a10, k0, b); a11 = _mm512_dpbf16_ps(a11, k1, b);
                b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(qg[2 * words + w])));
                a20 = _mm512_dpbf16_ps(a20, k0, b); a21 = _mm512_dpbf16_ps(a21, k1, b);
                b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(qg[3 * words + w])));
                a30 = _mm512_dpbf16_ps(a30, k0, b); a31 = _mm512_dpbf16_ps(a31, k1, b);
            }
            float* sg = s + g * 4 * kBlock;
            _mm512_store_ps(sg, a00); _mm512_store_ps(sg + 16, a01);
            _mm512_store_ps(sg + 32, a10); _mm512_store_ps(sg + 48, a11);
            _mm512_store_ps(sg + 64, a20); _mm512_store_ps(sg + 80, a21);
            _mm512_store_ps(sg + 96, a30); _mm512_store_ps(sg + 112, a31);
        }
        online_softmax_avx512(s, nrows, pos0, t0, sh.scale, m, l, alpha, probs);   // P as bf16 rows of 32 keys
        const int64_t pairs = (std::min<int64_t>(kBlock, last - t0 + 1) + 1) / 2;  // a key past `last` has P 0
        for (int64_t g = 0; g < row_groups; ++g) {
            const uint32_t* pw = reinterpret_cast<const uint32_t*>(probs + g * 4 * kBlock);
            const uint32_t* vb = vp + t0 / 2 * hd;
            int64_t c = 0;
            for (; c + 64 <= hd; c += 64) pv_block_bf16<4>(pw, vb + c, hd, pairs, alpha + g * 4, o + g * 4 * hd + c);
            if (c < hd) pv_block_bf16<2>(pw, vb + c, hd, pairs, alpha + g * 4, o + g * 4 * hd + c);
        }
    }
    write_rows(out + q0 * sh.heads * hd, o, l, nrows, h, sh);
}
#endif

#if defined(APPLIANCE_AMX)
// K of one (sequence, kv head) as rows ([padded len][hd]: the A operand of K.Q^T) and V transposed per 32-key
// block ([padded len / 32][hd][32]: a block's A operands of V^T.P^T, contiguous), both bfloat16; padding keys
// are zeros.
void pack_rows_and_columns(const Keys<uint16_t>& keys, int64_t s, int64_t g, int64_t len, const Shape& sh,
                           uint16_t* kr, uint16_t* vt) {
    const int64_t lp = padded(len), hd = sh.hd;
    for (int64_t t = 0; t < len; ++t) std::memcpy(kr + t * hd, keys.row(s, t, 0) + g * hd, hd * sizeof(uint16_t));
    std::memset(kr + len * hd, 0, (lp - len) * hd * sizeof(uint16_t));
    for (int64_t t0 = 0; t0 < lp; t0 += kBlock) {
        uint16_t* block = vt + t0 * hd;
        for (int64_t t = 0; t < kBlock; ++t) {
            const uint16_t* row = t0 + t < len ? keys.row(s, t0 + t, 1) + g * hd : nullptr;
            if (t0 + t < len) for (int64_t d = 0; d < hd; ++d) block[d * kBlock + t] = row[d];
            else for (int64_t d = 0; d < hd; ++d) block[d * kBlock + t] = 0;
        }
    }
}

constexpr float kRegrow = 8.0f;   // log2 units: the running max is raised only past 2^8 (P stays <= 256), so most
                                  // blocks need no rescale of the accumulator

// The bfloat16 task on the tile unit, transposed so that a vector holds one key's scores for the task's 16 rows:
// the softmax then needs no reduction across a vector. Per 32-key block: S^T = K.Q^T (C tiles 0-1, A = K rows in
// 2, B = Q^T in VNNI pairs in 3), the online softmax on 32 vectors (exp2 with the scale folded in), P^T in VNNI
// pairs (tile 3), then O^T += V^T.P^T (A = V^T in 2). With head_dim 64, O^T stays in tiles 4-7 across blocks and
// is stored only when the running max moves by more than kRegrow; other head sizes accumulate in memory.
void task_amx(const uint16_t* q, const uint16_t* kr, const uint16_t* vt, int64_t shift, int64_t q0, int64_t nrows,
              int64_t h, const Shape& sh, uint16_t* out) {
    alignas(64) uint16_t qt[kMaxHead * kRows], pt[kBlock * kRows];
    alignas(64) float sts[2 * kBlock * kRows], pv[32 * kRows], ot[kMaxHead * kRows];
    const int64_t hd = sh.hd;
    const bool resident = hd == 64;
    const __mmask16 live = nrows >= kRows ? 0xffff : (1u << nrows) - 1;
    {                                                      // Q^T in VNNI pairs: [hd / 2][16 rows][2], i.e. the
        const __m512i rows = _mm512_mullo_epi32(           // 32-bit words of the 16 rows, transposed
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(static_cast<int>(sh.q_stride / 2)));
        const int32_t* words = reinterpret_cast<const int32_t*>(q + q0 * sh.q_stride + h * hd);
        for (int64_t w = 0; w < hd / 2; ++w)
            _mm512_store_si512(reinterpret_cast<__m512i*>(qt + w * 2 * kRows),
                               _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, words + w, 4));
    }
    std::fill(ot, ot + hd * kRows, 0.0f);
    if (resident) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
    }
    const float log2_scale = sh.scale * 1.44269504f;
    const __m512 c = _mm512_set1_ps(log2_scale), none = _mm512_set1_ps(kNone);
    __m512 m = none, l = _mm512_setzero_ps();
    // S^T of keys t0..t0 + 31 into tiles 0-1 (issued a block ahead, so the tile unit computes it while the
    // vector units run the block before's softmax)
    auto scores = [&](int64_t t0) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t d = 0; d < hd; d += 32) {
            _tile_loadd(3, qt + d * kRows, 64);
            _tile_loadd(2, kr + t0 * hd + d, hd * 2);
            _tile_dpbf16ps(0, 2, 3);
            _tile_loadd(2, kr + (t0 + 16) * hd + d, hd * 2);
            _tile_dpbf16ps(1, 2, 3);
        }
    };
    const int64_t pos0 = shift + q0, last = pos0 + nrows - 1;
    scores(0);
    _tile_stored(0, sts, 64);
    _tile_stored(1, sts + 16 * kRows, 64);
    for (int64_t t0 = 0; t0 <= last; t0 += kBlock) {
        float* const st = sts + (t0 / kBlock % 2) * kBlock * kRows;
        const bool more = t0 + kBlock <= last;
        if (more) scores(t0 + kBlock);
        // key t0 + j is seen by rows i >= t0 + j - pos0 (and i < nrows): only the last blocks need the mask
        const int64_t keys = std::min<int64_t>(kBlock, last - t0 + 1);
        const bool masked = t0 + kBlock - 1 > pos0 || nrows < kRows;
        __m512 top = m;
        for (int64_t j = 0; j < kBlock; ++j) {
            __m512 x = _mm512_load_ps(st + j * kRows);
            if (masked) {
                const int64_t from = t0 + j - pos0;
                const __mmask16 seen = j >= keys ? 0 : from <= 0 ? live : static_cast<__mmask16>(live & ~((1u << from) - 1));
                x = _mm512_mask_mov_ps(none, seen, x);
                _mm512_store_ps(st + j * kRows, x);
            }
            top = _mm512_max_ps(top, x);
        }
        if (_mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_sub_ps(top, m), c), _mm512_set1_ps(kRegrow), _CMP_GT_OQ)) {
            const __m512 alpha = exp2_coarse(_mm512_mul_ps(_mm512_sub_ps(m, top), c));
            l = _mm512_mul_ps(l, alpha);
            m = top;
            if (t0 > 0) {                                  // the accumulator so far, scaled to the new max
                if (resident) {
                    _tile_stored(4, ot, 64);
                    _tile_stored(5, ot + 16 * kRows, 64);
                    _tile_stored(6, ot + 32 * kRows, 64);
                    _tile_stored(7, ot + 48 * kRows, 64);
                }
                for (int64_t d = 0; d < hd; ++d)
                    _mm512_store_ps(ot + d * kRows, _mm512_mul_ps(_mm512_load_ps(ot + d * kRows), alpha));
                if (resident) {
                    _tile_loadd(4, ot, 64);
                    _tile_loadd(5, ot + 16 * kRows, 64);
                    _tile_loadd(6, ot + 32 * kRows, 64);
                    _tile_loadd(7, ot + 48 * kRows, 64);
                }
            }
        }
        const __m512 mc = _mm512_mul_ps(m, c);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < kBlock; j += 2) {
            const __m512 p0 = exp2_coarse(_mm512_fmsub_ps(_mm512_load_ps(st + j * kRows), c, mc));
            const __m512 p1 = exp2_coarse(_mm512_fmsub_ps(_mm512_load_ps(st + (j + 1) * kRows), c, mc));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            _mm512_store_si512(reinterpret_cast<__m512i*>(pt + j * kRows), bf16_pairs(p0, p1));
        }
        l = _mm512_add_ps(l, sum);
        _tile_loadd(3, pt, 64);
        const uint16_t* vb = vt + t0 * hd;                 // this block's V^T: [hd][32]
        if (resident) {
            _tile_loadd(2, vb, 64);
            _tile_dpbf16ps(4, 2, 3);
            _tile_loadd(2, vb + 16 * kBlock, 64);
            _tile_dpbf16ps(5, 2, 3);
            _tile_loadd(2, vb + 32 * kBlock, 64);
            _tile_dpbf16ps(6, 2, 3);
            _tile_loadd(2, vb + 48 * kBlock, 64);
            _tile_dpbf16ps(7, 2, 3);
        }
        for (int64_t d0 = 0; !resident && d0 < hd; d0 += 32) {   // two 16-column tiles at a time, added into ot
            _tile_zero(4);
            _tile_zero(5);
            _tile_loadd(2, vb + d0 * kBlock, 64);
            _tile_dpbf16ps(4, 2, 3);
            _tile_loadd(2, vb + (d0 + 16) * kBlock, 64);
            _tile_dpbf16ps(5, 2, 3);
            _tile_stored(4, pv, 64);
            _tile_stored(5, pv + 16 * kRows, 64);
            for (int64_t d = 0; d < 32; ++d)
                _mm512_store_ps(ot + (d0 + d) * kRows,
                                _mm512_add_ps(_mm512_load_ps(ot + (d0 + d) * kRows), _mm512_load_ps(pv + d * kRows)));
        }
        if (more) {
            float* const next = sts + ((t0 / kBlock + 1) % 2) * kBlock * kRows;
            _tile_stored(0, next, 64);
            _tile_stored(1, next + 16 * kRows, 64);
        }
    }
    if (resident) {
        _tile_stored(4, ot, 64);
        _tile_stored(5, ot + 16 * kRows, 64);
        _tile_stored(6, ot + 32 * kRows, 64);
        _tile_stored(7, ot + 48 * kRows, 64);
    }
    // O = O^T / l, back to rows 16 columns at a time
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), live, l));
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
        __m512 r[16];
        for (int d = 0; d < 16; ++d) r[d] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + d) * kRows), inv);
        kernels::transpose16(r);
        for (int64_t i = 0; i < nrows; ++i)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (q0 + i) * sh.heads * hd + h * hd + d0),
                                reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(r[i])));
    }
}
#endif

// q rows of sequence s: starts[s] .. starts[s + 1]; its keys: `keys` (kv_lengths[s] of them, or as many as its
// rows when kv_lengths is null); the rows are the sequence's last positions (shift = keys - rows).
template <typename T>
void prefill_attention(const T* q, const Keys<T>& keys, const int64_t* starts, const int64_t* kv_lengths, int64_t seqs,
                       T* out, void* scratch, const Shape& sh, int threads, int path) {
    const int64_t group = sh.heads / sh.kv_heads;
    const bool paged = keys.pool != nullptr;
    // each (sequence, kv head)'s scratch: 4 x padded keys x hd bytes (K as float32, or K and V as bfloat16 on the AMX
    // and AVX512-BF16 paths), and in the paged case V rows too
    const int64_t unit = paged ? 4 + static_cast<int64_t>(sizeof(T)) : 4;
    auto kv_len = [&](int64_t s) { return kv_lengths ? kv_lengths[s] : starts[s + 1] - starts[s]; };
    std::vector<int64_t> packed(seqs + 1, 0);              // each sequence's offset in scratch, x kv_heads x hd x unit B
    struct Task { int64_t seq, first, cost; };
    std::vector<Task> tasks;
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t rows = starts[s + 1] - starts[s], shift = kv_len(s) - rows;
        packed[s + 1] = packed[s] + padded(kv_len(s));
        for (int64_t first = 0; first < rows; first += kRows) tasks.push_back({s, first, shift + first});
    }
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
    const int64_t ntasks = static_cast<int64_t>(tasks.size()) * sh.heads;
    char* const base = static_cast<char*>(scratch);
    auto region = [&](int64_t s, int64_t g) {
        return base + (packed[s] * sh.kv_heads + g * (packed[s + 1] - packed[s])) * sh.hd * unit;
    };
#pragma omp parallel num_threads(threads)
    {
#if defined(APPLIANCE_AMX)
        if constexpr (sizeof(T) == 2) if (path == kAmx) kernels::configure_tiles({64, 64, 64, 64, 64, 64, 64, 64});
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t sg = 0; sg < seqs * sh.kv_heads; ++sg) {
            const int64_t s = sg / sh.kv_heads, g = sg % sh.kv_heads, len = kv_len(s), lp = padded(len);
#if defined(APPLIANCE_AMX)
            if constexpr (sizeof(T) == 2) {
                if (path == kAmx) {
                    uint16_t* kp = reinterpret_cast<uint16_t*>(region(s, g));
                    pack_rows_and_columns(keys, s, g, len, sh, kp, kp + lp * sh.hd);
                    continue;
                }
            }
#endif
#if defined(__AVX512BF16__)
            if constexpr (sizeof(T) == 2) {
                if (path == kAvx512Bf16) {
                    uint32_t* kp = reinterpret_cast<uint32_t*>(region(s, g));
                    pack_bf16_pairs(keys, s, g, len, sh, kp, kp + lp * sh.hd / 2);
                    continue;
                }
            }
#endif
            pack_k_columns(keys, s, g, len, sh, reinterpret_cast<float*>(region(s, g)));
            if (paged) pack_v_rows(keys, s, g, len, sh, reinterpret_cast<T*>(region(s, g) + lp * sh.hd * 4));
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < ntasks; ++n) {
            const Task& task = tasks[n / sh.heads];
            const int64_t h = n % sh.heads, g = h / group, s = task.seq;
            const int64_t rows = starts[s + 1] - starts[s], len = kv_len(s), lp = padded(len), shift = len - rows;
            const int64_t nrows = std::min(kRows, rows - task.first);
            const T* qs = q + starts[s] * sh.q_stride;
            T* os = out + starts[s] * sh.heads * sh.hd;
#if defined(APPLIANCE_AMX)
            if constexpr (sizeof(T) == 2) {
                if (path == kAmx) {
                    const uint16_t* kp = reinterpret_cast<const uint16_t*>(region(s, g));
                    task_amx(qs, kp, kp + lp * sh.hd, shift, task.first, nrows, h, sh, os);
                    continue;
                }
            }
#endif
#if defined(__AVX512BF16__)
            if constexpr (sizeof(T) == 2) {
                if (path == kAvx512Bf16) {
                    const uint32_t* kp = reinterpret_cast<const uint32_t*>(region(s, g));
                    task_avx512_bf16(qs, kp, kp + lp * sh.hd / 2, lp, shift, task.first, nrows, h, sh, os);
                    continue;
                }
            }
#endif
            const float* kt = reinterpret_cast<const float*>(region(s, g));
            const T* vs = paged ? reinterpret_cast<const T*>(region(s, g) + lp * sh.hd * 4) : keys.row(s, 0, 1) + g * sh.hd;
            const int64_t v_stride = paged ? sh.hd : keys.stride;
#if defined(__AVX512F__)
            if constexpr (sizeof(T) == 4) {
                if (path == kAvx512) {
                    task_avx512(qs, kt, vs, v_stride, lp, shift, task.first, nrows, h, sh, os);
                    continue;
                }
            }
#endif
            task_portable(qs, kt, vs, v_stride, lp, shift, task.first, nrows, h, sh, os);
        }
#if defined(APPLIANCE_AMX)
        if constexpr (sizeof(T) == 2) if (path == kAmx) _tile_release();
#endif
    }
}

// Chunks from position 0: q, k, v rows of the layer's activations (q_stride / kv_stride elements apart).
template <typename T>
void own_keys(const T* q, const T* k, const T* v, const int64_t* starts, int64_t seqs, T* out, void* scratch,
              int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t q_stride, int64_t kv_stride, float scale,
              int threads, int path) {
    const Keys<T> keys{k, v, starts, nullptr, nullptr, 0, 0, kv_stride};
    prefill_attention(q, keys, starts, nullptr, seqs, out, scratch,
                      Shape{heads, kv_heads, head_dim, q_stride, kv_stride, scale}, threads, path);
}

// Chunks after cached tokens: keys from the pool's pages ([seqs][width] ids, kv_lengths[s] keys each, the chunk's
// own included: the runner writes them before attending).
// pairs: the pool in the kv-pairs layout, read by the AVX512-BF16 path alone (the caller checks).
template <typename T>
void paged_keys(const T* q, const int64_t* starts, const T* pool, const int64_t* pages, int64_t width,
                int64_t block_size, const int64_t* kv_lengths, int64_t seqs, T* out, void* scratch, int64_t heads,
                int64_t kv_heads, int64_t head_dim, int64_t q_stride, float scale, int threads, int path,
                bool pairs = false) {
    const Keys<T> keys{nullptr, nullptr, nullptr, pool, pages, width, block_size, kv_heads * head_dim, pairs};
    prefill_attention(q, keys, starts, kv_lengths, seqs, out, scratch,
                      Shape{heads, kv_heads, head_dim, q_stride, kv_heads * head_dim, scale}, threads, path);
}

}  // namespace

extern "C" {
// Bit 0: the AVX-512 float32 path is compiled in; bit 1: the AMX bfloat16 path is compiled in and Linux granted
// this process the tile state (asked here, once; the grant is process-wide); bit 2: the AVX512-BF16 path is
// compiled in.
int prefill_attention_paths() {
    int paths = 0;
#if defined(__AVX512F__)
    paths |= 1;
#endif
#if defined(APPLIANCE_AMX)
    if (kernels::amx_granted()) paths |= 2;
#endif
#if defined(__AVX512BF16__)
    paths |= 4;
#endif
    return paths;
}

void causal_prefill_attention_f32(const float* q, const float* k, const float* v, const int64_t* starts, int64_t seqs,
                                  float* out, void* scratch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                  int64_t q_stride, int64_t kv_stride, float scale, int threads, int path) {
    own_keys(q, k, v, starts, seqs, out, scratch, heads, kv_heads, head_dim, q_stride, kv_stride, scale, threads, path);
}

void causal_prefill_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* starts,
                                   int64_t seqs, uint16_t* out, void* scratch, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, int64_t q_stride, int64_t kv_stride, float scale, int threads,
                                   int path) {
    own_keys(q, k, v, starts, seqs, out, scratch, heads, kv_heads, head_dim, q_stride, kv_stride, scale, threads, path);
}

void paged_prefill_attention_f32(const float* q, const int64_t* starts, const float* pool, const int64_t* pages,
                                 int64_t width, int64_t block_size, const int64_t* kv_lengths, int64_t seqs, float* out,
                                 void* scratch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t q_stride,
                                 float scale, int threads, int path) {
    paged_keys(q, starts, pool, pages, width, block_size, kv_lengths, seqs, out, scratch, heads, kv_heads, head_dim,
               q_stride, scale, threads, path);
}

void paged_prefill_attention_bf16(const uint16_t* q, const int64_t* starts, const uint16_t* pool,
                                  const int64_t* pages, int64_t width, int64_t block_size, const int64_t* kv_lengths,
                                  int64_t seqs, uint16_t* out, void* scratch, int64_t heads, int64_t kv_heads,
                                  int64_t head_dim, int64_t q_stride, float scale, int threads, int path) {
    paged_keys(q, starts, pool, pages, width, block_size, kv_lengths, seqs, out, scratch, heads, kv_heads, head_dim,
               q_stride, scale, threads, path);
}

// The same over a pool in the kv-pairs layout: the AVX512-BF16 path, block_size a multiple of 16 (the caller checks).
void paged_prefill_attention_pairs_bf16(const uint16_t* q, const int64_t* starts, const uint16_t* pool,
                                        const int64_t* pages, int64_t width, int64_t block_size,
                                        const int64_t* kv_lengths, int64_t seqs, uint16_t* out, void* scratch,
                                        int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t q_stride,
                                        float scale, int threads) {
    paged_keys(q, starts, pool, pages, width, block_size, kv_lengths, seqs, out, scratch, heads, kv_heads, head_dim,
               q_stride, scale, threads, kAvx512Bf16, true);
}
}
