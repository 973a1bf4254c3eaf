// K and V rows written into a bfloat16 pool kept in the kv-pairs layout (npu/kv_pairs.py says when and why).
//
// A pool is [2 * pages, block_size, kv_heads * head_dim] as in the rows layout (page p's K plane at 2p, its V plane at
// 2p + 1), with each plane's elements ordered for the AVX512-BF16 dot products of the attention kernels:
//   K plane: [kv_heads][head_dim / 2][block_size] 32-bit words, word (w, t) = dims 2w and 2w + 1 of key t: one
//            64-byte load gives 16 keys' pair w, dotted with a query's broadcast pair (no transpose per read);
//   V plane: [kv_heads][block_size / 2][head_dim] 32-bit words, word (j, d) = dim d of keys 2j and 2j + 1: dotted
//            with a row's broadcast pair of probabilities (no pairing per read).
// A token is written once and read by every later decode step, so the reordering moves from every read to the write.
#include <cstdint>

#include <omp.h>

namespace {

// One token's K (plane even) or V (odd) row of kv_heads x head_dim bfloat16 into its slot of the pool.
inline void write_row(uint16_t* pool, int64_t row, const uint16_t* src, int64_t kv_heads, int64_t hd,
                      int64_t block_size) {
    const int64_t plane = row / block_size, t = row % block_size, head_size = hd * block_size;
    uint16_t* const base = pool + plane * block_size * kv_heads * hd;
    if (plane % 2 == 0) {                                   // K: pair w of key t at word w * block_size + t
        uint32_t* const dst = reinterpret_cast<uint32_t*>(base);
        const uint32_t* const words = reinterpret_cast<const uint32_t*>(src);
        for (int64_t g = 0; g < kv_heads; ++g)
            for (int64_t w = 0; w < hd / 2; ++w)
                dst[(g * head_size + 2 * w * block_size) / 2 + t] = words[g * hd / 2 + w];
    } else {                                                // V: dim d of key t at element (t / 2) * 2hd + 2d + t % 2
        uint16_t* const dst = base + (t / 2) * 2 * hd + t % 2;
        for (int64_t g = 0; g < kv_heads; ++g)
            for (int64_t d = 0; d < hd; ++d) dst[g * head_size + 2 * d] = src[g * hd + d];
    }
}

}  // namespace

extern "C" {
// rows [tokens][2]: each token's K row and V row in the pool seen as [rows, kv_heads * head_dim] (plane = row /
// block_size, slot = row % block_size); src: token i's K at src + i * src_stride, its V kv_heads * head_dim further.
// The caller checks the rows are inside the pool and block_size is even.
void kv_pairs_write_bf16(uint16_t* pool, const int64_t* rows, const uint16_t* src, int64_t tokens, int64_t src_stride,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, int threads) {
    const int64_t half = kv_heads * head_dim;
    if (tokens * half < (1 << 16)) threads = 1;             // a decode step's few rows: not worth waking a thread
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < tokens; ++i) {
        write_row(pool, rows[2 * i], src + i * src_stride, kv_heads, head_dim, block_size);
        write_row(pool, rows[2 * i + 1], src + i * src_stride + half, kv_heads, head_dim, block_size);
    }
}
}
