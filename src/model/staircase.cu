// DFlash's training attention on the tensor cores (bf16 in, f32 accumulation): each block of queries (16, or DFlash
// 2's 8) sees a range of its row's context keys, [lo, hi) (from its conversation's first token or its window's, to
// its anchor), and the keys of its own block (all of them, or with `causal_block` those at or before its own slot);
// with a sliding `window`, a query sees only the keys fewer than `window` positions from it (its own included). A
// warp owns 16 query rows, a unit: one block of 16 or two of 8 (`PER`). Blocks come in anchor order, so the context
// ranges of consecutive blocks overlap almost whole: a thread block (4 warps, a unit each) streams the union of its
// units' ranges through shared memory once, 64 keys at a time, and each warp masks its rows' ranges. Memory is
// O(tokens): the output and one log-sum-exp per query row, nothing of size queries x keys.
//
// The backward is two kernels, neither with atomics: `staircase_dq` walks the forward's tiles again, each warp
// owning its 16 query rows' gradient; `staircase_dkv` gives each thread block 64 keys (context or block keys) of one
// K/V head and walks every query block that sees one of them, for each query head of the group, so each warp owns
// its 16 keys' gradients. Both recompute the probabilities from the forward's log-sum-exp.
//
// Compiled at run time by NVRTC with HEAD_DIM defined (64 or 128) and UNIT_BLOCKS (1 or 2). Tensors are addressed by
// strides in elements (the head dimension contiguous): q [B, H, Q, D]; k_ctx, v_ctx [B, KV, S, D]; k_blk, v_blk
// [B, KV, Q, D]; lo, hi [B, N] int32, each ascending along a row (blocks in anchor order); contiguous: o, dout, dq
// [B, H, Q, D], lse, drow [B, H, Q] f32 (the log-sum-exp in natural log; drow = sum over D of dout * o), dk_ctx,
// dv_ctx [B, KV, S, D], dk_blk, dv_blk [B, KV, Q, D]; Q = 16 units, N = PER units.
typedef unsigned int u32;

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef UNIT_BLOCKS
#define UNIT_BLOCKS 1
#endif
// Blocks a warp's 16 query rows (a unit): 1, blocks of 16; or 2, DFlash 2's blocks of 8 (a module of its own, so
// that blocks of 16 pay nothing for the choice). SHIFT: log2 of a block's rows; SLOTS: a block's last slot.
#define PER UNIT_BLOCKS
#define SHIFT (PER == 2 ? 3 : 4)
#define SLOTS ((1 << SHIFT) - 1)
#define D HEAD_DIM
#define KEYS 64                 // keys per tile
#define ROW (D + 8)             // a tile row in shared memory, padded: ldmatrix's 8 rows then hit 8 distinct banks
#define WARPS 4
#define THREADS (WARPS * 32)
#define NEG_INF __int_as_float(0xff800000u)
#define LOG2E 1.4426950408889634f  // scores and log-sum-exps go to base 2 (ex2) and back
#define LN2 0.6931471805599453f

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}

// 16 bytes from global to shared memory, asynchronously; zeros where `valid` is false (rows past the data).
__device__ __forceinline__ void copy16(bf16* dst, const bf16* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copies_issued() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void copies_done() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c += a (16x16, row) * b (16x8, col), bf16 in, f32 accumulate.
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x, the special function unit's approximation (flush to zero), as flash attention takes it.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats as two bf16 in one register (round to nearest even), the first in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// One float as bf16 (round to nearest even).
__device__ __forceinline__ bf16 to_bf16(float x) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
  return r;
}

// Zeros accumulators of C fragments.
template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
}

// Two n-tiles of C fragments (16 x 16 of f32) as one k-step's A fragments in bf16 (register reuse, as flash attention).
__device__ __forceinline__ void c_as_a(u32 (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// c0, c1 (16 x 8 each) += a (16 x 16, k-step `k` of D) times rows [row0, row0 + 16) of a shared-memory tile (16 x D)
// transposed: each tile row is one column of the product (scores against keys, or against queries).
__device__ __forceinline__ void mma_cols(float (&c0)[4], float (&c1)[4], const u32 (&a)[4], const bf16* tile, int row0,
                                         int k) {
  const int lane = threadIdx.x & 31;
  u32 b[4];
  ldmatrix_x4(b, tile + (row0 + (lane & 7) + ((lane >> 4) << 3)) * ROW + k * 16 + ((lane >> 3) & 1) * 8);
  mma(c0, a, b[0], b[1]);
  mma(c1, a, b[2], b[3]);
}

// acc (16 x D) += a (16 x 16) times rows [row0, row0 + 16) of a shared-memory tile (16 x D): the tile's rows are the
// reduction, so its B fragments come transposed.
__device__ __forceinline__ void mma_rows(float (&acc)[D / 8][4], const u32 (&a)[4], const bf16* tile, int row0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int n = 0; n < D / 8; n += 2) {
    u32 b[4];
    ldmatrix_x4_trans(b, tile + (row0 + (lane & 15)) * ROW + n * 8 + (lane >> 4) * 8);
    mma(acc[n], a, b[0], b[1]);
    mma(acc[n + 1], a, b[2], b[3]);
  }
}

// Loads `rows` rows of D elements (row stride `stride`) into a tile of TILE rows, zeros past `rows`.
template <int TILE = KEYS>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* src, long long stride, int rows) {
  constexpr int CHUNKS = D / 8;  // 16-byte pieces a row
  for (int i = threadIdx.x; i < TILE * CHUNKS; i += THREADS) {
    int r = i / CHUNKS, c = i % CHUNKS;
    bool valid = r < rows;
    copy16(tile + r * ROW + c * 8, valid ? src + r * stride + c * 8 : src, valid);
  }
}

// Whether query slot `s` of a block sees a key: a context key at index `key` (the block's range [lo, hi), hi its
// anchor, so the query is at hi + s; with a window, only keys fewer than `window` positions back), or (`own`) the
// block's own key at slot `t` (all, or with `causal` those at or before `s`; with a window, those within it, on both
// sides where the block is not causal), as `LayerAttention::hides` says in src/model/attention.rs.
__device__ __forceinline__ bool sees(bool own, int key, int t, int s, int lo, int hi, bool causal, int window) {
  if (own) return (!causal || t <= s) && (window == 0 || (s - t < window && (causal || t - s < window)));
  return key >= lo && key < hi && (window == 0 || key > hi + s - window);
}

// The online softmax's statistics over one tile's scores `s` (a warp's 16 rows, in C fragments): masked where
// `seen(col, row)` is false or the n-tile is outside [col0, col0 + cols) (unless `whole`: every row sees every
// column), the running maximum of each of this thread's two rows (g and g + 8, in base 2 of the scaled scores)
// updated and the sums `l` rescaled to it; `alpha` the factor the output takes to it (`rescale`), `shift` the maximum
// the probabilities subtract.
template <typename Seen>
__device__ __forceinline__ void softmax_stats(float (&s)[KEYS / 8][4], int col0, int cols, bool whole, Seen&& seen,
                                             float scale_log2, float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             float (&shift)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
  for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!whole) {
        int col = n * 8 + 2 * c + (e & 1);
        int row = g + (e >> 1) * 8;
        if (!(n >= col0 && n < col0 + cols && seen(col, row))) s[n][e] = NEG_INF;
      }
      tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    float m_new = fmaxf(m[r], tile_max[r] * scale_log2);
    // A row that has seen nothing yet keeps m = -inf: its factors must not be NaN (2^(-inf - 0) = 0).
    shift[r] = m_new == NEG_INF ? 0.f : m_new;
    alpha[r] = ex2(m[r] - shift[r]);
    m[r] = m_new;
    l[r] *= alpha[r];
  }
}

// The output rescaled to a new running maximum (`alpha` from `softmax_stats`).
__device__ __forceinline__ void rescale(float (&acc)[D / 8][4], const float (&alpha)[2]) {
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    acc[n][0] *= alpha[0];
    acc[n][1] *= alpha[0];
    acc[n][2] *= alpha[1];
    acc[n][3] *= alpha[1];
  }
}

// `softmax_stats`, then the output rescaled: the step where nothing else writes `acc` meanwhile.
template <typename Seen>
__device__ __forceinline__ void softmax_step(float (&s)[KEYS / 8][4], int col0, int cols, bool whole, Seen&& seen,
                                            float scale_log2, float (&m)[2], float (&l)[2], float (&acc)[D / 8][4],
                                            float (&shift)[2]) {
  float alpha[2];
  softmax_stats(s, col0, cols, whole, seen, scale_log2, m, l, alpha, shift);
  rescale(acc, alpha);
}

// P = 2^(s - m) of k-step `kk` (keys 16 kk..16 kk + 15) as bf16 A fragments for the values' product; the row sums
// added to `l` in f32, before rounding.
__device__ __forceinline__ void probabilities(u32 (&pa)[4], const float (&s)[KEYS / 8][4], int kk, float scale_log2,
                                             const float (&shift)[2], float (&l)[2]) {
  float p[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int e = 0; e < 4; ++e) p[h][e] = ex2(fmaf(s[2 * kk + h][e], scale_log2, -shift[e >> 1]));
    l[0] += p[h][0] + p[h][1];
    l[1] += p[h][2] + p[h][3];
  }
  c_as_a(pa, p[0], p[1]);
}

// The probabilities 2^(s - m) of a whole tile in place of its scores (f32), their row sums added to `l`: the
// warp-specialized forward's softmax, which makes them bf16 (`c_as_a`) only once the registers are free.
__device__ __forceinline__ void exponentiate(float (&s)[KEYS / 8][4], float scale_log2, const float (&shift)[2],
                                            float (&l)[2]) {
#pragma unroll
  for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = ex2(fmaf(s[n][e], scale_log2, -shift[e >> 1]));
    l[0] += s[n][0] + s[n][1];
    l[1] += s[n][2] + s[n][3];
  }
}

// One warp's part of a tile of KEYS keys: scores of its 16 queries against the tile's keys, masked where
// `seen(col, row)` is false (unless `whole`: every row sees every column), online softmax, and the values' product
// into `acc`. `cols`: the n-tiles (8 keys each) to compute, from `col0`.
template <typename Seen>
__device__ __forceinline__ void attend(const u32 (&qa)[D / 16][4], const bf16* ktile, const bf16* vtile, int col0,
                                      int cols, bool whole, Seen&& seen, float scale_log2, float (&m)[2],
                                      float (&l)[2], float (&acc)[D / 8][4]) {
  float s[KEYS / 8][4];
  zero(s);
  // S = Q K^T: for each pair of n-tiles and each k-step, one ldmatrix.x4 gives both tiles' B fragments.
#pragma unroll
  for (int n = 0; n < KEYS / 8; n += 2) {
    if (n < col0 || n >= col0 + cols) continue;
#pragma unroll
    for (int k = 0; k < D / 16; ++k) mma_cols(s[n], s[n + 1], qa[k], ktile, n * 8, k);
  }
  float shift[2];
  softmax_step(s, col0, cols, whole, seen, scale_log2, m, l, acc, shift);
#pragma unroll
  for (int kk = 0; kk < KEYS / 16; ++kk) {
    if (2 * kk + 1 < col0 || 2 * kk >= col0 + cols) continue;
    u32 pa[4];
    probabilities(pa, s, kk, scale_log2, shift, l);
    mma_rows(acc, pa, vtile, kk * 16);  // O += P V
  }
}

#ifdef WGMMA
// Hopper's warpgroup products for the three training kernels (issue 65; compiled for compute_90a with WGMMA defined,
// where DFLASH_WGMMA=1 asks for it): the forward's S = Q K^T and O = P V, dQ's S, dP = dO V^T and dQ += dS K, and dK
// and dV's S^T = K Q^T, dP^T = V dO^T, dV += P^T dO and dK += dS^T Q, each one warpgroup's `wgmma` over the thread
// block's 64 query rows (for dK and dV, its 64 keys), where each warp ran mma.sync over its 16. Q, dO, P and dS are
// A from the registers mma.sync took them from; dK/dV's key and value tiles are A from shared memory; every B is a
// tile in shared memory. The accumulators land as mma.sync's fragments (warp w holds rows 16w..16w+15), so the masks
// and the online softmax are the same code. Every warp of the group runs every product (they are collective): a warp
// whose rows have nothing in a tile masks all of it.
// Tiles hold ROWS rows of D in wgmma's no-swizzle layout (`load_tile_wg`): 16-byte chunk c of row r at byte
// c * ROWS * 16 + r * 16, so a core matrix is 8 consecutive rows of one chunk column. As a K-major operand (rows along
// M or N, the head dimension the reduction) a 16-wide step of the head dimension is two chunk columns; as an N-major
// one (rows the reduction, the head dimension along N) a step is 16 rows. The descriptor's leading byte offset is, for
// K-major, the step along K between core matrices (one chunk column, ROWS * 16 bytes) and its stride the step along
// M/N (8 rows, 128 bytes); for N-major too leading is the step along K (8 rows, 128 bytes) and stride the step along
// N (ROWS * 16), as CUTLASS's make_gmma_desc fills them for the interleaved layout; WG_N_MAJOR_SWAPPED 1 takes them
// the other way, for where scripts/probes/wgmma_tile.cu finds that the GPU reads them so.
#ifndef WG_N_MAJOR_SWAPPED
#define WG_N_MAJOR_SWAPPED 0
#endif

__device__ __forceinline__ unsigned long long wg_desc(const bf16* tile, u32 lead, u32 stride) {
  const u32 address = smem_addr(tile);
  return (unsigned long long)((address & 0x3FFFF) >> 4) | ((unsigned long long)((lead & 0x3FFFF) >> 4) << 16) |
         ((unsigned long long)((stride & 0x3FFFF) >> 4) << 32);
}
// Step `k` (16 of the head dimension) of a K-major tile of `rows` rows, from its row `row0` (a multiple of 8).
__device__ __forceinline__ unsigned long long wg_k_major(const bf16* tile, int rows, int k, int row0 = 0) {
  return wg_desc(tile + k * 2 * rows * 8 + row0 * 8, rows * 16, 128);
}
// Step `k` (rows 16k..16k+15) of an N-major tile of `rows` rows.
__device__ __forceinline__ unsigned long long wg_n_major(const bf16* tile, int rows, int k) {
  return WG_N_MAJOR_SWAPPED ? wg_desc(tile + k * 16 * 8, rows * 16, 128) : wg_desc(tile + k * 16 * 8, 128, rows * 16);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// The products issued since the last commit made one group; waiting until at most N groups are in flight (groups
// complete in the order they were committed).
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wg_done() {
  wg_commit();
  wg_wait<0>();
}
// What ordinary stores (cp.async's included) put in shared memory, made visible to wgmma's reads.
__device__ __forceinline__ void wg_visible() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The 32 accumulators of an m64n64 product (8 n-tiles of C fragments) as asm operands %0-%31, and their list in the
// instruction.
#define WG_ACC32(d)                                                                                                  \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),           \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),       \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),       \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),       \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define WG_REGS32                                                                                                    \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "   \
  "%24, %25, %26, %27, %28, %29, %30, %31}, "

// d (64 x KEYS) = a (this warp's 16 x 16) times 16 x KEYS of a K-major tile (the keys' rows), + d where `accumulate`.
__device__ __forceinline__ void wg_scores(float (&d)[KEYS / 8][4], const u32 (&a)[4], unsigned long long b,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      WG_REGS32
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : WG_ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// d (64 x D) = a (this warp's 16 x 16 of P) times 16 x D of an N-major tile (the values' rows), + d where
// `accumulate`.
#if D == 64
__device__ __forceinline__ void wg_values(float (&d)[D / 8][4], const u32 (&a)[4], unsigned long long b,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      WG_REGS32
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : WG_ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
#else
__device__ __forceinline__ void wg_values(float (&d)[D / 8][4], const u32 (&a)[4], unsigned long long b,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
        "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
#endif

// Loads `rows` rows of D elements (row stride `stride`) into a tile of TILE rows in the core-matrix layout, zeros past
// `rows`. Eight threads write one core matrix's 128 bytes, four of them side by side read 64 bytes of each row.
// `BY` threads share the copies, this one the `by`-th of them (the thread block's, unless a warp-specialized kernel's
// producer does them).
template <int TILE = KEYS, int BY = THREADS>
__device__ __forceinline__ void load_tile_wg(bf16* tile, const bf16* src, long long stride, int rows,
                                             int by = threadIdx.x) {
  constexpr int CHUNKS = D / 8;
  for (int i = by; i < TILE * CHUNKS; i += BY) {
    const int within = i % (8 * CHUNKS), r = i / (8 * CHUNKS) * 8 + within % 8, c = within / 8;
    const bool valid = r < rows;
    copy16(tile + c * TILE * 8 + r * 8, valid ? src + r * stride + c * 8 : src, valid);
  }
}

// d (64 x 32) = a (64 x 16, a K-major tile in shared memory) times 16 x 32 of another, + d where `accumulate`: dK and
// dV's S^T = K Q^T and dP^T = V dO^T, whose A (the thread block's 64 keys) stays in shared memory.
__device__ __forceinline__ void wg_scores_half_ss(float (&d)[4][4], unsigned long long a, unsigned long long b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(a), "l"(b), "r"(accumulate));
}

// `attend` on the warpgroup's products: the same masks and online softmax, every warp of the group taking part.
template <typename Seen>
__device__ __forceinline__ void attend_wg(const u32 (&qa)[D / 16][4], const bf16* ktile, const bf16* vtile, int col0,
                                         int cols, bool whole, Seen&& seen, float scale_log2, float (&m)[2],
                                         float (&l)[2], float (&acc)[D / 8][4]) {
  // The first product writes s (its accumulate flag 0): no ordinary write to the accumulators between the fence and
  // the products (the compiler may move a zeroing there, and ptxas would then wait: C7519).
  float s[KEYS / 8][4];
  wg_fence();
#pragma unroll
  for (int k = 0; k < D / 16; ++k) wg_scores(s, qa[k], wg_k_major(ktile, KEYS, k), k);
  wg_done();
  float shift[2];
  softmax_step(s, col0, cols, whole, seen, scale_log2, m, l, acc, shift);
  // Every k-step's P first, then the products: wgmma reads A registers that ordinary code wrote only after a fence.
  u32 pa[KEYS / 16][4];
#pragma unroll
  for (int kk = 0; kk < KEYS / 16; ++kk) probabilities(pa[kk], s, kk, scale_log2, shift, l);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < KEYS / 16; ++kk) wg_values(acc, pa[kk], wg_n_major(vtile, KEYS, kk), 1);
  wg_done();
}

// d (64 x 32) = a (this warp's 16 x 16) times 16 x 32 of a K-major tile, + d where `accumulate`: dQ's half tiles (its
// registers hold two 64 x 32 products and the 64 x D gradient at once).
__device__ __forceinline__ void wg_scores_half(float (&d)[4][4], const u32 (&a)[4], unsigned long long b,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

#endif


// What every kernel is told: `StaircaseArgs` (csrc/kernel_args.h, put in front of this source).

// Block `j`'s context range in row `b`, clamped to the context; with a window, from the first key its first query
// sees (its later queries start later: `sees`).
__device__ __forceinline__ int range_hi(const StaircaseArgs& a, int b, int j) {
  return min(a.hi[b * a.units * PER + j], a.context);
}
__device__ __forceinline__ int range_lo(const StaircaseArgs& a, int b, int j) {
  const int lo = a.lo[b * a.units * PER + j];
  return a.window > 0 ? max(lo, range_hi(a, b, j) - a.window + 1) : lo;
}

// What a warp masks its unit's 16 query rows with: the context range of the block of each of this thread's two rows
// (g and g + 8: the same block, or the unit's first and second of 8). The rest is derived, so that blocks of 16 hold
// two registers, as before there were blocks of 8.
struct Rows {
  int lo0, hi0, lo1, hi1;

  // The union of the unit's non-empty ranges (ranges ascend: the first's start, the last's end), empty where both are.
  __device__ __forceinline__ int first() const { return PER == 1 || hi0 > lo0 ? lo0 : lo1; }
  __device__ __forceinline__ int last() const { return PER == 1 || hi1 > lo1 ? hi1 : hi0; }
  // Whether the unit has a key in the context tile [base, base + KEYS).
  __device__ __forceinline__ bool reaches(int base) const {
    return last() > first() && first() < base + KEYS && last() > base;
  }
  // Whether every query row sees every key of that tile.
  __device__ __forceinline__ bool whole(int base, int window) const {
    return max(lo0, lo1) <= base && base + KEYS <= min(hi0, hi1) &&
           (window == 0 || base > max(hi0, hi1) + SLOTS - window);
  }
  // Whether the unit's query row `row` (0-15: g or g + 8) sees context key `key`.
  __device__ __forceinline__ bool sees_key(int key, int row, int window) const {
    const bool second = PER == 2 && row >= 8;
    return sees(false, key, 0, row & SLOTS, second ? lo1 : lo0, second ? hi1 : hi0, false, window);
  }
  // Whether query row `row` sees the unit's own key row `t` (both 0-15): only within one block.
  __device__ __forceinline__ bool sees_own(int t, int row, bool causal, int window) const {
    return t >> SHIFT == row >> SHIFT && sees(true, 0, t & SLOTS, row & SLOTS, 0, 0, causal, window);
  }
};

__device__ __forceinline__ Rows rows_of(const StaircaseArgs& a, int b, int unit) {
  const int first = unit * PER, lo0 = range_lo(a, b, first), hi0 = range_hi(a, b, first);
  if (PER == 1) return Rows{lo0, hi0, lo0, hi0};
  return Rows{lo0, hi0, range_lo(a, b, first + 1), range_hi(a, b, first + 1)};
}

// The union of unit `u`'s blocks' non-empty context ranges in row `b`: x >= y where none sees any context.
__device__ __forceinline__ int2 unit_span(const StaircaseArgs& a, int b, int u) {
  const Rows r = rows_of(a, b, u);
  return r.last() > r.first() ? make_int2(r.first(), r.last()) : make_int2(1 << 30, 0);
}

// Whether the training kernels run the warpgroup's products (WGMMA defined) rather than each warp's mma.sync.
#ifdef WGMMA
#define WG true
#else
#define WG false
#endif

// A tile's rows loaded in the layout its products read: mma.sync's padded rows, or (`GROUP`, under WGMMA) wgmma's
// core matrices.
template <bool GROUP, int TILE = KEYS>
__device__ __forceinline__ void load_rows(bf16* tile, const bf16* src, long long stride, int rows) {
#ifdef WGMMA
  if (GROUP) return load_tile_wg<TILE>(tile, src, stride, rows);
#endif
  load_tile<TILE>(tile, src, stride, rows);
}

// The thread block's loads (cp.async, waited for) visible to its threads and, for `GROUP`, to wgmma's reads.
template <bool GROUP>
__device__ __forceinline__ void rows_loaded() {
#ifdef WGMMA
  if (GROUP) wg_visible();
#endif
  __syncthreads();
}

// A query-major thread block (4 warps, a unit each) of head `h` in row `b`: walks the union of its units' context
// ranges, 64 keys a tile (double-buffered), then one tile of the units' own keys, and calls
// `visit(ktile, vtile, col0, cols, base, own)` for this warp on each tile its unit has keys in (`mine`): n-tiles
// [col0, col0 + cols) of the tile, column n's key index `base + n`, `own` for the tile of the units' own keys.
// `GROUP`: the warpgroup's products (the forward under WGMMA): the tiles in wgmma's layout, made visible to its
// reads, and every warp visits every tile (a warp whose unit has no key there with no n-tiles: `cols` 0).
template <bool GROUP = false, typename F>
__device__ __forceinline__ void walk_tiles(const StaircaseArgs& a, unsigned char* smem, int tile, int h, int b, const Rows& mine,
                                           F&& visit) {
  // Stage i: K at stage(i), V KEYS rows after it (pointers computed, not indexed: no local memory).
  bf16* const stages = (bf16*)smem;
  auto kt = [&](int i) { return stages + i * 2 * KEYS * ROW; };
  auto vt = [&](int i) { return stages + i * 2 * KEYS * ROW + KEYS * ROW; };
  const int kvh = h / (a.heads / a.kv_heads), warp = threadIdx.x >> 5;
  const bool active = tile * WARPS + warp < a.units;
  int first = 1 << 30, last = 0;
  for (int w = 0; w < WARPS; ++w) {
    const int u = tile * WARPS + w;
    const int2 span = u < a.units ? unit_span(a, b, u) : make_int2(0, 0);
    if (span.y > span.x) first = min(first, span.x), last = max(last, span.y);
  }
  const int tile_from = first >= last ? 0 : first / KEYS * KEYS;
  const int tile_count = first >= last ? 0 : (last - tile_from + KEYS - 1) / KEYS;
  const bf16* kc = a.k_ctx + b * a.c_b + kvh * a.c_h;
  const bf16* vc = a.v_ctx + b * a.cv_b + kvh * a.cv_h;
  if (tile_count > 0) {
    load_rows<GROUP>(kt(0), kc + (long long)tile_from * a.c_t, a.c_t, a.context - tile_from);
    load_rows<GROUP>(vt(0), vc + (long long)tile_from * a.cv_t, a.cv_t, a.context - tile_from);
  }
  copies_issued();
  for (int t = 0; t < tile_count; ++t) {
    const int base = tile_from + t * KEYS;
    if (t + 1 < tile_count) {
      const int next = base + KEYS;
      load_rows<GROUP>(kt((t + 1) & 1), kc + (long long)next * a.c_t, a.c_t, a.context - next);
      load_rows<GROUP>(vt((t + 1) & 1), vc + (long long)next * a.cv_t, a.cv_t, a.context - next);
    }
    copies_issued();
    copies_done<1>();
    rows_loaded<GROUP>();
    const bool reached = active && mine.reaches(base);
    if (GROUP || reached) visit(kt(t & 1), vt(t & 1), 0, reached ? KEYS / 8 : 0, base, false);
    __syncthreads();
  }
  // The units' own keys: warp w's 16 are rows 16w..16w+15 of one more tile.
  const int rows = min(WARPS, a.units - tile * WARPS) * 16;
  const long long own = tile * WARPS * 16;
  load_rows<GROUP>(kt(0), a.k_blk + b * a.k_b + kvh * a.k_h + own * a.k_t, a.k_t, rows);
  load_rows<GROUP>(vt(0), a.v_blk + b * a.bv_b + kvh * a.bv_h + own * a.bv_t, a.bv_t, rows);
  copies_issued();
  copies_done<0>();
  rows_loaded<GROUP>();
  if (GROUP || active) visit(kt(0), vt(0), 2 * warp, active ? 2 : 0, 0, true);
}

// The A fragments of k-step `k` of 16 rows of a shared-memory tile, from row `row0`.
__device__ __forceinline__ void a_frag(u32 (&frag)[4], const bf16* tile, int row0, int k) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4(frag, tile + (row0 + (lane & 15)) * ROW + k * 16 + (lane >> 4) * 8);
}

// The thread block's WARPS * 16 rows of `src` ([rows, D], row stride `stride`, `rows` of them real) into `tile`,
// waited for.
__device__ __forceinline__ void stage_rows(bf16* tile, const bf16* src, long long stride, int rows) {
  load_tile<WARPS * 16>(tile, src, stride, rows);
  copies_issued();
  copies_done<0>();
  __syncthreads();
}

// Writes a warp's 16 x D accumulator, times `scale`, as bf16 rows of D (row stride D).
__device__ __forceinline__ void store_rows(bf16* dst, const float (&acc)[D / 8][4], float scale, int rows) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (g + 8 * r < rows) {
        *(u32*)(dst + (g + 8 * r) * D + n * 8 + 2 * c) = pack_bf16(acc[n][2 * r] * scale, acc[n][2 * r + 1] * scale);
      }
    }
  }
}

// A warp's 16 output rows from row `row0` of o and lse: the accumulator over the row sums (this thread's partial sums
// reduced over its quad first), and the log-sum-exp in natural log.
__device__ __forceinline__ void store_forward(bf16* o, float* lse, long long row0, const float (&acc)[D / 8][4],
                                              const float (&m)[2], float (&l)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float inv = 1.f / l[r];
      *(u32*)(o + (row0 + g + 8 * r) * D + n * 8 + 2 * c) = pack_bf16(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
    }
  }
  if (c == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) lse[row0 + g + 8 * r] = (m[r] + log2f(l[r])) * LN2;
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) staircase_fwd(StaircaseArgs a, bf16* __restrict__ o,
                                                                  float* __restrict__ lse) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tile = (a.units + WARPS - 1) / WARPS - 1 - blockIdx.x;  // the longest ranges first: a shorter tail
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5;
  const int unit = tile * WARPS + warp;
  const bool active = unit < a.units;
  u32 qa[D / 16][4];
  {
    bf16* staging = (bf16*)smem + 2 * KEYS * ROW;  // stage 1's keys, not used before the walk's second tile
    const int rows = min(WARPS, a.units - tile * WARPS) * 16;
    stage_rows(staging, a.q + b * a.q_b + h * a.q_h + (long long)(tile * WARPS * 16) * a.q_t, a.q_t, rows);
#pragma unroll
    for (int k = 0; k < D / 16; ++k) a_frag(qa[k], staging, 16 * warp, k);
    __syncthreads();
  }
  const Rows mask = rows_of(a, b, active ? unit : 0);
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  float acc[D / 8][4];
  zero(acc);
  const float scale_log2 = a.scale * LOG2E;
  walk_tiles<WG>(a, smem, tile, h, b, mask,
                 [&](const bf16* kt, const bf16* vt, int col0, int cols, int base, bool own) {
    // Column n is key `base + n`, or the unit's own key row n - 8 col0.
    const bool whole = !own && col0 == 0 && cols == KEYS / 8 && mask.whole(base, a.window);
    auto seen = [&](int col, int row) {
      return own ? mask.sees_own(col - col0 * 8, row, a.causal_block, a.window)
                 : mask.sees_key(base + col, row, a.window);
    };
#ifdef WGMMA
    attend_wg(qa, kt, vt, col0, cols, whole, seen, scale_log2, m, l, acc);
#else
    attend(qa, kt, vt, col0, cols, whole, seen, scale_log2, m, l, acc);
#endif
  });
  if (active) store_forward(o, lse, (long long)(b * a.heads + h) * a.units * 16 + unit * 16, acc, m, l);
}

#ifdef WGMMA
// The forward on Hopper, warp-specialized (issue 65, item 3; FlashAttention-3's structure on this kernel's pattern):
// a thread block of three warpgroups takes WS_UNITS units (128 query rows) of one head. Warpgroup 0 is the producer:
// it copies (cp.async, 16 bytes a thread a copy) the queries, the units' own keys and values, and then the union of the
// units' context ranges, 64 keys a tile, into a ring of WS_STAGES stages, each copy's completion signalled on an
// mbarrier (`cp.async.mbarrier.arrive.noinc`: no thread waits for its own copies), and each stage reused once both
// consumers have signalled it free. Warpgroups 1 and 2 are the consumers, 64 query rows (four units, a warp's mask
// each) apiece, every product a warpgroup's wgmma: S = Q K^T with both operands in shared memory, O += P V with P from
// registers. A consumer overlaps a tile's values product with the next tile's scores: it issues S(t+1) and then
// O += P(t) V(t), waits for the scores alone (groups complete in order), computes the softmax statistics and P(t+1)
// into a second set of registers while O += P(t) V(t) runs, then waits for it, frees the stage and rescales O. The
// units' own keys are the last tile, from a region of their own (not the ring), so the ring holds context alone.
// Registers: the producer gives its share back (setmaxnreg 40) and the consumers take it (232): a consumer holds O
// (D/2 a thread), S (32), two sets of P (16 each), the statistics; Q stays in shared memory. Shared memory (D = 128):
// the ring 2 x 32 KB, the queries 32 KB, the own keys and values 64 KB: 160 KB, one thread block a multiprocessor.
#define WS_CONSUMERS 2
#define WS_UNITS (WS_CONSUMERS * 4)
#define WS_THREADS ((WS_CONSUMERS + 1) * 128)
#define WS_STAGES 2

typedef unsigned long long u64;

__device__ __forceinline__ void mbar_init(u64* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// An arrival on `bar` once this thread's earlier cp.async copies have landed (counted in the barrier's expected count).
__device__ __forceinline__ void mbar_arrive_on_copies(u64* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Waits until phase `parity` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(u64* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// d (64 x KEYS) = a (64 x 16, a K-major tile in shared memory) times 16 x KEYS of another, + d where `accumulate`.
__device__ __forceinline__ void wg_scores_ss(float (&d)[KEYS / 8][4], unsigned long long a, unsigned long long b,
                                             int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      WG_REGS32 "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : WG_ACC32(d)
      : "l"(a), "l"(b), "r"(accumulate));
}

// The shared memory of the warp-specialized kernels, in bf16 elements from its start: the ring's stages (K, then V,
// KEYS rows each), the consumers' query tiles (64 rows each), their own keys and values (64 rows each), for dQ their
// output gradients' tiles (64 rows each); the barriers after.
#define WS_TILE (KEYS * D)
#define WS_RING_K(i) ((i) * 2 * WS_TILE)
#define WS_RING_V(i) ((i) * 2 * WS_TILE + WS_TILE)
#define WS_Q(c) (WS_STAGES * 2 * WS_TILE + (c) * 64 * D)
#define WS_OWN_K(c) (WS_Q(WS_CONSUMERS) + (c) * 2 * 64 * D)
#define WS_OWN_V(c) (WS_OWN_K(c) + 64 * D)
#define WS_DO(c) (WS_OWN_K(WS_CONSUMERS) + (c) * 64 * D)

// What the three warpgroups of a warp-specialized kernel share: the barriers (full[i]: stage i's copies landed, the
// producer's 128 threads arriving; empty[i]: stage i read, the consumers' 8 warps; ready: the query-side tiles
// landed) and the walk: the union of the thread block's units' context ranges in tiles of KEYS from a multiple of
// KEYS (tile t < count is context from key `from + t * KEYS`, tile `count` the units' own keys).
struct WsWalk {
  u64 *full, *empty, *ready;
  int tile, from, count, rows;  // rows: the thread block's real query rows
};

// Traps (a launch failure naming no wrong result) where the launch gave less shared memory than the layout ending at
// element `barriers` with 2 * stages + 1 barriers after it needs: the host's size and the kernel's layout disagree.
__device__ __forceinline__ void ws_check_shared(int barriers, int stages) {
  u32 size;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(size));
  if (size < barriers * 2 + (2 * stages + 1) * 8) __trap();
}

// Sets the barriers up (in shared memory after `tiles + barriers`) and computes the walk; every thread calls it.
__device__ __forceinline__ WsWalk ws_begin(const StaircaseArgs& a, bf16* tiles, int barriers, int b) {
  ws_check_shared(barriers, WS_STAGES);
  WsWalk w;
  w.full = (u64*)(tiles + barriers);
  w.empty = w.full + WS_STAGES;
  w.ready = w.empty + WS_STAGES;
  w.tile = (a.units + WS_UNITS - 1) / WS_UNITS - 1 - blockIdx.x;  // the longest ranges first
  if (threadIdx.x == 0) {
    for (int i = 0; i < WS_STAGES; ++i) mbar_init(w.full + i, 128), mbar_init(w.empty + i, WS_CONSUMERS * 4);
    mbar_init(w.ready, 128);
  }
  __syncthreads();
  int first = 1 << 30, last = 0;
  for (int i = 0; i < WS_UNITS; ++i) {
    const int u = w.tile * WS_UNITS + i;
    const int2 span = u < a.units ? unit_span(a, b, u) : make_int2(0, 0);
    if (span.y > span.x) first = min(first, span.x), last = max(last, span.y);
  }
  w.from = first >= last ? 0 : first / KEYS * KEYS;
  w.count = first >= last ? 0 : (last - w.from + KEYS - 1) / KEYS;
  w.rows = min(WS_UNITS, a.units - w.tile * WS_UNITS) * 16;
  return w;
}

// The producer warpgroup's part (its 128 threads): the query-side tiles (Q, the own keys and values, and dO where
// `dout`, contiguous [B, H, Q, D], is given) signalled on `ready`, then the context tiles through the ring.
__device__ __forceinline__ void ws_produce(const StaircaseArgs& a, const WsWalk& w, bf16* tiles, int h, int b,
                                           const bf16* dout) {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
  const int by = threadIdx.x, kvh = h / (a.heads / a.kv_heads);
  const long long q0 = (long long)w.tile * WS_UNITS * 16;
  for (int c = 0; c < WS_CONSUMERS; ++c) {
    // Rows past the real ones are zeros (a consumer with none reads only zeros), from no address past the tensors.
    const int real = max(0, min(64, w.rows - 64 * c));
    const long long r0 = real > 0 ? q0 + 64 * c : 0;
    load_tile_wg<64, 128>(tiles + WS_Q(c), a.q + b * a.q_b + h * a.q_h + r0 * a.q_t, a.q_t, real, by);
    load_tile_wg<64, 128>(tiles + WS_OWN_K(c), a.k_blk + b * a.k_b + kvh * a.k_h + r0 * a.k_t, a.k_t, real, by);
    load_tile_wg<64, 128>(tiles + WS_OWN_V(c), a.v_blk + b * a.bv_b + kvh * a.bv_h + r0 * a.bv_t, a.bv_t, real, by);
    if (dout) {
      const long long row0 = (long long)(b * a.heads + h) * a.units * 16 + r0;
      load_tile_wg<64, 128>(tiles + WS_DO(c), dout + row0 * D, D, real, by);
    }
  }
  mbar_arrive_on_copies(w.ready);
  const bf16* kc = a.k_ctx + b * a.c_b + kvh * a.c_h;
  const bf16* vc = a.v_ctx + b * a.cv_b + kvh * a.cv_h;
  for (int t = 0; t < w.count; ++t) {
    const int stage = t % WS_STAGES, round = t / WS_STAGES, base = w.from + t * KEYS;
    if (round > 0) mbar_wait(w.empty + stage, (round - 1) & 1);
    load_tile_wg<KEYS, 128>(tiles + WS_RING_K(stage), kc + (long long)base * a.c_t, a.c_t, a.context - base, by);
    load_tile_wg<KEYS, 128>(tiles + WS_RING_V(stage), vc + (long long)base * a.cv_t, a.cv_t, a.context - base, by);
    mbar_arrive_on_copies(w.full + stage);
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // none of its copies outlives the thread
}

// A consumer's wait for tile t (the ring's stage, or nothing for the own keys, which came with `ready`), then the
// producer's copies (the generic proxy's writes) made visible to wgmma's reads.
__device__ __forceinline__ void ws_arrived(const WsWalk& w, int t) {
  if (t < w.count) mbar_wait(w.full + t % WS_STAGES, (t / WS_STAGES) & 1);
  wg_visible();
}

// A consumer warp's release of ring tile t once the products reading it are done.
__device__ __forceinline__ void ws_release(const WsWalk& w, int t) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(w.empty + t % WS_STAGES);
}

// Tile t's keys and values in shared memory for consumer `c`.
__device__ __forceinline__ const bf16* ws_keys(const WsWalk& w, const bf16* tiles, int t, int c) {
  return tiles + (t < w.count ? WS_RING_K(t % WS_STAGES) : WS_OWN_K(c));
}
__device__ __forceinline__ const bf16* ws_values(const WsWalk& w, const bf16* tiles, int t, int c) {
  return tiles + (t < w.count ? WS_RING_V(t % WS_STAGES) : WS_OWN_V(c));
}

// How consumer warp `warp` (its unit's `mask`; none where not `active`) masks tile t of the walk: its n-tiles
// [col0, col0 + cols) (none where its unit has no key there), column n's key `base + n` (for the own keys' tile, the
// unit's own key row n - 8 col0), and whether every row sees every column.
struct WsTile {
  bool own, whole;
  int base, col0, cols;
};
__device__ __forceinline__ WsTile ws_tile(const WsWalk& w, int t, const Rows& mask, bool active, int warp, int window) {
  WsTile x;
  x.own = t == w.count;
  x.base = w.from + t * KEYS;
  const bool reached = active && (x.own || mask.reaches(x.base));
  x.col0 = x.own ? 2 * warp : 0;
  x.cols = reached ? (x.own ? 2 : KEYS / 8) : 0;
  x.whole = !x.own && reached && mask.whole(x.base, window);
  return x;
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) staircase_fwd_ws(StaircaseArgs a, bf16* __restrict__ o,
                                                                          float* __restrict__ lse) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* const tiles = (bf16*)smem;
  const int h = blockIdx.y, b = blockIdx.z, role = threadIdx.x >> 7;  // role 0 the producer, 1.. the consumers
  const WsWalk w = ws_begin(a, tiles, WS_OWN_K(WS_CONSUMERS), b);
  if (role == 0) return ws_produce(a, w, tiles, h, b, nullptr);
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int consumer = role - 1, warp = (threadIdx.x >> 5) & 3;
  const int unit = w.tile * WS_UNITS + consumer * 4 + warp;
  const bool active = unit < a.units;
  const Rows mask = rows_of(a, b, active ? unit : 0);
  const bf16* const qt = tiles + WS_Q(consumer);
  const float scale_log2 = a.scale * LOG2E;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, alpha[2], shift[2];
  float acc[D / 8][4], s[KEYS / 8][4];
  u32 pa[KEYS / 16][4];
  zero(acc);
  // S = Q K^T of tile t, issued (committed, not waited for).
  auto scores = [&](int t) {
    const bf16* kt = ws_keys(w, tiles, t, consumer);
#pragma unroll
    for (int k = 0; k < D / 16; ++k) wg_scores_ss(s, wg_k_major(qt, 64, k), wg_k_major(kt, KEYS, k), k);
    wg_commit();
  };
  // Tile t's statistics (`alpha`: the output's factor, applied once its values product is done) and its
  // probabilities, in place of its scores in `s` (f32; made P's bf16 registers only once the values product that
  // reads them is done).
  auto softmax = [&](int t) {
    const WsTile x = ws_tile(w, t, mask, active, warp, a.window);
    auto seen = [&](int col, int row) {
      return x.own ? mask.sees_own(col - x.col0 * 8, row, a.causal_block, a.window)
                   : mask.sees_key(x.base + col, row, a.window);
    };
    softmax_stats(s, x.col0, x.cols, x.whole, seen, scale_log2, m, l, alpha, shift);
    exponentiate(s, scale_log2, shift, l);
  };
  auto to_p = [&]() {
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) c_as_a(pa[kk], s[2 * kk], s[2 * kk + 1]);
  };
  // O += P(t) V(t), issued.
  auto values = [&](int t) {
    const bf16* vt = ws_values(w, tiles, t, consumer);
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) wg_values(acc, pa[kk], wg_n_major(vt, KEYS, kk), 1);
    wg_commit();
  };
  mbar_wait(w.ready, 0);
  ws_arrived(w, 0);
  wg_fence();
  scores(0);
  wg_wait<0>();
  softmax(0);
  to_p();
  // Each context tile's values product runs beside the next tile's scores and their softmax (no branch between the
  // products, and no register they use written while they run: ptxas then keeps them in flight together); the
  // own keys' tile ends the walk.
  for (int t = 0; t < w.count; ++t) {
    ws_arrived(w, t + 1);
    wg_fence();
    scores(t + 1);
    values(t);
    wg_wait<1>();
    softmax(t + 1);
    wg_wait<0>();
    ws_release(w, t);
    rescale(acc, alpha);
    to_p();
  }
  wg_fence();
  values(w.count);
  wg_wait<0>();
  if (active) store_forward(o, lse, (long long)(b * a.heads + h) * a.units * 16 + unit * 16, acc, m, l);
}
#endif

// dS = P (dP - drow) of k-step `kk` of a half tile (n-tiles n0..n0 + 3; P recomputed from the log-sum-exp, `lse2`
// in base 2, zero where the row does not see the key) as bf16 A fragments for dQ += dS K.
__device__ __forceinline__ void dscores(u32 (&dsa)[4], const float (&s)[4][4], const float (&dp)[4][4], int kk, int n0,
                                       int col0, int cols, int base, bool whole, const Rows& mask, bool own,
                                       bool causal, int window, float scale_log2, const float (&lse2)[2],
                                       const float (&drow)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  float v[2][4];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    int n = 2 * kk + hh;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = ex2(fmaf(s[n][e], scale_log2, -lse2[e >> 1]));
      if (!whole) {
        int col = (n0 + n) * 8 + 2 * c + (e & 1), row = g + (e >> 1) * 8, key = base + col;
        bool seen = n0 + n >= col0 && n0 + n < col0 + cols &&
                    (own ? mask.sees_own(col - col0 * 8, row, causal, window) : mask.sees_key(key, row, window));
        if (!seen) p = 0.f;
      }
      v[hh][e] = p * (dp[n][e] - drow[e >> 1]);
    }
  }
  c_as_a(dsa, v[0], v[1]);
}

// A warp's part of dQ on one tile: P recomputed from the log-sum-exp (`lse2`, base 2), dP = dO V^T,
// dS = P (dP - drow), dQ += dS K; 32 keys at a time (4 n-tiles), the ones in [col0, col0 + cols).
__device__ __forceinline__ void dq_tile(const bf16* qs, const bf16* ds, int row0, const bf16* ktile,
                                       const bf16* vtile, int col0, int cols, int base, const Rows& mask, bool own,
                                       bool causal, int window, float scale_log2, const float (&lse2)[2],
                                       const float (&drow)[2], float (&dq)[D / 8][4]) {
  const bool whole = !own && col0 == 0 && cols == KEYS / 8 && mask.whole(base, window);
#pragma unroll
  for (int half = 0; half < KEYS / 32; ++half) {
    const int n0 = half * 4;
    if (n0 + 4 <= col0 || n0 >= col0 + cols) continue;
    float s[4][4], dp[4][4];
    zero(s);
    zero(dp);
#pragma unroll
    for (int n = 0; n < 4; n += 2) {
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        u32 qa[4], da[4];
        a_frag(qa, qs, row0, k);
        a_frag(da, ds, row0, k);
        mma_cols(s[n], s[n + 1], qa, ktile, (n0 + n) * 8, k);
        mma_cols(dp[n], dp[n + 1], da, vtile, (n0 + n) * 8, k);
      }
    }
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      if (n0 + 2 * kk + 1 < col0 || n0 + 2 * kk >= col0 + cols) continue;
      u32 dsa[4];
      dscores(dsa, s, dp, kk, n0, col0, cols, base, whole, mask, own, causal, window, scale_log2, lse2, drow);
      mma_rows(dq, dsa, ktile, (n0 + 2 * kk) * 8);  // dQ += dS K
    }
  }
}

#ifdef WGMMA
// `dq_tile` on the warpgroup's products: 32 keys at a time, S = Q K^T and dP = dO V^T from the tiles as K-major
// operands, dQ += dS K with the key tile as the N-major one (its layout serves both). Every warp takes part.
__device__ __forceinline__ void dq_tile_wg(const bf16* qs, const bf16* ds, int row0, const bf16* ktile,
                                          const bf16* vtile, int col0, int cols, int base, const Rows& mask, bool own,
                                          bool causal, int window, float scale_log2, const float (&lse2)[2],
                                          const float (&drow)[2], float (&dq)[D / 8][4]) {
  const bool whole = !own && col0 == 0 && cols == KEYS / 8 && mask.whole(base, window);
  // Every A fragment before the products: wgmma reads its A registers while it runs, so none may be reloaded
  // until it is done (ptxas would otherwise wait for each product: C7517).
  u32 qa[D / 16][4], da[D / 16][4];
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    a_frag(qa[k], qs, row0, k);
    a_frag(da[k], ds, row0, k);
  }
#pragma unroll
  for (int half = 0; half < KEYS / 32; ++half) {
    const int n0 = half * 4;
    float s[4][4], dp[4][4];  // written by their first products (accumulate 0)
    wg_fence();
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      wg_scores_half(s, qa[k], wg_k_major(ktile, KEYS, k, n0 * 8), k);
      wg_scores_half(dp, da[k], wg_k_major(vtile, KEYS, k, n0 * 8), k);
    }
    wg_done();
    u32 dsa[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
      dscores(dsa[kk], s, dp, kk, n0, col0, cols, base, whole, mask, own, causal, window, scale_log2, lse2, drow);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) wg_values(dq, dsa[kk], wg_n_major(ktile, KEYS, 2 * half + kk), 1);
    wg_done();
  }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS) staircase_dq(StaircaseArgs a, const bf16* __restrict__ dout,
                                                                 const float* __restrict__ lse,
                                                                 const float* __restrict__ drow,
                                                                 bf16* __restrict__ dq) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tile = (a.units + WARPS - 1) / WARPS - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int unit = tile * WARPS + warp;
  const bool active = unit < a.units;
  const Rows mask = rows_of(a, b, active ? unit : 0);
  const long long row0 = (long long)(b * a.heads + h) * a.units * 16 + unit * 16;
  // Q and dO stay in shared memory after the walk's two stages.
  bf16* qs = (bf16*)smem + 4 * KEYS * ROW;
  bf16* ds = qs + WARPS * 16 * ROW;
  {
    const int rows = min(WARPS, a.units - tile * WARPS) * 16;
    const long long first = (long long)(b * a.heads + h) * a.units * 16 + tile * WARPS * 16;
    load_tile<WARPS * 16>(ds, dout + first * D, D, rows);
    stage_rows(qs, a.q + b * a.q_b + h * a.q_h + (long long)(tile * WARPS * 16) * a.q_t, a.q_t, rows);
  }
  float lse2[2], dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse2[r] = active ? lse[row0 + g + 8 * r] * LOG2E : 0.f;
    dr[r] = active ? drow[row0 + g + 8 * r] : 0.f;
  }
  float acc[D / 8][4];
  zero(acc);
  const float scale_log2 = a.scale * LOG2E;
#ifdef WGMMA
  walk_tiles<WG>(a, smem, tile, h, b, mask,
                 [&](const bf16* kt, const bf16* vt, int col0, int cols, int base, bool own) {
    dq_tile_wg(qs, ds, 16 * warp, kt, vt, col0, cols, base, mask, own, a.causal_block, a.window, scale_log2, lse2, dr,
               acc);
  });
#else
  walk_tiles(a, smem, tile, h, b, mask, [&](const bf16* kt, const bf16* vt, int col0, int cols, int base, bool own) {
    dq_tile(qs, ds, 16 * warp, kt, vt, col0, cols, base, mask, own, a.causal_block, a.window, scale_log2, lse2, dr,
            acc);
  });
#endif
  if (active) store_rows(dq + row0 * D, acc, a.scale, 16);
}

#ifdef WGMMA
// dQ on Hopper, warp-specialized as the forward is (`staircase_fwd_ws`: the same producer, ring and walk; dO's tiles
// come with the queries'): a consumer issues the next tile's S = Q K^T and dP = dO V^T (both operands in shared
// memory) beside this tile's dQ += dS K, then frees the stage once dQ's product is done and computes the next dS
// (P recomputed from the log-sum-exp). Registers: dQ (D/2 a thread), S and dP (32 each), dS (16). Shared memory
// (D = 128): the forward's 160 KB and dO's 32 KB.
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) staircase_dq_ws(StaircaseArgs a,
                                                                         const bf16* __restrict__ dout,
                                                                         const float* __restrict__ lse,
                                                                         const float* __restrict__ drow,
                                                                         bf16* __restrict__ dq) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* const tiles = (bf16*)smem;
  const int h = blockIdx.y, b = blockIdx.z, role = threadIdx.x >> 7;  // role 0 the producer, 1.. the consumers
  const WsWalk w = ws_begin(a, tiles, WS_DO(WS_CONSUMERS), b);
  if (role == 0) return ws_produce(a, w, tiles, h, b, dout);
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int consumer = role - 1, warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2;
  const int unit = w.tile * WS_UNITS + consumer * 4 + warp;
  const bool active = unit < a.units;
  const Rows mask = rows_of(a, b, active ? unit : 0);
  const long long row0 = (long long)(b * a.heads + h) * a.units * 16 + unit * 16;
  float lse2[2], dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse2[r] = active ? lse[row0 + g + 8 * r] * LOG2E : 0.f;
    dr[r] = active ? drow[row0 + g + 8 * r] : 0.f;
  }
  const bf16 *const qt = tiles + WS_Q(consumer), *const dt = tiles + WS_DO(consumer);
  const float scale_log2 = a.scale * LOG2E;
  float acc[D / 8][4], s[KEYS / 8][4], dp[KEYS / 8][4];
  u32 dsa[KEYS / 16][4];
  zero(acc);
  // S and dP of tile t, issued.
  auto products = [&](int t) {
    const bf16 *kt = ws_keys(w, tiles, t, consumer), *vt = ws_values(w, tiles, t, consumer);
#pragma unroll
    for (int k = 0; k < D / 16; ++k) wg_scores_ss(s, wg_k_major(qt, 64, k), wg_k_major(kt, KEYS, k), k);
#pragma unroll
    for (int k = 0; k < D / 16; ++k) wg_scores_ss(dp, wg_k_major(dt, 64, k), wg_k_major(vt, KEYS, k), k);
    wg_commit();
  };
  // dS of tile t from its S and dP, as bf16 A fragments.
  auto gradient = [&](int t) {
    const WsTile x = ws_tile(w, t, mask, active, warp, a.window);
#pragma unroll
    for (int half = 0; half < KEYS / 32; ++half) {
      const auto& sh = *reinterpret_cast<const float(*)[4][4]>(&s[4 * half]);
      const auto& dph = *reinterpret_cast<const float(*)[4][4]>(&dp[4 * half]);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
        dscores(dsa[2 * half + kk], sh, dph, kk, 4 * half, x.col0, x.cols, x.base, x.whole, mask, x.own,
                a.causal_block, a.window, scale_log2, lse2, dr);
    }
  };
  // dQ += dS K of tile t (its keys as the N-major operand), issued.
  auto accumulate = [&](int t) {
    const bf16* kt = ws_keys(w, tiles, t, consumer);
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) wg_values(acc, dsa[kk], wg_n_major(kt, KEYS, kk), 1);
    wg_commit();
  };
  mbar_wait(w.ready, 0);
  ws_arrived(w, 0);
  wg_fence();
  products(0);
  wg_wait<0>();
  gradient(0);
  for (int t = 0; t < w.count; ++t) {
    ws_arrived(w, t + 1);
    wg_fence();
    accumulate(t);
    products(t + 1);
    wg_wait<1>();  // dQ's product of tile t done: every product that reads its stage
    ws_release(w, t);
    wg_wait<0>();
    gradient(t + 1);
  }
  wg_fence();
  accumulate(w.count);
  wg_wait<0>();
  if (active) store_rows(dq + row0 * D, acc, a.scale, 16);
}
#endif

#define QROWS 32  // queries a step of the key-major kernel: two units

// P^T and dS^T of a warp's 16 keys (from key `key0`: its rows g and g + 8) against a step's 32 queries (units j and
// j + 1: the columns), in place of S^T and dP^T: P recomputed from the log-sum-exp (`lse_s`, natural log, and
// `drow_s`, a float per column), masked only where one of the step's query blocks does not see all 16 keys, and
// zero everywhere where the warp's keys do not meet the step (`meets` false). `ctx`: context keys; else the block
// keys of unit `key_unit`.
__device__ __forceinline__ void dkv_scores(float (&st)[4][4], float (&dpt)[4][4], const StaircaseArgs& a, int b, int j,
                                           int key0, bool ctx, int key_unit, bool meets, const float* lse_s,
                                           const float* drow_s, float scale_log2) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  // The step's blocks' ranges: its columns' blocks are i = col >> SHIFT, of blocks j * PER + i.
  int qlo[2 * PER], qhi[2 * PER];
#pragma unroll
  for (int i = 0; i < 2 * PER; ++i) {
    const bool valid = j * PER + i < a.units * PER;
    qlo[i] = valid ? range_lo(a, b, j * PER + i) : 0;
    qhi[i] = valid ? range_hi(a, b, j * PER + i) : 0;
  }
  bool whole = ctx && j + 1 < a.units;
#pragma unroll
  for (int i = 0; i < 2 * PER; ++i) {
    whole = whole && qlo[i] <= key0 && qhi[i] >= key0 + 16 && (a.window == 0 || key0 > qhi[i] + SLOTS - a.window);
  }
#pragma unroll
  for (int n = 0; n < 4; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int col = n * 8 + 2 * c + (e & 1), row = g + (e >> 1) * 8;
      float p = ex2(fmaf(st[n][e], scale_log2, -lse_s[col] * LOG2E));
      if (!whole) {
        // The column's block of the step, col >> SHIFT: n, or n / 2 for blocks of 16 (a constant index, so the
        // ranges stay in registers).
        const int qi = PER == 2 ? n : n >> 1;
        bool seen;
        if (ctx) {
          seen = j * PER + qi < a.units * PER &&
                 sees(false, key0 + row, 0, col & SLOTS, qlo[qi], qhi[qi], a.causal_block, a.window);
        } else {
          seen = j + (col >> 4) == key_unit && row >> SHIFT == (col & 15) >> SHIFT &&
                 sees(true, 0, row & SLOTS, col & SLOTS, 0, 0, a.causal_block, a.window);
        }
        if (!seen) p = 0.f;
      }
      if (!meets) p = 0.f;
      st[n][e] = p;
      dpt[n][e] = p * (dpt[n][e] - drow_s[col]);
    }
  }
}



// The query units that see a key of [k0, k0 + keys), as [x, y), x even (steps of two units): for context keys, those
// with a block whose range reaches into it (ranges ascend along the row, so that is one run of blocks); for block
// keys, the keys' own units.
__device__ __forceinline__ int2 dkv_query_units(const StaircaseArgs& a, int b, bool ctx, int k0, int keys) {
  int j_begin, j_end;
  if (ctx) {
    const int blocks = a.units * PER;
    int lo_ = 0, hi_ = blocks;
    while (lo_ < hi_) {  // the first block whose range ends past k0
      int mid = (lo_ + hi_) / 2;
      if (range_hi(a, b, mid) > k0) hi_ = mid; else lo_ = mid + 1;
    }
    const int first = lo_;
    lo_ = first, hi_ = blocks;
    while (lo_ < hi_) {  // the first block whose range starts past the keys
      int mid = (lo_ + hi_) / 2;
      if (range_lo(a, b, mid) >= k0 + keys) hi_ = mid; else lo_ = mid + 1;
    }
    j_begin = first / PER;
    j_end = (lo_ + PER - 1) / PER;
  } else {
    j_begin = k0 / 16;
    j_end = min(a.units, j_begin + keys / 16);
  }
  return make_int2(j_begin / 2 * 2, j_end);
}

extern "C" __global__ void __launch_bounds__(THREADS) staircase_dkv(StaircaseArgs a, const bf16* __restrict__ dout,
                                                                  const float* __restrict__ lse,
                                                                  const float* __restrict__ drow,
                                                                  bf16* __restrict__ dk_ctx, bf16* __restrict__ dv_ctx,
                                                                  bf16* __restrict__ dk_blk, bf16* __restrict__ dv_blk) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* kt = (bf16*)smem;
  bf16* vt = kt + KEYS * ROW;
  // Two stages of query rows (Q, then dO QROWS rows after) and of their log-sum-exp and drow (QROWS floats each).
  bf16* const qbuf = vt + KEYS * ROW;
  float* const fbuf = (float*)(qbuf + 4 * QROWS * ROW);
  auto stage_q = [&](int i) { return qbuf + i * 2 * QROWS * ROW; };
  auto stage_f = [&](int i) { return fbuf + i * 2 * QROWS; };
  const int ctx_tiles = (a.context + KEYS - 1) / KEYS;
  const int kvh = blockIdx.y, b = blockIdx.z, group = a.heads / a.kv_heads;
  const bool ctx = (int)blockIdx.x < ctx_tiles;
  const int k0 = ctx ? blockIdx.x * KEYS : (blockIdx.x - ctx_tiles) * KEYS;
  const int rows = ctx ? min(KEYS, a.context - k0) : min(KEYS, a.units * 16 - k0);
  const int warp = threadIdx.x >> 5;
  const int wk = 16 * warp;  // this warp's first key row in the tile
  // Under WGMMA every tile is in wgmma's layout: the key and value tiles as the A operand of S^T and dP^T (shared
  // memory), the query and dO tiles as B (K-major there, N-major for dV and dK).
  {
    const bf16* kb = ctx ? a.k_ctx + b * a.c_b + kvh * a.c_h + (long long)k0 * a.c_t
                         : a.k_blk + b * a.k_b + kvh * a.k_h + (long long)k0 * a.k_t;
    const bf16* vb = ctx ? a.v_ctx + b * a.cv_b + kvh * a.cv_h + (long long)k0 * a.cv_t
                         : a.v_blk + b * a.bv_b + kvh * a.bv_h + (long long)k0 * a.bv_t;
    load_rows<WG>(kt, kb, ctx ? a.c_t : a.k_t, rows);
    load_rows<WG>(vt, vb, ctx ? a.cv_t : a.bv_t, rows);
    copies_issued();
  }
  const int2 span = dkv_query_units(a, b, ctx, k0, KEYS);
  const int j_begin = span.x, j_end = span.y;
  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);
  const float scale_log2 = a.scale * LOG2E;
  const int key_unit = k0 / 16 + warp;  // block keys: the unit this warp's keys are of
  // Steps of two query units, for each query head of the group; the next step's rows load while this one computes.
  const int chunks = max(0, (j_end - j_begin + 1) / 2), steps = group * chunks;
  auto issue = [&](int step, int i) {
    const int h = kvh * group + step / chunks, j = j_begin + 2 * (step % chunks);
    const long long row0 = (long long)(b * a.heads + h) * a.units * 16 + j * 16;
    const int qrows = min(QROWS, (a.units - j) * 16);
    load_rows<WG, QROWS>(stage_q(i), a.q + b * a.q_b + h * a.q_h + (long long)(j * 16) * a.q_t, a.q_t, qrows);
    load_rows<WG, QROWS>(stage_q(i) + QROWS * ROW, dout + row0 * D, D, qrows);
    if (threadIdx.x < QROWS / 2) {  // 16 copies of 4 floats: the log-sum-exp's 32, then drow's
      const int which = threadIdx.x / (QROWS / 4), part = threadIdx.x % (QROWS / 4);
      const bool valid = part * 4 < qrows;
      const float* src = (which ? drow : lse) + row0 + part * 4;
      copy16((bf16*)(stage_f(i) + which * QROWS + part * 4), (const bf16*)(valid ? src : lse), valid);
    }
  };
  if (steps > 0) issue(0, 0);
  copies_issued();
  for (int step = 0; step < steps; ++step) {
    if (step + 1 < steps) issue(step + 1, (step + 1) & 1);
    copies_issued();
    copies_done<1>();
    rows_loaded<WG>();
    const int j = j_begin + 2 * (step % chunks);
    const bf16* qt = stage_q(step & 1);
    const bf16* ot = qt + QROWS * ROW;
    const float* lse_s = stage_f(step & 1);
    const float* drow_s = lse_s + QROWS;
    // Whether this warp's 16 keys meet the step's queries; under WGMMA every warp runs the products (they are the
    // warpgroup's) and one that does not masks everything.
    const bool meets = wk < rows && (ctx || (key_unit >= j && key_unit < j + 2));
#ifdef WGMMA
    {
#else
    if (meets) {
#endif
      // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys against the 32 queries.
      float st[4][4], dpt[4][4];
#ifdef WGMMA
      wg_fence();
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        wg_scores_half_ss(st, wg_k_major(kt, KEYS, k), wg_k_major(qt, QROWS, k), k);
        wg_scores_half_ss(dpt, wg_k_major(vt, KEYS, k), wg_k_major(ot, QROWS, k), k);
      }
      wg_done();
#else
      zero(st);
      zero(dpt);
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        u32 ka[4], va[4];
        a_frag(ka, kt, wk, k);
        a_frag(va, vt, wk, k);
#pragma unroll
        for (int n = 0; n < 4; n += 2) {
          mma_cols(st[n], st[n + 1], ka, qt, n * 8, k);
          mma_cols(dpt[n], dpt[n + 1], va, ot, n * 8, k);
        }
      }
#endif
      // P^T and dS^T in place of S^T and dP^T.
      dkv_scores(st, dpt, a, b, j, k0 + wk, ctx, key_unit, meets || !WG, lse_s, drow_s, scale_log2);
      // dV += P^T dO and dK += dS^T Q.
#ifdef WGMMA
      u32 pa[2][4], sa[2][4];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        c_as_a(pa[kk], st[2 * kk], st[2 * kk + 1]);
        c_as_a(sa[kk], dpt[2 * kk], dpt[2 * kk + 1]);
      }
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        wg_values(dv, pa[kk], wg_n_major(ot, QROWS, kk), 1);
        wg_values(dk, sa[kk], wg_n_major(qt, QROWS, kk), 1);
      }
      wg_done();
#else
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        u32 pa[4], sa[4];
        c_as_a(pa, st[2 * kk], st[2 * kk + 1]);
        c_as_a(sa, dpt[2 * kk], dpt[2 * kk + 1]);
        mma_rows(dv, pa, ot, kk * 16);
        mma_rows(dk, sa, qt, kk * 16);
      }
#endif
    }
    __syncthreads();
  }
  if (wk >= rows) return;
  const long long out0 = ctx ? ((long long)(b * a.kv_heads + kvh) * a.context + k0 + wk) * D
                             : ((long long)(b * a.kv_heads + kvh) * a.units * 16 + k0 + wk) * D;
  const int mine = min(16, rows - wk);
  store_rows((ctx ? dk_ctx : dk_blk) + out0, dk, a.scale, mine);
  store_rows((ctx ? dv_ctx : dv_blk) + out0, dv, 1.f, mine);
}

#ifdef WGMMA
// dK and dV on Hopper, warp-specialized: a thread block takes 128 keys (context or block keys) of one K/V head, each
// consumer warpgroup 64 of them (its keys and values the A operands of S^T = K Q^T and dP^T = V dO^T, in shared
// memory for the whole walk); the producer copies each step's 32 query rows (Q, dO, their log-sum-exp and drow)
// through a ring of WS_DKV_STAGES stages, every query head of the group in turn, as `staircase_dkv` walks them. A
// consumer issues the next step's S^T and dP^T beside this step's dV += P^T dO and dK += dS^T Q, frees the stage once
// those are done, and computes the next P^T and dS^T (`dkv_scores`). Registers: dK and dV (D/2 each a thread), S^T
// and dP^T (16 each), P^T and dS^T as bf16 (8 each); the producer keeps 56 (a step's addresses: with 40 it spills),
// the consumers 224. Shared memory (D = 128): the keys and values 64 KB, the ring 3 x 16.25 KB.
#define WS_DKV_KEYS (WS_CONSUMERS * 64)
#define WS_DKV_STAGES 3
#define WS_DKV_K(c) ((c) * 2 * 64 * D)
#define WS_DKV_V(c) (WS_DKV_K(c) + 64 * D)
#define WS_DKV_STAGE (2 * QROWS * D + 2 * QROWS * 2)  // Q, dO, then 2 x QROWS floats (as bf16 elements)
#define WS_DKV_RING(i) (WS_DKV_K(WS_CONSUMERS) + (i) * WS_DKV_STAGE)
#define WS_DKV_BARRIERS WS_DKV_RING(WS_DKV_STAGES)

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) staircase_dkv_ws(
    StaircaseArgs a, const bf16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ drow,
    bf16* __restrict__ dk_ctx, bf16* __restrict__ dv_ctx, bf16* __restrict__ dk_blk, bf16* __restrict__ dv_blk) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* const tiles = (bf16*)smem;
  ws_check_shared(WS_DKV_BARRIERS, WS_DKV_STAGES);
  u64* const full = (u64*)(tiles + WS_DKV_BARRIERS);
  u64* const empty = full + WS_DKV_STAGES;
  u64* const ready = empty + WS_DKV_STAGES;
  const int ctx_tiles = (a.context + WS_DKV_KEYS - 1) / WS_DKV_KEYS;
  const int kvh = blockIdx.y, b = blockIdx.z, group = a.heads / a.kv_heads, role = threadIdx.x >> 7;
  const bool ctx = (int)blockIdx.x < ctx_tiles;
  const int k0 = ctx ? blockIdx.x * WS_DKV_KEYS : (blockIdx.x - ctx_tiles) * WS_DKV_KEYS;
  const int rows = ctx ? min(WS_DKV_KEYS, a.context - k0) : min(WS_DKV_KEYS, a.units * 16 - k0);  // real keys
  if (threadIdx.x == 0) {
    for (int i = 0; i < WS_DKV_STAGES; ++i) mbar_init(full + i, 128), mbar_init(empty + i, WS_CONSUMERS * 4);
    mbar_init(ready, 128);
  }
  __syncthreads();
  const int2 span = dkv_query_units(a, b, ctx, k0, WS_DKV_KEYS);
  const int chunks = max(0, (span.y - span.x + 1) / 2), steps = group * chunks;
  auto step_unit = [&](int step) { return span.x + 2 * (step % chunks); };
  auto step_head = [&](int step) { return kvh * group + step / chunks; };
  auto stage_of = [&](int step) { return tiles + WS_DKV_RING(step % WS_DKV_STAGES); };

  if (role == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
    const int by = threadIdx.x;
    for (int c = 0; c < WS_CONSUMERS; ++c) {
      // Keys past the real ones are zeros, from no address past the tensors.
      const int real = max(0, min(64, rows - 64 * c)), first = real > 0 ? k0 + 64 * c : 0;
      const bf16* kb = ctx ? a.k_ctx + b * a.c_b + kvh * a.c_h + (long long)first * a.c_t
                           : a.k_blk + b * a.k_b + kvh * a.k_h + (long long)first * a.k_t;
      const bf16* vb = ctx ? a.v_ctx + b * a.cv_b + kvh * a.cv_h + (long long)first * a.cv_t
                           : a.v_blk + b * a.bv_b + kvh * a.bv_h + (long long)first * a.bv_t;
      load_tile_wg<64, 128>(tiles + WS_DKV_K(c), kb, ctx ? a.c_t : a.k_t, real, by);
      load_tile_wg<64, 128>(tiles + WS_DKV_V(c), vb, ctx ? a.cv_t : a.bv_t, real, by);
    }
    mbar_arrive_on_copies(ready);
    for (int step = 0; step < steps; ++step) {
      const int slot = step % WS_DKV_STAGES, round = step / WS_DKV_STAGES, h = step_head(step), j = step_unit(step);
      if (round > 0) mbar_wait(empty + slot, (round - 1) & 1);
      const long long row0 = (long long)(b * a.heads + h) * a.units * 16 + j * 16;
      const int qrows = min(QROWS, (a.units - j) * 16);
      bf16* st = stage_of(step);
      load_tile_wg<QROWS, 128>(st, a.q + b * a.q_b + h * a.q_h + (long long)(j * 16) * a.q_t, a.q_t, qrows, by);
      load_tile_wg<QROWS, 128>(st + QROWS * D, dout + row0 * D, D, qrows, by);
      if (by < QROWS / 2) {  // 16 copies of 4 floats: the log-sum-exp's 32, then drow's
        const int which = by / (QROWS / 4), part = by % (QROWS / 4);
        const bool valid = part * 4 < qrows;
        const float* src = (which ? drow : lse) + row0 + part * 4;
        copy16(st + 2 * QROWS * D + (which * QROWS + part * 4) * 2, (const bf16*)(valid ? src : lse), valid);
      }
      mbar_arrive_on_copies(full + slot);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // none of its copies outlives the thread
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");
  const int consumer = role - 1, warp = (threadIdx.x >> 5) & 3;
  const int wk = 64 * consumer + 16 * warp;  // this warp's first key row of the thread block's
  const int key_unit = k0 / 16 + 4 * consumer + warp;  // block keys: the unit this warp's keys are of
  const bf16 *const kt = tiles + WS_DKV_K(consumer), *const vt = tiles + WS_DKV_V(consumer);
  const float scale_log2 = a.scale * LOG2E;
  float dk[D / 8][4], dv[D / 8][4], st[4][4], dpt[4][4];
  u32 pa[2][4], sa[2][4];
  zero(dk);
  zero(dv);
  auto arrived = [&](int step) {
    mbar_wait(full + step % WS_DKV_STAGES, (step / WS_DKV_STAGES) & 1);
    wg_visible();
  };
  // S^T and dP^T of a step, issued.
  auto scores = [&](int step) {
    const bf16 *qt = stage_of(step), *ot = qt + QROWS * D;
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      wg_scores_half_ss(st, wg_k_major(kt, 64, k), wg_k_major(qt, QROWS, k), k);
      wg_scores_half_ss(dpt, wg_k_major(vt, 64, k), wg_k_major(ot, QROWS, k), k);
    }
    wg_commit();
  };
  // P^T and dS^T of a step, as bf16 A fragments.
  auto gradients = [&](int step) {
    const int j = step_unit(step);
    const bool meets = wk < rows && (ctx || (key_unit >= j && key_unit < j + 2));
    const float* f = (const float*)(stage_of(step) + 2 * QROWS * D);
    dkv_scores(st, dpt, a, b, j, k0 + wk, ctx, key_unit, meets, f, f + QROWS, scale_log2);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      c_as_a(pa[kk], st[2 * kk], st[2 * kk + 1]);
      c_as_a(sa[kk], dpt[2 * kk], dpt[2 * kk + 1]);
    }
  };
  // dV += P^T dO and dK += dS^T Q of a step, issued.
  auto accumulate = [&](int step) {
    const bf16 *qt = stage_of(step), *ot = qt + QROWS * D;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      wg_values(dv, pa[kk], wg_n_major(ot, QROWS, kk), 1);
      wg_values(dk, sa[kk], wg_n_major(qt, QROWS, kk), 1);
    }
    wg_commit();
  };
  auto release = [&](int step) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(empty + step % WS_DKV_STAGES);
  };
  mbar_wait(ready, 0);
  wg_visible();
  if (steps > 0) {
    arrived(0);
    wg_fence();
    scores(0);
    wg_wait<0>();
    gradients(0);
    // Each step's dV and dK products run beside the next step's S^T and dP^T.
    for (int step = 0; step + 1 < steps; ++step) {
      arrived(step + 1);
      wg_fence();
      accumulate(step);
      scores(step + 1);
      wg_wait<1>();  // dV and dK of this step done: every product that reads its stage
      release(step);
      wg_wait<0>();
      gradients(step + 1);
    }
    wg_fence();
    accumulate(steps - 1);
    wg_wait<0>();
    release(steps - 1);
  }
  if (wk >= rows) return;
  const long long out0 = ctx ? ((long long)(b * a.kv_heads + kvh) * a.context + k0 + wk) * D
                             : ((long long)(b * a.kv_heads + kvh) * a.units * 16 + k0 + wk) * D;
  const int mine = min(16, rows - wk);
  store_rows((ctx ? dk_ctx : dk_blk) + out0, dk, a.scale, mine);
  store_rows((ctx ? dv_ctx : dv_blk) + out0, dv, 1.f, mine);
}
#endif

// Batch-1 decoding attention ("flash decoding"): the T newest queries of every query head against the first
// start + T positions of a KV cache [1, KV, C, D] (their own keys and values already written at start..start + T),
// query t seeing the positions up to start + t (`causal`; else all of them, as a drafter's block sees itself), and
// with a `window` only the positions fewer than `window` from its own (on both sides where not causal: `sees`).
// `start` is read from the device, so a CUDA graph can replay it. The keys are split: thread block (kv head, split)
// attends to positions [lowest + split * chunk, lowest + (split + 1) * chunk), `lowest` the first position a window
// reaches (0 without one), with the group's query heads folded into its rows (row r: head r / T of the group, query
// r % T; up to WARPS * 16 rows, 16 a warp), and writes each row's output normalised over its split and its
// log-sum-exp (-inf where it saw nothing); `decode_merge` weighs the splits together. Its arguments: `DecodeArgs`
// (csrc/kernel_args.h).
extern "C" __global__ void __launch_bounds__(THREADS) decode_attention(DecodeArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* const stages = (bf16*)smem;
  auto kt = [&](int i) { return stages + i * 2 * KEYS * ROW; };
  auto vt = [&](int i) { return stages + i * 2 * KEYS * ROW + KEYS * ROW; };
  const int kvh = blockIdx.x, split = blockIdx.y;
  const int group = a.heads / a.kv_heads, rows = group * a.t;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int start = (int)*a.start, len = start + a.t;
  // The split's keys: the splits share the keys from the first one any query's window reaches (the first position
  // without a window).
  const int lowest = a.window > 0 ? max(0, start - a.window + 1) : 0;
  const int from = lowest + split * a.chunk, end = min(len, from + a.chunk);
  float* const part = a.part + ((long long)kvh * a.splits + split) * rows * D;
  float* const part_lse = a.part_lse + ((long long)kvh * a.splits + split) * rows;
  // The folded query rows, staged in stage 1's keys (not loaded before the walk's second tile).
  u32 qa[D / 16][4];
  {
    bf16* staging = kt(1);
    constexpr int CHUNKS = D / 8;
    for (int i = threadIdx.x; i < WARPS * 16 * CHUNKS; i += THREADS) {
      const int r = i / CHUNKS, piece = i % CHUNKS;
      const bool valid = r < rows;
      const bf16* src = a.q + (long long)(kvh * group + (valid ? r / a.t : 0)) * a.q_h +
                        (long long)(valid ? r % a.t : 0) * a.q_t + piece * 8;
      copy16(staging + r * ROW + piece * 8, src, valid);
    }
    copies_issued();
    copies_done<0>();
    __syncthreads();
#pragma unroll
    for (int k = 0; k < D / 16; ++k) a_frag(qa[k], staging, 16 * warp, k);
    __syncthreads();
  }
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  float acc[D / 8][4];
  zero(acc);
  const float scale_log2 = a.scale * LOG2E;
  const bf16* kc = a.k + kvh * a.k_h;
  const bf16* vc = a.v + kvh * a.v_h;
  const int tiles = end > from ? (end - from + KEYS - 1) / KEYS : 0;
  if (tiles > 0) {
    load_tile(kt(0), kc + (long long)from * a.k_t, a.k_t, end - from);
    load_tile(vt(0), vc + (long long)from * a.v_t, a.v_t, end - from);
  }
  copies_issued();
  for (int i = 0; i < tiles; ++i) {
    const int base = from + i * KEYS;
    if (i + 1 < tiles) {
      const int next = base + KEYS;
      load_tile(kt((i + 1) & 1), kc + (long long)next * a.k_t, a.k_t, end - next);
      load_tile(vt((i + 1) & 1), vc + (long long)next * a.v_t, a.v_t, end - next);
    }
    copies_issued();
    copies_done<1>();
    __syncthreads();
    if (warp * 16 < rows) {
      // Without a window every row sees the keys before `start`; the new ones, each query up to its own position
      // where causal.
      const bool whole = a.window == 0 && base + KEYS <= (a.causal ? min(end, start + 1) : end);
      auto seen = [&](int col, int row) {
        const int key = base + col, at = start + (warp * 16 + row) % a.t;
        return key < end && (!a.causal || key <= at) &&
               (a.window == 0 || (key > at - a.window && (a.causal || key < at + a.window)));
      };
      attend(qa, kt(i & 1), vt(i & 1), 0, KEYS / 8, whole, seen, scale_log2, m, l, acc);
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    if (row >= rows) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *(float2*)(part + (long long)row * D + n * 8 + 2 * c) = make_float2(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
    }
    if (c == 0) part_lse[row] = l[r] > 0.f ? (m[r] + log2f(l[r])) * LN2 : NEG_INF;
  }
}

// Merges decode_attention's splits: thread block (kv head, row) weighs each split's output by exp(its log-sum-exp
// - the largest) and writes the row, in bf16, to o at its head and query. D threads, one element each.
extern "C" __global__ void decode_merge(DecodeArgs a) {
  const int kvh = blockIdx.x, row = blockIdx.y, d = threadIdx.x;
  const int group = a.heads / a.kv_heads, rows = group * a.t;
  const float* lse = a.part_lse + (long long)kvh * a.splits * rows + row;
  float top = NEG_INF;
  for (int s = 0; s < a.splits; ++s) top = fmaxf(top, lse[(long long)s * rows]);
  float sum = 0.f, weights = 0.f;
  for (int s = 0; s < a.splits; ++s) {
    const float l = lse[(long long)s * rows];
    if (l == NEG_INF) continue;
    const float w = __expf(l - top);
    weights += w;
    sum += w * a.part[(((long long)kvh * a.splits + s) * rows + row) * D + d];
  }
  const int head = kvh * group + row / a.t, query = row % a.t;
  a.o[((long long)head * a.t + query) * D + d] = to_bf16(weights > 0.f ? sum / weights : 0.f);
}
