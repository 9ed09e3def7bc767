// The argument blocks of the kernels in src/model/staircase.cu, defined once: csrc/staircase.cpp includes this file
// and fills `StaircaseArgs`; src/model/staircase.rs puts it in front of the kernels' source for NVRTC and fills
// `DecodeArgs`. The Rust copies (src/model/kernel_args.rs) are checked against this text field by field, name,
// offset and C type (a test in CI), so two fields swapped on one side fail it. The strides are in elements.
#ifndef DFLASH_KERNEL_ARGS_H
#define DFLASH_KERNEL_ARGS_H

typedef unsigned short bf16;

// The training kernels' block (forward, dQ, dK and dV): the tensors, their strides, the shapes and the pattern.
struct StaircaseArgs {
  const bf16* q;
  long long q_b, q_h, q_t;
  const bf16 *k_ctx, *v_ctx;
  long long c_b, c_h, c_t;     // k_ctx's strides
  long long cv_b, cv_h, cv_t;  // v_ctx's
  const bf16 *k_blk, *v_blk;
  long long k_b, k_h, k_t;     // k_blk's
  long long bv_b, bv_h, bv_t;  // v_blk's
  const int *lo, *hi;
  int heads, kv_heads;
  int units;  // units of 16 query rows a row, a warp each
  int context, causal_block, window;
  int per;  // blocks a unit: 1, or 2 for blocks of 8 (PER: which module the host launches)
  float scale;
};

// Batch-1 decoding's block (`decode_attention` and `decode_merge`).
struct DecodeArgs {
  const bf16* q;
  long long q_h, q_t;  // q [1, H, T, D]
  const bf16 *k, *v;
  long long k_h, k_t, v_h, v_t;  // the cache's [1, KV, C, D]
  const long long* start;
  float* part;      // [KV, splits, rows, D]
  float* part_lse;  // [KV, splits, rows]
  bf16* o;          // [1, H, T, D], contiguous
  int heads, kv_heads, t, chunk, splits, causal, window;
  float scale;
};

#endif
