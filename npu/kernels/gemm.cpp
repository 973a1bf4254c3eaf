// Projections y = x W^T on AVX-512 CPUs: bfloat16 by AVX512-BF16 (the default where the CPU has no AMX) and float32
// by FMA (where chosen); npu/gemm_cpu.py and npu/linear.py say when each is taken.
//
// Why not oneDNN's packed GEMM there: at the row counts of decode steps it read the weights from DRAM at about half
// the memory's rate and computed at 75-85% of the CPU's peak at 32 rows. This kernel is one simple schedule for every
// row count. AMD EPYC (Zen 4), 2 threads, every projection of a model in turn, so the weights come from DRAM as in
// a decode step (bench/bench_cpu_gemm.py --layers), bfloat16 against oneDNN: 12 x 1024 1.32x at 1 row, 1.37x at 8,
// 1.16x at 32, 1.06x at 64, 1.0x at 512 and 0.98x at 2,048; 6 x 768 1.48x, 1.55x, 1.13x, 1.06x and 0.96x at 512.
// float32: 1.33x at 1 row, 1.6x at 8, 1.06x at 32 and 64, 0.96x at 512 (so oneDNN stays float32's default).
//
// Layout: W [n, k] is packed once, at load, into 16-column blocks of steps, packed[block][step][col][dims] (a step
// is one dimension in float32 and a pair in bfloat16; blocks and steps rounded up, zeros past n and k): a block's
// step is one 64-byte line, the B operand of one multiply-add, so the kernel reads the weight once, in order, in
// whole lines.
//
// Schedule: a panel is kPanel blocks (32 output columns); each thread takes a contiguous run of panels. Rows go in
// chunks of kChunkGroups groups of up to kRows; a chunk's rows are staged as words by step (a step's 14 broadcasts
// from one line). For each panel, each group keeps 2 x 14 = 28 float32 accumulators in registers; a step reads the
// panel's two lines and broadcasts one word per row. The panel's lines come from DRAM for the chunk's first group
// and from L2 for the rest; while a panel's groups run, the next panel's lines are requested into L2 (with one
// group, as at batch 1, that is a panel ahead of the stream).
//
// A row's sums run over k in order whatever the row count, the row's place in the batch or the thread count, so
// each output row is a function of its input row alone: a request's tokens do not change with what it is batched
// with (tests/npu/test_gemm_cpu.py). Products of two bfloat16 are exact in float32; each sum is rounded once to
// bfloat16 at the end (round to nearest even), as oneDNN's.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// The packed layout, per dtype: a step covers kDims[T] dimensions (bfloat16 a pair, float32 one); a block's step is
// one 64-byte line of 16 columns.
template <typename T>
constexpr int64_t kDims = std::is_same_v<T, float> ? 1 : 2;

template <typename T>
void pack(const T* w, int64_t n, int64_t k, T* packed, int threads) {
    constexpr int64_t dims = kDims<T>;
    const int64_t blocks = (n + 15) / 16, steps = (k + dims - 1) / dims;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t p = 0; p < steps; ++p)
            for (int64_t c = 0; c < 16; ++c)
                for (int64_t e = 0; e < dims; ++e) {
                    const int64_t col = b * 16 + c, dim = dims * p + e;
                    packed[((b * steps + p) * 16 + c) * dims + e] = col < n && dim < k ? w[col * k + dim] : T(0);
                }
}

#if defined(__AVX512F__)
constexpr int64_t kBlock = 16;          // output columns per block (one float32 vector)
constexpr int64_t kPanel = 2;           // blocks per panel
constexpr int64_t kRows = 14;           // rows per group: kPanel x kRows accumulators, of the 32 vector registers
constexpr int64_t kChunkGroups = 8;     // row groups whose x is staged at once (112 rows: 224 KB at k = 1,024)
constexpr int64_t kAhead = 16;          // steps ahead that a block's own lines are requested (1 KB)
constexpr int64_t kGrain = 1 << 16;     // multiply-adds under which one thread runs it (waking one costs more)

// What one row gives a step: float32 one value, bfloat16 a pair of dimensions as one 32-bit word.
template <typename T>
using Word = std::conditional_t<std::is_same_v<T, float>, float, uint32_t>;

// A group's rows as words by step, xt[p * kRows + i], so a step's broadcasts come from one line at fixed offsets
// (read from the rows themselves, the 14 row pointers did not fit the registers: a reload per broadcast).
template <typename T>
void stage_rows(const T* x, int64_t x_stride, int64_t r, int64_t k, Word<T>* xt) {
    for (int64_t i = 0; i < r; ++i) {
        const T* row = x + i * x_stride;
        if constexpr (std::is_same_v<T, float>) {
            for (int64_t p = 0; p < k; ++p) xt[p * kRows + i] = row[p];
        } else {
            for (int64_t p = 0; p < k / 2; ++p) std::memcpy(&xt[p * kRows + i], row + 2 * p, sizeof(uint32_t));
            if (k % 2) xt[(k / 2) * kRows + i] = row[k - 1];      // an odd k: the last pair's other half zero
        }
    }
}

// acc += a step's broadcast word times a block's line w.
template <typename T>
inline __m512 step_madd(__m512 acc, Word<T> word, const T* w) {
    if constexpr (std::is_same_v<T, float>) {
        return _mm512_fmadd_ps(_mm512_set1_ps(word), _mm512_loadu_ps(w), acc);
    } else {
#if defined(__AVX512BF16__)
        return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(word))),
                                reinterpret_cast<__m512bh>(_mm512_loadu_si512(w)));
#else
        return acc;
#endif
    }
}

template <typename T>
inline void store16(T* dst, __m512 v, int64_t cols) {
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    if constexpr (std::is_same_v<T, float>) {
        if (cols < kBlock) _mm512_mask_storeu_ps(dst, mask, v);
        else _mm512_storeu_ps(dst, v);
    } else {
#if defined(__AVX512BF16__)
        const __m256i y = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
        if (cols < kBlock) _mm256_mask_storeu_epi16(dst, mask, y);
        else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), y);
#endif
    }
}

// A group's R staged rows times the panel's NB blocks, into out; `next` / `next_lines`: the lines of the next
// panel this group requests into L2, at most two per step.
template <typename T, int R, int NB>
void rows_times_panel(const Word<T>* xt, const T* panel, int64_t block_stride, int64_t steps, T* out,
                      int64_t out_stride, int64_t last_cols, const char* next, int64_t next_lines) {
    constexpr int64_t line = 64 / sizeof(T);
    __m512 acc[R][NB];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    const T* w[NB];
    for (int j = 0; j < NB; ++j) w[j] = panel + j * block_stride;
    int64_t requested = 0;
    for (int64_t p = 0; p < steps; ++p, xt += kRows) {
        for (int l = 0; l < 2 && requested < next_lines; ++l, ++requested)
            _mm_prefetch(next + requested * 64, _MM_HINT_T1);
        for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w[j] + kAhead * line), _MM_HINT_T0);
        for (int i = 0; i < R; ++i)
            for (int j = 0; j < NB; ++j) acc[i][j] = step_madd<T>(acc[i][j], xt[i], w[j]);
        for (int j = 0; j < NB; ++j) w[j] += line;
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NB; ++j)
            store16(out + i * out_stride + j * kBlock, acc[i][j], j == NB - 1 ? last_cols : kBlock);
}

template <typename T, int NB>
void group_times_panel(int64_t r, const Word<T>* xt, const T* panel, int64_t block_stride, int64_t steps, T* out,
                       int64_t out_stride, int64_t last_cols, const char* next, int64_t next_lines) {
#define APPLIANCE_GEMM_ROWS(n)                                                                                     \
    case n:                                                                                                        \
        rows_times_panel<T, n, NB>(xt, panel, block_stride, steps, out, out_stride, last_cols, next, next_lines); \
        break;
    switch (r) {
        APPLIANCE_GEMM_ROWS(14) APPLIANCE_GEMM_ROWS(13) APPLIANCE_GEMM_ROWS(12) APPLIANCE_GEMM_ROWS(11)
        APPLIANCE_GEMM_ROWS(10) APPLIANCE_GEMM_ROWS(9) APPLIANCE_GEMM_ROWS(8) APPLIANCE_GEMM_ROWS(7)
        APPLIANCE_GEMM_ROWS(6) APPLIANCE_GEMM_ROWS(5) APPLIANCE_GEMM_ROWS(4) APPLIANCE_GEMM_ROWS(3)
        APPLIANCE_GEMM_ROWS(2) default: APPLIANCE_GEMM_ROWS(1)
    }
#undef APPLIANCE_GEMM_ROWS
}

template <typename T>
void gemm(const T* x, int64_t rows, int64_t k, int64_t x_stride, const T* packed, int64_t n, T* out, int threads) {
    constexpr int64_t dims = kDims<T>;
    const int64_t blocks = (n + 15) / 16, steps = (k + dims - 1) / dims;
    const int64_t block_stride = steps * 64 / static_cast<int64_t>(sizeof(T));
    const int64_t panels = (blocks + kPanel - 1) / kPanel;
    if (rows * n * k < kGrain) threads = 1;
    threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, panels)));
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t first = panels * t / nt, end = panels * (t + 1) / nt;
        thread_local std::vector<Word<T>> staged;
        staged.resize(static_cast<size_t>(kChunkGroups * steps * kRows));
        // rows in chunks of kChunkGroups groups: a chunk's x staged once (each thread stages its own copy), then
        // every panel of the thread times each of its groups
        for (int64_t c0 = 0; c0 < rows; c0 += kChunkGroups * kRows) {
            const int64_t groups = std::min(kChunkGroups, (rows - c0 + kRows - 1) / kRows);
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t r0 = c0 + g * kRows;
                stage_rows(x + r0 * x_stride, x_stride, std::min(kRows, rows - r0), k,
                           staged.data() + g * steps * kRows);
            }
            for (int64_t panel = first; panel < end; ++panel) {
                const int64_t b0 = panel * kPanel, nb = std::min(kPanel, blocks - b0);
                const int64_t last_cols = std::min<int64_t>(kBlock, n - (b0 + nb - 1) * kBlock);
                const T* w = packed + b0 * block_stride;
                const int64_t next_blocks = panel + 1 < end ? std::min(kPanel, blocks - b0 - kPanel) : 0;
                const char* next = reinterpret_cast<const char*>(packed + (b0 + kPanel) * block_stride);
                const int64_t next_lines = next_blocks * steps;
                for (int64_t g = 0; g < groups; ++g) {
                    const int64_t r0 = c0 + g * kRows, r = std::min(kRows, rows - r0);
                    const int64_t l0 = next_lines * g / groups, l1 = next_lines * (g + 1) / groups;
                    const Word<T>* xt = staged.data() + g * steps * kRows;
                    T* og = out + r0 * n + b0 * kBlock;
                    if (nb == kPanel)
                        group_times_panel<T, 2>(r, xt, w, block_stride, steps, og, n, last_cols, next + l0 * 64,
                                                l1 - l0);
                    else
                        group_times_panel<T, 1>(r, xt, w, block_stride, steps, og, n, last_cols, next + l0 * 64,
                                                l1 - l0);
                }
            }
        }
    }
}
#endif

}  // namespace

extern "C" {

// 1: this build has the kernel for the dtype (float32: AVX-512; bfloat16: AVX512-BF16).
int gemm_available_f32() {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

int gemm_available_bf16() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// The packed size in values of W [n, k] in the layout above.
int64_t gemm_packed_size_f32(int64_t n, int64_t k) { return (n + 15) / 16 * 16 * k; }
int64_t gemm_packed_size_bf16(int64_t n, int64_t k) { return (n + 15) / 16 * 16 * ((k + 1) / 2 * 2); }

void gemm_pack_f32(const float* w, int64_t n, int64_t k, float* packed, int threads) {
    pack(w, n, k, packed, threads);
}

void gemm_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed, int threads) {
    pack(w, n, k, packed, threads);
}

// out [rows, n] = x [rows, k] (rows x_stride values apart) times the packed W^T, on `threads` OpenMP threads.
void gemm_f32(const float* x, int64_t rows, int64_t k, int64_t x_stride, const float* packed, int64_t n, float* out,
              int threads) {
#if defined(__AVX512F__)
    gemm(x, rows, k, x_stride, packed, n, out, threads);
#endif
}

void gemm_bf16(const uint16_t* x, int64_t rows, int64_t k, int64_t x_stride, const uint16_t* packed, int64_t n,
               uint16_t* out, int threads) {
#if defined(__AVX512BF16__)
    gemm(x, rows, k, x_stride, packed, n, out, threads);
#endif
}
}
