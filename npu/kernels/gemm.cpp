// bfloat16 projections y = x W^T on CPUs with AVX512-BF16 and no AMX (npu/gemm_cpu.py says when it is chosen).
//
// Why not oneDNN's packed GEMM there: at the row counts of decode steps it reads weights from DRAM at half the
// rate the memory gives (one row: about 16 GB/s against 28-31) and computes at 70-80% of the CPU's peak at 32 rows.
// This kernel is one simple schedule for every row count: AMD EPYC (Zen 4), 2 threads, every projection of a 12 x
// 1024 model in turn (the weights come from DRAM, as in a decode step): 1.54x oneDNN at 1 row, 1.39x at 8, 1.22x at
// 32, 1.10x at 64, and 0.97-1.0x from 512 rows (bench/bench_cpu_gemm.py --bf16-kernel).
//
// Layout: W [n, k] is packed once, at load, into 16-column blocks of dimension pairs, packed[block][pair][col][2]
// (blocks = n / 16 and pairs = k / 2, each rounded up, zeros past n and k): a block's pair is one 64-byte line, the
// B operand of _mm512_dpbf16_ps, so the kernel reads the weight once, in order, in whole lines.
//
// Schedule: a panel is kPanel blocks (32 output columns); each thread takes a contiguous run of panels. For each
// panel, the rows in groups of up to kRows: 2 x 14 = 28 float32 accumulators in registers; each step over k reads
// a panel's two lines and broadcasts one x pair per row. The panel's lines come from DRAM for the first row group
// and from L2 for the rest; while a panel's row groups run, the next panel's lines are requested into L2 a few per
// step (with one row group, as at batch 1, that is a panel ahead of the stream).
//
// A row's sums run over k in order whatever the row count, the row's place in the batch or the thread count, so
// each output row is a function of its input row alone: a request's tokens do not change with what it is batched
// with (tests/npu/test_gemm_cpu.py). Products of two bfloat16 are exact in float32; each sum is rounded once to
// bfloat16 at the end (round to nearest even), as oneDNN's.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kBlock = 16;          // output columns per block (one float32 vector)
constexpr int64_t kPanel = 2;           // blocks per panel
constexpr int64_t kRows = 14;           // rows per group: kPanel x kRows accumulators, of the 32 vector registers
constexpr int64_t kAhead = 16;          // pairs ahead that a block's own lines are requested (1 KB)
constexpr int64_t kGrain = 1 << 16;     // multiply-adds under which one thread runs it (waking one costs more)

inline uint32_t pair_at(const uint16_t* row, int64_t pair) {
    uint32_t v;
    std::memcpy(&v, row + 2 * pair, sizeof v);
    return v;
}

// Rows [0, R) of x times the panel's `nb` blocks (NB = nb), into out (float32 sums rounded to bfloat16). `pairs`
// full dimension pairs, then the odd last dimension when `odd`; `next` / `next_lines`: the lines of the next panel
// this row group requests into L2, spread over its steps.
template <int R, int NB>
void rows_times_panel(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t block_stride,
                      int64_t pairs, bool odd, uint16_t* out, int64_t out_stride, int64_t last_cols,
                      const char* next, int64_t next_lines) {
    __m512 acc[R][NB];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    const uint16_t* row[R];
    for (int i = 0; i < R; ++i) row[i] = x + i * x_stride;
    const int64_t steps = pairs + (odd ? 1 : 0);
    int64_t requested = 0;
    for (int64_t p = 0; p < steps; ++p) {
        for (; requested * steps < next_lines * (p + 1); ++requested)
            _mm_prefetch(next + requested * 64, _MM_HINT_T1);
        __m512bh w[NB];
        for (int j = 0; j < NB; ++j) {
            const uint16_t* line = panel + j * block_stride + p * 2 * kBlock;
            _mm_prefetch(reinterpret_cast<const char*>(line + kAhead * 2 * kBlock), _MM_HINT_T0);
            w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(line));
        }
        for (int i = 0; i < R; ++i) {
            const uint32_t xp = p < pairs ? pair_at(row[i], p) : static_cast<uint32_t>(row[i][2 * p]);
            const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xp)));
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, w[j]);
        }
    }
    const __mmask16 tail = static_cast<__mmask16>((1u << last_cols) - 1);
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NB; ++j) {
            const __m256i y = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[i][j]));
            uint16_t* dst = out + i * out_stride + j * kBlock;
            if (j == NB - 1 && last_cols < kBlock) _mm256_mask_storeu_epi16(dst, tail, y);
            else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), y);
        }
}

template <int NB>
void group_times_panel(int64_t r, const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t block_stride,
                       int64_t pairs, bool odd, uint16_t* out, int64_t out_stride, int64_t last_cols,
                       const char* next, int64_t next_lines) {
#define APPLIANCE_GEMM_ROWS(n)                                                                                  \
    case n:                                                                                                     \
        rows_times_panel<n, NB>(x, x_stride, panel, block_stride, pairs, odd, out, out_stride, last_cols, next, \
                                next_lines);                                                                    \
        break;
    switch (r) {
        APPLIANCE_GEMM_ROWS(14) APPLIANCE_GEMM_ROWS(13) APPLIANCE_GEMM_ROWS(12) APPLIANCE_GEMM_ROWS(11)
        APPLIANCE_GEMM_ROWS(10) APPLIANCE_GEMM_ROWS(9) APPLIANCE_GEMM_ROWS(8) APPLIANCE_GEMM_ROWS(7)
        APPLIANCE_GEMM_ROWS(6) APPLIANCE_GEMM_ROWS(5) APPLIANCE_GEMM_ROWS(4) APPLIANCE_GEMM_ROWS(3)
        APPLIANCE_GEMM_ROWS(2) default: APPLIANCE_GEMM_ROWS(1)
    }
#undef APPLIANCE_GEMM_ROWS
}
#endif

}  // namespace

extern "C" {

// 1: this build has the kernel (compiled for a CPU with AVX512-BF16).
int gemm_bf16_available() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// packed (gemm_bf16_packed_size(n, k) values) = W [n, k] in the layout above.
int64_t gemm_bf16_packed_size(int64_t n, int64_t k) { return (n + 15) / 16 * ((k + 1) / 2) * 32; }

void gemm_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed, int threads) {
    const int64_t blocks = (n + 15) / 16, pairs = (k + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t p = 0; p < pairs; ++p)
            for (int64_t c = 0; c < 16; ++c)
                for (int64_t e = 0; e < 2; ++e) {
                    const int64_t col = b * 16 + c, dim = 2 * p + e;
                    packed[((b * pairs + p) * 16 + c) * 2 + e] = col < n && dim < k ? w[col * k + dim] : 0;
                }
}

// out [rows, n] = x [rows, k] (rows x_stride values apart) times the packed W^T, on `threads` OpenMP threads.
void gemm_bf16(const uint16_t* x, int64_t rows, int64_t k, int64_t x_stride, const uint16_t* packed, int64_t n,
               uint16_t* out, int threads) {
#if defined(__AVX512BF16__)
    const int64_t blocks = (n + 15) / 16, pairs = k / 2, block_stride = (k + 1) / 2 * 2 * kBlock;
    const int64_t panels = (blocks + kPanel - 1) / kPanel;
    const bool odd = k % 2 == 1;
    if (rows * n * k < kGrain) threads = 1;
    threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, panels)));
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t first = panels * t / nt, end = panels * (t + 1) / nt;
        for (int64_t panel = first; panel < end; ++panel) {
            const int64_t b0 = panel * kPanel, nb = std::min(kPanel, blocks - b0);
            const int64_t last_cols = std::min<int64_t>(kBlock, n - (b0 + nb - 1) * kBlock);
            const uint16_t* w = packed + b0 * block_stride;
            const int64_t next_blocks = panel + 1 < end ? std::min(kPanel, blocks - b0 - kPanel) : 0;
            const char* next = reinterpret_cast<const char*>(packed + (b0 + kPanel) * block_stride);
            const int64_t next_lines = next_blocks * block_stride * 2 / 64;
            const int64_t groups = (rows + kRows - 1) / kRows;
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t r0 = g * kRows, r = std::min(kRows, rows - r0);
                const int64_t l0 = next_lines * g / groups, l1 = next_lines * (g + 1) / groups;
                const uint16_t* xg = x + r0 * x_stride;
                uint16_t* og = out + r0 * n + b0 * kBlock;
                if (nb == kPanel)
                    group_times_panel<2>(r, xg, x_stride, w, block_stride, pairs, odd, og, n, last_cols,
                                         next + l0 * 64, l1 - l0);
                else
                    group_times_panel<1>(r, xg, x_stride, w, block_stride, pairs, odd, og, n, last_cols,
                                         next + l0 * 64, l1 - l0);
            }
        }
    }
#endif
}
}
