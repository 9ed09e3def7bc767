// Issue 65, item 3, its first question: how does Hopper's `wgmma` read bf16 tiles that ordinary stores (or cp.async,
// as the staircase kernels load them) put in shared memory, and where do its f32 accumulators land? The staircase
// kernels would keep their masks and online softmax (a warp's 16 query rows in mma.sync's fragment layout) and trade
// `ldmatrix` + `mma.sync` for one warpgroup's `wgmma` over the thread block's 64 query rows; this answers the three
// things that trade rests on, against a CPU reference, before any kernel of the product changes:
//   1. the no-swizzle (interleaved) layout: 8x8 core matrices of 128 contiguous bytes, and which of the descriptor's
//      two byte offsets (leading, stride) steps along K and which along M/N: both assignments are tried ("as
//      written" is what src/model/staircase.cu builds; an N-major match only "swapped" means WG_N_MAJOR_SWAPPED 1);
//   2. S = Q K^T with both operands K-major (q [64, D] and a key tile [64, D] row-major, as the kernels hold them);
//   3. O = P V with V row-major [keys, D] (N-major: `imm-trans-b` 1), P from shared memory K-major;
//   4. both again with A from registers, each warp's 16 rows as mma.sync's A fragments (ldmatrix), as the forward
//      under DFLASH_WGMMA=1 runs them (`attend_wg` in src/model/staircase.cu);
// and that the accumulators of m64nNk16 land as mma.sync's m16n8 fragments, warp w holding rows 16w..16w+15.
//
// On the GPU machine (nvcc from the image; sm_90a for wgmma):
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_tile scripts/probes/wgmma_tile.cu && /tmp/wgmma_tile
// Prints one line per case and assignment of the offsets: the largest difference from the CPU's product of the same
// bf16 values and whether it is within f32 accumulation's (1e-3 relative); exits 1 where a product matches under
// neither assignment (the layout itself, or the accumulators' placement, is then not what is written here).
#include <cuda_bf16.h>
#ifndef __CUDACC_RTC__
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#endif

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define M 64   // query rows: one warpgroup, 4 warps of 16
#define N 64   // keys of a tile (S = Q K^T), or the head dimension (O = P V)
#define K 64   // the head dimension (S), or the keys of a tile (O)

// Byte offset of element (row r, column c) of a K-major operand (rows along M or N, K contiguous) in the no-swizzle
// canonical layout: core matrix (r / 8, c / 8) at `along_rows * (r / 8) + along_k * (c / 8)`, its 8 rows of 16 bytes
// contiguous inside.
__device__ __forceinline__ u32 core_offset(int r, int c, u32 along_rows, u32 along_k) {
  return (r / 8) * along_rows + (c / 8) * along_k + (r % 8) * 16 + (c % 8) * 2;
}

// A shared-memory matrix descriptor: start address, leading and stride byte offsets (each in 16-byte units, 14 bits),
// no swizzle (bits 62-63 zero), base offset 0.
__device__ __forceinline__ u64 descriptor(const void* smem, u32 leading, u32 stride) {
  const u32 address = (u32)__cvta_generic_to_shared(smem);
  return (u64)((address & 0x3FFFF) >> 4) | ((u64)((leading & 0x3FFFF) >> 4) << 16) |
         ((u64)((stride & 0x3FFFF) >> 4) << 32);
}

// d (64 x 64) += a (this warp's 16 x 16 in registers, mma.sync's A fragment) * b (16 x 64 from shared memory): how
// the staircase forward runs both of its products (Q and P stay in registers).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_64x64x16_ra(float (&d)[32], const u32 (&a)[4], u64 b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(TRANS_B));
}

// d (64 x 64, f32) += a (64 x 16) * b (16 x 64), both from shared memory; `TRANS_B` 1 where b is N-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[32], u64 a, u64 b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, %35;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate), "n"(TRANS_B));
}

// out [M, N] f32 = a [M, K] (row-major, K-major) times b: `b_rows_are_n` 1, b is [N, K] row-major (K-major, S = Q
// K^T); 0, b is [K, N] row-major (N-major, O = P V). `swap` exchanges the descriptor's two byte offsets (question 1).
// One thread block of 128 threads (one warpgroup).
// `a_in_registers` 1: a from registers instead, each warp's 16 rows loaded by ldmatrix from a row-major copy as the
// staircase kernels load Q (16-byte rows padded by 8 elements).
extern "C" __global__ void __launch_bounds__(128) probe(const bf16* __restrict__ a, const bf16* __restrict__ b,
                                                        float* __restrict__ out, int b_rows_are_n, int swap,
                                                        int a_in_registers) {
  __shared__ __align__(128) bf16 sa[M * K];
  __shared__ __align__(128) bf16 sb[N * K];
  __shared__ __align__(16) bf16 rows[M * (K + 8)];
  const int t = threadIdx.x;
  for (int i = t; i < M * K; i += 128) rows[(i / K) * (K + 8) + i % K] = a[i];
  // a: the core matrices of one 8-wide column of K next to each other (128 bytes apart along M), the columns
  // M / 8 * 128 bytes apart: a 16-wide K step is two columns, 2 * a_k bytes.
  const u32 a_rows = 128, a_k = (M / 8) * 128;
  for (int i = t; i < M * K; i += 128) {
    const int r = i / K, c = i % K;
    *(bf16*)((char*)sa + core_offset(r, c, a_rows, a_k)) = a[i];
  }
  // b K-major ([N, K]): as a. b N-major ([K, N], row k holds N values): core matrices of 8 k-rows by 8 n-columns
  // with n contiguous inside each 16-byte row, i.e. the same formula with (k, n) in place of (r, c).
  const u32 b_rows = 128, b_k = (N / 8) * 128;
  for (int i = t; i < N * K; i += 128) {
    const int r = i / (b_rows_are_n ? K : N), c = i % (b_rows_are_n ? K : N);
    *(bf16*)((char*)sb + core_offset(r, c, b_rows, b_rows_are_n ? b_k : (K / 8) * 128)) = b[i];
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();

  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  const int warp = t / 32, lane = t % 32;
  u32 frag[K / 16][4];
#pragma unroll
  for (int k = 0; k < K / 16; ++k) {
    const bf16* p = rows + (16 * warp + (lane & 15)) * (K + 8) + k * 16 + (lane >> 4) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(frag[k][0]), "=r"(frag[k][1]), "=r"(frag[k][2]), "=r"(frag[k][3])
                 : "r"((u32)__cvta_generic_to_shared(p)));
  }
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int k = 0; k < K / 16; ++k) {
    // A K-major: leading (K) offset between the two core columns of a 16-wide step, stride (M) between 8-row groups.
    // `swap` asks about the K-major offsets in the first product (both operands) and about the N-major operand's
    // alone in the second (its A, K-major, stays as written).
    const bool swap_a = swap && b_rows_are_n;
    const u32 lead_a = swap_a ? a_rows : a_k, stride_a = swap_a ? a_k : a_rows;
    const u64 da = descriptor((char*)sa + k * 2 * a_k, lead_a, stride_a);
    u64 db;
    if (b_rows_are_n) {
      const u32 lead_b = swap ? b_rows : b_k, stride_b = swap ? b_k : b_rows;
      db = descriptor((char*)sb + k * 2 * b_k, lead_b, stride_b);
      if (a_in_registers) wgmma_64x64x16_ra<0>(d, frag[k], db);
      else wgmma_64x64x16<0>(d, da, db, 1);
    } else {
      // N-major b: core matrices 128 bytes apart along K (groups of 8 k-rows), (K / 8) * 128 along N (groups of 8
      // columns); this step's 16 k-rows are two groups, 2 * k_step bytes on. As written, leading is the step along
      // K and stride the step along N, as CUTLASS's make_gmma_desc fills them for an interleaved MN-major operand;
      // which the GPU reads so is question 1's second half.
      const u32 n_step = (K / 8) * 128, k_step = 128;
      const u32 lead_b = swap ? n_step : k_step, stride_b = swap ? k_step : n_step;
      db = descriptor((char*)sb + k * 2 * k_step, lead_b, stride_b);
      if (a_in_registers) wgmma_64x64x16_ra<1>(d, frag[k], db);
      else wgmma_64x64x16<1>(d, da, db, 1);
    }
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");

  // mma.sync's m16n8 fragments, N / 8 of them: warp w rows 16w + lane / 4 (+ 8), columns 8j + 2 (lane % 4) (+ 1).
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int row = 16 * warp + lane / 4, col = 8 * j + 2 * (lane % 4);
    out[row * N + col] = d[4 * j];
    out[row * N + col + 1] = d[4 * j + 1];
    out[(row + 8) * N + col] = d[4 * j + 2];
    out[(row + 8) * N + col + 1] = d[4 * j + 3];
  }
}

#ifndef __CUDACC_RTC__
#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e = (x);                                                               \
    if (e != cudaSuccess) {                                                            \
      std::printf("%s: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__);          \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

int main() {
  std::vector<bf16> a(M * K), b(N * K);
  std::vector<float> af(M * K), bf(N * K), out(M * N);
  unsigned seed = 1;
  auto next = [&] { seed = seed * 1664525u + 1013904223u; return ((seed >> 8) & 0xFFFF) / 32768.0f - 1.0f; };
  for (int i = 0; i < M * K; ++i) { a[i] = __float2bfloat16(next()); af[i] = __bfloat162float(a[i]); }
  for (int i = 0; i < N * K; ++i) { b[i] = __float2bfloat16(next()); bf[i] = __bfloat162float(b[i]); }
  bf16 *da, *db;
  float* dout;
  CHECK(cudaMalloc(&da, a.size() * 2));
  CHECK(cudaMalloc(&db, b.size() * 2));
  CHECK(cudaMalloc(&dout, out.size() * 4));
  CHECK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  int failed = 0;
  for (int case_ = 0; case_ < 4; ++case_) {
    const int b_rows_are_n = case_ % 2 == 0, in_registers = case_ / 2;
    bool matched = false;
    for (int swap = 0; swap <= 1; ++swap) {
      CHECK(cudaMemset(dout, 0, out.size() * 4));
      probe<<<1, 128>>>(da, db, dout, b_rows_are_n, swap, in_registers);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost));
      double worst = 0, largest = 0;
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
          double ref = 0;
          for (int k = 0; k < K; ++k) ref += (double)af[m * K + k] * (b_rows_are_n ? bf[n * K + k] : bf[k * N + n]);
          worst = std::fmax(worst, std::fabs(ref - out[m * N + n]));
          largest = std::fmax(largest, std::fabs(ref));
        }
      const bool ok = worst <= 1e-3 * largest;
      std::printf("%s, A from %s, offsets %s: largest difference %.3g of %.3g: %s\n",
                  b_rows_are_n ? "S = Q K^T (both K-major)" : "O = P V (V N-major, trans-b)",
                  in_registers ? "registers" : "shared memory", swap ? "swapped" : "as written", worst, largest,
                  ok ? "MATCHES" : "differs");
      matched = matched || ok;
    }
    failed += !matched;
  }
  return failed ? 1 : 0;
}
#endif
