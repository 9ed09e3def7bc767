//! Elementwise work fused into single kernels on CUDA in bf16, where no autograd is recorded: for inference (target
//! capture, decoding) the per-head RMSNorm and RoPE of q and k in one pass, the SwiGLU activation in one pass,
//! batch-1 attention's masked softmax, and generation's sampled draw (temperature, nucleus and Gumbel noise);
//! for training, the LM head's softmax, loss statistics and gradient in two passes over the logits, and likewise its
//! KL divergence from the target's distribution (each loss differentiated by hand). libtorch runs each as several
//! kernels over the same data; these read it once or twice.
//! The kernels are compiled at run time by NVRTC (it ships with the torch wheel) and launched on libtorch's current
//! stream, so they stay ordered with its work.
//!
//! Every entry point returns `None` where it does not apply (CPU, other dtypes, tensors that need gradients, shapes
//! the kernels do not take, NVRTC or the driver missing, `DFLASH_FUSED_KERNELS=0`), and the caller runs the plain
//! libtorch expression, which the tests compare these against.
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, result, sys};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use tch::{Device, Kind, Tensor};

/// Set to `0` to run the plain libtorch expressions instead (for comparisons).
const DISABLE_ENV: &str = "DFLASH_FUSED_KERNELS";

const SOURCE: &str = r#"
typedef unsigned short bf16;
__device__ __forceinline__ float from_bf16(bf16 v) { return __uint_as_float(((unsigned int)v) << 16); }
// Round to nearest even, as libtorch's casts do; NaN stays NaN.
__device__ __forceinline__ bf16 to_bf16(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}
__device__ __forceinline__ float rounded(float f) { return from_bf16(to_bf16(f)); }
// NVRTC has no math.h: negative infinity by its bits.
#define NEG_INF __int_as_float(0xff800000u)

// One warp per (token, head) row of `dim` <= 256 elements; lane l holds the pairs (p, p + dim/2) for p = l + 32i, the
// two elements RoPE mixes. With `weight`: HF's RMSNorm first (f32 statistics; normalised value rounded to bf16, then
// scaled and rounded again). RoPE: out = round(x * cos) + swap(x) * ssin, rounded once (libtorch's mul, addcmul_).
// `x` rows: token t, head h at x + t * token_stride + h * dim; `cos`/`ssin`: [seq, dim], token t at row t % seq.
extern "C" __global__ void norm_rope(const bf16* __restrict__ x, long long token_stride, int heads, int dim,
                                     const bf16* __restrict__ weight, float eps, const bf16* __restrict__ cos,
                                     const bf16* __restrict__ ssin, int seq, bf16* __restrict__ out, long long rows) {
  long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  int lane = threadIdx.x & 31;
  long long token = row / heads;
  int head = (int)(row - token * heads);
  const bf16* src = x + token * token_stride + (long long)head * dim;
  const bf16* c = cos + (token % seq) * dim;
  const bf16* s = ssin + (token % seq) * dim;
  bf16* dst = out + row * dim;
  int half = dim >> 1;
  float a[4], b[4];
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    int p = lane + 32 * i;
    a[i] = 0.f;
    b[i] = 0.f;
    if (p < half) {
      a[i] = from_bf16(src[p]);
      b[i] = from_bf16(src[p + half]);
    }
    squares += a[i] * a[i] + b[i] * b[i];
  }
  if (weight) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
    float r = rsqrtf(squares / dim + eps);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      int p = lane + 32 * i;
      if (p < half) {
        a[i] = rounded(from_bf16(weight[p]) * rounded(a[i] * r));
        b[i] = rounded(from_bf16(weight[p + half]) * rounded(b[i] * r));
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    int p = lane + 32 * i;
    if (p < half) {
      dst[p] = to_bf16(rounded(a[i] * from_bf16(c[p])) + b[i] * from_bf16(s[p]));
      dst[p + half] = to_bf16(rounded(b[i] * from_bf16(c[p + half])) + a[i] * from_bf16(s[p + half]));
    }
  }
}

// silu(gate) * up over rows of a stacked [rows, 2 * inter] projection (gate first), 8 elements per thread
// (inter % 8 == 0): silu rounded to bf16, then the product rounded (libtorch's silu, mul).
extern "C" __global__ void silu_mul(const uint4* __restrict__ gate_up, int inter8, uint4* __restrict__ out,
                                    long long n8) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n8) return;
  long long row = i / inter8;
  int col = (int)(i - row * inter8);
  uint4 g = gate_up[row * 2 * inter8 + col];
  uint4 u = gate_up[row * 2 * inter8 + inter8 + col];
  const bf16* gs = (const bf16*)&g;
  const bf16* us = (const bf16*)&u;
  uint4 r;
  bf16* rs = (bf16*)&r;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    float x = from_bf16(gs[k]);
    rs[k] = to_bf16(rounded(x / (1.0f + expf(-x))) * from_bf16(us[k]));
  }
  out[i] = r;
}

__device__ __forceinline__ void combine(float& m, float& s, int& i, float m2, float s2, int i2) {
  if (m2 == NEG_INF) return;
  if (m == NEG_INF) { m = m2; s = s2; i = i2; return; }
  if (m2 > m) {
    s = s * expf(m - m2) + s2;
    m = m2;
    i = i2;
  } else {
    s += s2 * expf(m2 - m);
    if (m2 == m && i2 < i) i = i2;
  }
}

// The block's online (max, sum of exp(x - max), first index of the max) from every thread's, returned in every thread
// (blockDim.x a multiple of 32); `sm`, `ss` and `si` (null where no index is kept) are 32 shared slots, free again on
// return.
__device__ __forceinline__ void block_combine(float& m, float& s, int& idx, float* sm, float* ss, int* si) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
    combine(m, s, idx, m2, s2, i2);
  }
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
    if (si) si[warp] = idx;
  }
  __syncthreads();
  if (warp == 0) {
    int warps = blockDim.x >> 5;
    m = lane < warps ? sm[lane] : NEG_INF;
    s = lane < warps ? ss[lane] : 0.f;
    idx = lane < warps && si ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
      int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
      combine(m, s, idx, m2, s2, i2);
    }
    if (lane == 0) {
      sm[0] = m;
      ss[0] = s;
      if (si) si[0] = idx;
    }
  }
  __syncthreads();
  m = sm[0];
  s = ss[0];
  if (si) idx = si[0];
  __syncthreads();
}

// The sum over the block of every thread's `v`, in thread 0 (warps summed in order); `scratch` is 32 shared slots, not
// free again until the block's next barrier.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0)
    for (int k = 0; k < (int)(blockDim.x >> 5); ++k) total += scratch[k];
  return total;
}

// Attention probabilities at batch 1: the softmax of each row of `scale * scores + bias`, `scores` [rows, keys] f32
// (q . k, unscaled) and the additive mask `bias` [bias_rows, keys] bf16 (row r takes bias row r % bias_rows), in f32
// online, written rounded to bf16 for the product with v (masked keys weigh exactly 0). One block per row.
extern "C" __global__ void masked_softmax(const float* __restrict__ scores, int keys, const bf16* __restrict__ bias,
                                          int bias_rows, float scale, bf16* __restrict__ out) {
  __shared__ float sm[32], ss[32];
  long long row = blockIdx.x;
  const float* x = scores + row * keys;
  const bf16* b = bias + (row % bias_rows) * (long long)keys;
  float m = NEG_INF, s = 0.f;
  for (int j = threadIdx.x; j < keys; j += blockDim.x) {
    float z = x[j] * scale + from_bf16(b[j]);
    if (z == NEG_INF) continue;
    if (z > m) {
      s = s * expf(m - z) + 1.f;
      m = z;
    } else {
      s += expf(z - m);
    }
  }
  int unused = 0;
  block_combine(m, s, unused, sm, ss, nullptr);
  float mx = m, sum = s;
  bf16* y = out + row * keys;
  for (int j = threadIdx.x; j < keys; j += blockDim.x) {
    float z = x[j] * scale + from_bf16(b[j]);
    y[j] = to_bf16(z == NEG_INF || mx == NEG_INF ? 0.f : expf(z - mx) / sum);
  }
}


// The softmax of each row of `logits` [rows, vocab] (vocab % 8 == 0; one block of 1024 threads per row) as the LM
// head's loss needs it, in two passes where libtorch takes about seven. Pass 1: the largest logit, its first index
// and the sum of exp(x - max), online in f32. Pass 2: p = exp(x - max) / sum rounded to bf16, and the mass of all but
// the label summed in f32 from the rounded values; with `want_grad` the row is overwritten by the gradient of the
// weighted cross-entropy, p * w (rounded once) and -(rest * w) at the label. `stats` [rows, 4]: largest logit,
// label logit, p at the argmax, rest.
extern "C" __global__ void softmax_rows(bf16* __restrict__ logits, int vocab, const long long* __restrict__ labels,
                                        const float* __restrict__ weights, int want_grad, float* __restrict__ stats,
                                        long long* __restrict__ argmax) {
  __shared__ float sm[32], ss[32];
  __shared__ int si[32];
  long long row = blockIdx.x;
  bf16* x = logits + row * (long long)vocab;
  uint4* v = (uint4*)x;
  int n8 = vocab >> 3;
  long long label = labels[row];
  bool label_ok = label >= 0 && label < vocab;
  float label_logit = label_ok ? from_bf16(x[label]) : 0.f;
  float m = NEG_INF, s = 0.f;
  int idx = 0x7fffffff;
  for (int j = threadIdx.x; j < n8; j += blockDim.x) {
    uint4 q = v[j];
    const bf16* e = (const bf16*)&q;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float z = from_bf16(e[k]);
      if (z > m) {
        s = s * expf(m - z) + 1.f;
        m = z;
        idx = j * 8 + k;
      } else {
        s += expf(z - m);
      }
    }
  }
  block_combine(m, s, idx, sm, ss, si);
  float mx = m, sum = s;
  int best = idx;
  float w = weights[row];
  float rest = 0.f;
  for (int j = threadIdx.x; j < n8; j += blockDim.x) {
    uint4 q = v[j];
    bf16* e = (bf16*)&q;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float p = from_bf16(to_bf16(expf(from_bf16(e[k]) - mx) / sum));
      if (j * 8 + k != label) rest += p;
      e[k] = to_bf16(p * w);
    }
    if (want_grad) v[j] = q;
  }
  rest = block_sum(rest, ss);
  if (threadIdx.x == 0) {
    stats[row * 4 + 0] = mx;
    stats[row * 4 + 1] = label_logit;
    stats[row * 4 + 2] = from_bf16(to_bf16(1.f / sum));
    stats[row * 4 + 3] = rest;
    argmax[row] = best;
    if (want_grad && label_ok) x[label] = to_bf16(-(rest * w));
  }
}

// KL(p || q) of each row, p = softmax(target) and q = softmax(logits), both bf16 [rows, vocab] (vocab % 8 == 0; one
// block of 1024 threads per row), from both log-softmaxes in f32 as speculators' kl_div_loss takes it, in two passes
// over the two rows where libtorch takes about ten over f32 copies. Pass 1: each row's largest logit and sum of
// exp(x - max), online in f32, and the drafter's argmax (first index). Pass 2: the sum of p (log p - log q) in f32;
// with `want_grad` the drafter's row is overwritten by the gradient of the weighted loss, (q - p) * w rounded once.
extern "C" __global__ void kl_rows(bf16* __restrict__ logits, int vocab, const bf16* __restrict__ target,
                                   const float* __restrict__ weights, int want_grad, float* __restrict__ loss,
                                   long long* __restrict__ argmax) {
  __shared__ float sm[32], ss[32];
  __shared__ int si[32];
  long long row = blockIdx.x;
  uint4* x = (uint4*)(logits + row * (long long)vocab);
  const uint4* t = (const uint4*)(target + row * (long long)vocab);
  int n8 = vocab >> 3;
  float mq = NEG_INF, sq = 0.f, mp = NEG_INF, sp = 0.f;
  int idx = 0x7fffffff, unused = 0;
  for (int j = threadIdx.x; j < n8; j += blockDim.x) {
    uint4 a = x[j], b = t[j];
    const bf16* ea = (const bf16*)&a;
    const bf16* eb = (const bf16*)&b;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float z = from_bf16(ea[k]), y = from_bf16(eb[k]);
      if (z > mq) {
        sq = sq * expf(mq - z) + 1.f;
        mq = z;
        idx = j * 8 + k;
      } else {
        sq += expf(z - mq);
      }
      if (y > mp) {
        sp = sp * expf(mp - y) + 1.f;
        mp = y;
      } else {
        sp += expf(y - mp);
      }
    }
  }
  block_combine(mq, sq, idx, sm, ss, si);
  block_combine(mp, sp, unused, sm, ss, nullptr);
  // log q = z - (max + log sum), as libtorch's log_softmax.
  float cq = mq + logf(sq), cp = mp + logf(sp);
  float w = weights[row];
  float kl = 0.f;
  for (int j = threadIdx.x; j < n8; j += blockDim.x) {
    uint4 a = x[j], b = t[j];
    bf16* ea = (bf16*)&a;
    const bf16* eb = (const bf16*)&b;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float lq = from_bf16(ea[k]) - cq, lp = from_bf16(eb[k]) - cp;
      float p = expf(lp);
      // xlogy: a token the target gives no mass adds nothing.
      if (p > 0.f) kl += p * (lp - lq);
      if (want_grad) ea[k] = to_bf16((expf(lq) - p) * w);
    }
    if (want_grad) x[j] = a;
  }
  kl = block_sum(kl, ss);
  if (threadIdx.x == 0) {
    loss[row] = kl;
    argmax[row] = idx;
  }
}
// splitmix64's output function of `x + golden` (wrapping), as src/model/sampling.rs computes it.
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
  unsigned long long z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// A bf16's bits as a key that orders as its value does (-0 as 0; NaN aside).
__device__ __forceinline__ unsigned int order_key(bf16 v) {
  if (v == 0x8000u) v = 0;
  return (v & 0x8000u) ? (~(unsigned int)v & 0xffffu) : ((unsigned int)v | 0x8000u);
}
__device__ __forceinline__ bf16 key_value(unsigned int key) {
  return (bf16)((key & 0x8000u) ? (key & 0x7fffu) : (~key & 0xffffu));
}
// The block's sum of every thread's `v`, in every thread (`scratch`: 32 shared slots and one more).
__device__ __forceinline__ float block_total(float v, float* scratch) {
  float total = block_sum(v, scratch);
  if (threadIdx.x == 0) scratch[32] = total;
  __syncthreads();
  total = scratch[32];
  __syncthreads();
  return total;
}
// How many of `v` the threads before this one hold, in thread order (`scratch`: 32 shared slots).
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, inclusive = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int up = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += up;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += scratch[w];
  __syncthreads();
  return before + inclusive - v;
}

// The next token of each row of `logits` [rows, vocab] (bf16; one block of 1024 threads a row, each thread a
// contiguous run of ids), drawn as src/model/sampling.rs's pick_tokens draws it in about ten libtorch passes and a
// sort: a row at temperature 0 takes its largest logit (the lowest id among equals); a sampled row the largest
// z + g over its nucleus, z = logit / temperature in f32 and g the Gumbel noise of (seed, step, token)
// (-ln(-ln(u)), u from splitmix64 as there). The nucleus (top_p < 1) is found without sorting: the softmax of z by
// its two passes, then a binary search over the 65,536 bf16 keys for the smallest key whose mass strictly above is
// below top_p; tokens above it are in, and its ties, lowest ids first, while the mass ranked before each is below
// top_p (the sorted cumulative sum's rule, ties ranked by id as its stable sort ranks them).
extern "C" __global__ void sample_rows(const bf16* __restrict__ logits, int vocab,
                                       const float* __restrict__ temperatures, const float* __restrict__ top_ps,
                                       const long long* __restrict__ seeds, const long long* __restrict__ steps,
                                       long long* __restrict__ out) {
  __shared__ float sm[33], ss[33];
  __shared__ int si[32];
  __shared__ int keep_shared;
  long long row = blockIdx.x;
  const bf16* x = logits + row * (long long)vocab;
  int chunk = (vocab + (int)blockDim.x - 1) / (int)blockDim.x;
  int from = min(vocab, (int)threadIdx.x * chunk), to = min(vocab, from + chunk);
  float t = temperatures[row], zero = 0.f;
  float best = NEG_INF;
  int best_id = 0x7fffffff;
  if (!(t > 0.f)) {
    for (int j = from; j < to; ++j) {
      float z = from_bf16(x[j]);
      if (z > best) best = z, best_id = j;
    }
  } else {
    float top_p = top_ps[row];
    bool nucleus = top_p < 1.f;
    unsigned int cut = 0;
    int keep = 0, rank = 0;
    if (nucleus) {
      // The softmax of z as libtorch's: the largest, then the sum of exp(z - largest).
      float mx = NEG_INF;
      int unused = 0;
      for (int j = from; j < to; ++j) mx = fmaxf(mx, from_bf16(x[j]) / t);
      block_combine(mx, zero, unused, sm, ss, nullptr);
      float part = 0.f;
      for (int j = from; j < to; ++j) part += expf(from_bf16(x[j]) / t - mx);
      float sum = block_total(part, ss);
      // The mass of the tokens whose key is above `k`.
      auto above = [&](unsigned int k) {
        float mass = 0.f;
        for (int j = from; j < to; ++j) {
          bf16 v = x[j];
          if (order_key(v) > k) mass += expf(from_bf16(v) / t - mx) / sum;
        }
        return block_total(mass, ss);
      };
      unsigned int lo = 0, hi = 0xffffu;
      while (lo < hi) {
        unsigned int mid = (lo + hi) >> 1;
        if (above(mid) < top_p) hi = mid; else lo = mid + 1;
      }
      cut = lo;
      float mass = above(cut);
      // The ties at the cut this thread holds: all of them counted, and those before its ids (its first tie's rank).
      int mine = 0;
      for (int j = from; j < to; ++j) mine += order_key(x[j]) == cut;
      float ties = block_total((float)mine, ss);
      rank = block_exclusive_scan(mine, si);
      if (threadIdx.x == 0) {
        float p = expf(from_bf16(key_value(cut)) / t - mx) / sum, before = mass;
        int n = 0;
        while (n < (int)ties && before < top_p) ++n, before += p;
        keep_shared = n;
      }
      __syncthreads();
      keep = keep_shared;
    }
    unsigned long long base = splitmix64((unsigned long long)seeds[row] + splitmix64((unsigned long long)steps[row]));
    for (int j = from; j < to; ++j) {
      bf16 v = x[j];
      if (nucleus) {
        unsigned int key = order_key(v);
        if (key < cut || (key == cut && rank++ >= keep)) continue;
      }
      unsigned long long bits = splitmix64(base + (unsigned long long)j * 0x9E3779B97F4A7C15ull);
      float u = ((float)(bits >> 41) + 0.5f) * (1.0f / 8388608.0f);  // the top 23 bits: never 0 or 1 (UNIFORM_BITS)
      float score = from_bf16(v) / t + -logf(-logf(u));
      if (score > best) best = score, best_id = j;
    }
  }
  block_combine(best, zero, best_id, sm, ss, si);
  if (threadIdx.x == 0) out[row] = best_id == 0x7fffffff ? 0 : best_id;
}
"#;

/// The kernels' PTX (NVRTC needs no GPU).
fn compile() -> Result<Ptx, String> {
    nvrtc(SOURCE, CompileOptions { name: Some("dflash_fused.cu".into()), ..Default::default() })
}

/// `source` compiled by NVRTC to PTX.
pub(crate) fn nvrtc(source: &str, options: CompileOptions) -> Result<Ptx, String> {
    // NVRTC opens its builtins library by name while compiling, searching its own paths, which do not include the
    // rpath this binary was linked with. Opened first from here (through that rpath), it is found already loaded.
    static BUILTINS: OnceLock<Option<libloading::Library>> = OnceLock::new();
    // SAFETY: loading NVRTC's own companion library, which runs no initialisation with preconditions.
    BUILTINS.get_or_init(|| unsafe { libloading::Library::new("libnvrtc-builtins.so.13.0") }.ok());
    compile_ptx_with_opts(source, options).map_err(|e| format!("NVRTC: {e}"))
}

/// Whether the CUDA driver and NVRTC libraries can be opened (what run-time kernels need).
pub(crate) fn libraries_present() -> Result<(), String> {
    // SAFETY: only probes whether the libraries can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so.1) was not found".into());
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(
            "NVRTC (libnvrtc.so.13) was not found: add the torch wheel's nvidia/cu13/lib to the library path".into()
        );
    }
    Ok(())
}

/// The compiled kernels of one device.
struct Kernels {
    context: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    norm_rope: CudaFunction,
    silu_mul: CudaFunction,
    softmax_rows: CudaFunction,
    kl_rows: CudaFunction,
    masked_softmax: CudaFunction,
    sample_rows: CudaFunction,
}

// SAFETY: the handles are plain driver handles, valid in any thread bound to the context (each launch binds it).
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

impl Kernels {
    fn compile(ordinal: usize) -> Result<Self, String> {
        libraries_present()?;
        let context = CudaContext::new(ordinal).map_err(|e| format!("cannot open cuda:{ordinal}: {e}"))?;
        let ptx = compile()?;
        let module = context.load_module(ptx).map_err(|e| format!("loading the kernels: {e}"))?;
        let function = |name| module.load_function(name).map_err(|e| format!("kernel {name}: {e}"));
        Ok(Kernels {
            norm_rope: function("norm_rope")?,
            silu_mul: function("silu_mul")?,
            softmax_rows: function("softmax_rows")?,
            kl_rows: function("kl_rows")?,
            masked_softmax: function("masked_softmax")?,
            sample_rows: function("sample_rows")?,
            _module: module.clone(),
            context,
        })
    }

    /// Launches `f` on the calling thread's current libtorch stream of `device` with `args`, in the kernel's order.
    /// A failed launch is said once and gives None: the caller falls back to libtorch.
    fn launch(&self, f: &CudaFunction, device: Device, grid: u32, block: u32, args: &[Arg]) -> Option<()> {
        let launched = (|| -> Result<(), String> {
            let stream =
                crate::device::current_stream_handle(device).map_err(|e| e.to_string())?.ok_or("not a CUDA device")?;
            self.context.bind_to_thread().map_err(|e| e.to_string())?;
            let mut values = args.to_vec();
            let mut params: Vec<*mut c_void> = values.iter_mut().map(Arg::as_param).collect();
            // SAFETY: the function belongs to this context's live module; every parameter points at a live value of
            // the C type the kernel declares (`values` outlives the call, which copies them), and the tensors they
            // address stay alive until the stream has run the kernel (libtorch's caching allocator orders reuse of
            // their memory after work queued on this stream).
            unsafe {
                result::launch_kernel(
                    f.cu_function(),
                    (grid, 1, 1),
                    (block, 1, 1),
                    0,
                    stream as sys::CUstream,
                    &mut params,
                )
            }
            .map_err(|e| e.to_string())
        })();
        if let Err(e) = &launched {
            static SAID: OnceLock<()> = OnceLock::new();
            SAID.get_or_init(|| tracing::warn!("a fused kernel failed to launch, running plain libtorch: {e}"));
        }
        launched.ok()
    }
}

/// One kernel argument, as the C type the kernel declares it.
#[derive(Clone, Copy)]
enum Arg {
    /// A tensor's data pointer.
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    fn tensor(t: &Tensor) -> Self {
        Arg::Ptr(t.data_ptr() as u64)
    }

    /// The address `cuLaunchKernel` reads the value from.
    fn as_param(&mut self) -> *mut c_void {
        match self {
            Arg::Ptr(v) => v as *mut u64 as *mut c_void,
            Arg::I32(v) => v as *mut i32 as *mut c_void,
            Arg::I64(v) => v as *mut i64 as *mut c_void,
            Arg::F32(v) => v as *mut f32 as *mut c_void,
        }
    }
}

/// Whether `DFLASH_FUSED_KERNELS=0` asks for the plain libtorch paths (read once per process): the fused kernels
/// here and GPT-OSS's flash attention with sinks.
pub fn switched_off() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    *OFF.get_or_init(|| std::env::var(DISABLE_ENV).is_ok_and(|v| v == "0"))
}

/// The kernels for `device`, compiled on first use; None where they are turned off or failed to build (said once).
fn kernels(device: Device) -> Option<Arc<Kernels>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Option<Arc<Kernels>>>>> = OnceLock::new();
    let Device::Cuda(ordinal) = device else {
        return None;
    };
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    cache
        .entry(ordinal)
        .or_insert_with(|| {
            if switched_off() {
                return None;
            }
            match Kernels::compile(ordinal) {
                Ok(k) => Some(Arc::new(k)),
                Err(e) => {
                    tracing::warn!("fused kernels unavailable on cuda:{ordinal}, running plain libtorch instead: {e}");
                    None
                }
            }
        })
        .clone()
}

fn applies(t: &Tensor) -> bool {
    t.kind() == Kind::BFloat16 && matches!(t.device(), Device::Cuda(_)) && !t.requires_grad()
}

/// `silu(gate) * up` of a contiguous stacked projection `[..., 2I]` (gate first), in one pass.
pub fn silu_mul(gate_up: &Tensor) -> Option<Tensor> {
    let two_inter = *gate_up.size().last()?;
    let inter = two_inter / 2;
    if !applies(gate_up) || !gate_up.is_contiguous() || two_inter % 16 != 0 {
        return None;
    }
    let k = kernels(gate_up.device())?;
    let mut shape = gate_up.size();
    *shape.last_mut()? = inter;
    let out = Tensor::empty(&shape, (Kind::BFloat16, gate_up.device()));
    let n8 = out.numel() as i64 / 8;
    if n8 == 0 {
        return Some(out);
    }
    let args = [Arg::tensor(gate_up), Arg::I32((inter / 8) as i32), Arg::tensor(&out), Arg::I64(n8)];
    let grid = u32::try_from((n8 + 255) / 256).ok()?;
    k.launch(&k.silu_mul, gate_up.device(), grid, 256, &args)?;
    Some(out)
}

/// Per-head RMSNorm (when `weight` is given) and RoPE of `x` `[B, S, heads, dim]` (last two dimensions packed, as
/// the heads sliced out of a stacked q/k/v projection are), with `cos`/`ssin` of [`super::layers::Rope::cos_sin`]
/// for the S positions (`S * dim` elements each, broadcast over batch and heads). Returns a contiguous
/// `[B, S, heads, dim]`.
pub fn norm_rope(x: &Tensor, weight: Option<&Tensor>, eps: f64, cos: &Tensor, ssin: &Tensor) -> Option<Tensor> {
    let &[b, s, heads, dim] = x.size().as_slice() else {
        return None;
    };
    let st = x.stride();
    let packed = st[3] == 1 && st[2] == dim && st[0] == s * st[1];
    let factors_fit = [cos, ssin].iter().all(|f| applies(f) && f.is_contiguous() && f.numel() as i64 == s * dim);
    let weight_fits = weight.is_none_or(|w| applies(w) && w.is_contiguous() && w.size() == [dim]);
    if !applies(x) || !packed || !factors_fit || !weight_fits || dim % 2 != 0 || dim > 256 || s == 0 {
        return None;
    }
    let k = kernels(x.device())?;
    let out = Tensor::empty([b, s, heads, dim], (Kind::BFloat16, x.device()));
    let rows = b * s * heads;
    if rows == 0 {
        return Some(out);
    }
    let args = [
        Arg::tensor(x),
        Arg::I64(st[1]),
        Arg::I32(heads as i32),
        Arg::I32(dim as i32),
        weight.map_or(Arg::Ptr(0), Arg::tensor),
        Arg::F32(eps as f32),
        Arg::tensor(cos),
        Arg::tensor(ssin),
        Arg::I32(s as i32),
        Arg::tensor(&out),
        Arg::I64(rows),
    ];
    let warps_per_block = 8i64;
    let grid = u32::try_from((rows + warps_per_block - 1) / warps_per_block).ok()?;
    k.launch(&k.norm_rope, x.device(), grid, 32 * warps_per_block as u32, &args)?;
    Some(out)
}

/// Attention probabilities `softmax(scale * scores + bias)` over the last dimension of f32 `scores` `[.., rows, keys]`
/// (contiguous), with the additive bf16 mask `bias` (contiguous, `[.., bias_rows, keys]`, its rows repeating over
/// the scores' rows), accumulated in f32 and returned in bf16, in one pass where libtorch takes four.
pub fn masked_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> Option<Tensor> {
    let keys = *scores.size().last()?;
    let on_gpu = matches!(scores.device(), Device::Cuda(_)) && bias.device() == scores.device();
    if !on_gpu || scores.kind() != Kind::Float || !applies(bias) || scores.requires_grad() {
        return None;
    }
    if !scores.is_contiguous() || !bias.is_contiguous() || *bias.size().last()? != keys || keys == 0 {
        return None;
    }
    let (rows, bias_rows) = (scores.numel() as i64 / keys, bias.numel() as i64 / keys);
    if rows % bias_rows != 0 {
        return None;
    }
    let k = kernels(scores.device())?;
    let out = Tensor::empty(scores.size(), (Kind::BFloat16, scores.device()));
    let args = [
        Arg::tensor(scores),
        Arg::I32(i32::try_from(keys).ok()?),
        Arg::tensor(bias),
        Arg::I32(i32::try_from(bias_rows).ok()?),
        Arg::F32(scale as f32),
        Arg::tensor(&out),
    ];
    k.launch(&k.masked_softmax, scores.device(), u32::try_from(rows).ok()?, 256, &args)?;
    Some(out)
}

/// `(rows, vocab)` of logits the row kernels take (bf16 on a GPU, contiguous, `vocab % 8 == 0`, at least one row).
fn vocab_rows(logits: &Tensor) -> Option<(i64, i64)> {
    let &[rows, vocab] = logits.size().as_slice() else {
        return None;
    };
    let taken = applies(logits) && logits.is_contiguous() && vocab % 8 == 0 && vocab <= i32::MAX as i64 && rows > 0;
    taken.then_some((rows, vocab))
}

/// Whether `t` is a contiguous `shape` of `kind` on `device`.
fn fits(t: &Tensor, kind: Kind, device: Device, shape: &[i64]) -> bool {
    t.kind() == kind && t.device() == device && t.is_contiguous() && t.size() == shape
}

/// What the LM head's loss needs of the softmax of each row, from [`softmax_rows`].
pub struct RowSoftmax {
    /// `[rows, 4]` f32: the largest logit, the label's logit, the probability at the argmax, and the summed
    /// probability of every token but the label (each probability rounded to bf16 first).
    pub stats: Tensor,
    /// `[rows]` i64: the first index of the largest logit.
    pub argmax: Tensor,
}

/// The softmax statistics of each row of bf16 `logits` `[rows, vocab]` (contiguous, `vocab % 8 == 0`) against
/// `labels` (i64) and loss weights `weights` (f32). With `want_grad`, `logits` is overwritten by the gradient of the
/// weighted cross-entropy, `(softmax - onehot) * w`, with the label's entry `-(rest * w)` from the precise sum.
pub fn softmax_rows(logits: &mut Tensor, labels: &Tensor, weights: &Tensor, want_grad: bool) -> Option<RowSoftmax> {
    let (rows, vocab) = vocab_rows(logits)?;
    let device = logits.device();
    if !fits(labels, Kind::Int64, device, &[rows]) || !fits(weights, Kind::Float, device, &[rows]) {
        return None;
    }
    let stats = Tensor::empty([rows, 4], (Kind::Float, device));
    let argmax = launch_row_kernel(|k| &k.softmax_rows, logits, (rows, vocab), labels, weights, want_grad, &stats)?;
    Some(RowSoftmax { stats, argmax })
}

/// Launches a row kernel (`softmax_rows`, `kl_rows`: one block of 1024 threads a row of `logits [rows, vocab]`) with
/// its per-row `input`, the loss weights and `want_grad`; it writes `out`, and the argmax of each row returned.
fn launch_row_kernel(
    kernel: fn(&Kernels) -> &CudaFunction,
    logits: &Tensor,
    (rows, vocab): (i64, i64),
    input: &Tensor,
    weights: &Tensor,
    want_grad: bool,
    out: &Tensor,
) -> Option<Tensor> {
    let device = logits.device();
    let k = kernels(device)?;
    let argmax = Tensor::empty([rows], (Kind::Int64, device));
    let args = [
        Arg::tensor(logits),
        Arg::I32(i32::try_from(vocab).ok()?),
        Arg::tensor(input),
        Arg::tensor(weights),
        Arg::I32(i32::from(want_grad)),
        Arg::tensor(out),
        Arg::tensor(&argmax),
    ];
    k.launch(kernel(&k), device, u32::try_from(rows).ok()?, 1024, &args)?;
    Some(argmax)
}

/// What the LM head's distillation loss needs of each row, from [`kl_rows`].
pub struct RowKl {
    /// `[rows]` f32: `KL(softmax(target) || softmax(logits))`.
    pub loss: Tensor,
    /// `[rows]` i64: the first index of the drafter's largest logit.
    pub argmax: Tensor,
}

/// The KL divergence of each row of bf16 `logits` `[rows, vocab]` from the target's `target` (the same shape; both
/// contiguous, `vocab % 8 == 0`), from both log-softmaxes in f32. With `want_grad`, `logits` is overwritten by the
/// gradient of the loss weighted by `weights` (f32 `[rows]`), `(softmax(logits) - softmax(target)) * w`.
pub fn kl_rows(logits: &mut Tensor, target: &Tensor, weights: &Tensor, want_grad: bool) -> Option<RowKl> {
    let (rows, vocab) = vocab_rows(logits)?;
    let device = logits.device();
    let target_fits = fits(target, Kind::BFloat16, device, &[rows, vocab]) && !target.requires_grad();
    if !target_fits || !fits(weights, Kind::Float, device, &[rows]) {
        return None;
    }
    let loss = Tensor::empty([rows], (Kind::Float, device));
    let argmax = launch_row_kernel(|k| &k.kl_rows, logits, (rows, vocab), target, weights, want_grad, &loss)?;
    Some(RowKl { loss, argmax })
}

/// The next token of each row of bf16 `logits` `[rows, vocab]` (contiguous), drawn as
/// [`pick_tokens`](super::sampling::pick_tokens) draws it from the rows' `temperatures` and `top_ps` (f32 `[rows]`;
/// temperature 0: greedy) and their `seeds` and `steps` (i64 `[rows]`), in one kernel where libtorch takes about ten
/// passes over `[rows, vocab]` and a sort: `[rows]` i64, the same tokens but where a nucleus's edge falls within
/// f32 rounding of `top_p` (its sums are added in another order).
pub fn sample_rows(
    logits: &Tensor,
    temperatures: &Tensor,
    top_ps: &Tensor,
    seeds: &Tensor,
    steps: &Tensor,
) -> Option<Tensor> {
    let &[rows, vocab] = logits.size().as_slice() else {
        return None;
    };
    let device = logits.device();
    let taken = applies(logits) && logits.is_contiguous() && rows > 0 && vocab > 0;
    let per_row = [(temperatures, Kind::Float), (top_ps, Kind::Float), (seeds, Kind::Int64), (steps, Kind::Int64)];
    if !taken || !per_row.iter().all(|(t, kind)| fits(t, *kind, device, &[rows])) {
        return None;
    }
    let k = kernels(device)?;
    let tokens = Tensor::empty([rows], (Kind::Int64, device));
    let args = [
        Arg::tensor(logits),
        Arg::I32(i32::try_from(vocab).ok()?),
        Arg::tensor(temperatures),
        Arg::tensor(top_ps),
        Arg::tensor(seeds),
        Arg::tensor(steps),
        Arg::tensor(&tokens),
    ];
    k.launch(&k.sample_rows, device, u32::try_from(rows).ok()?, 1024, &args)?;
    Some(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::RopeScaling;
    use crate::model::layers::{Rope, apply_rope, rms_norm};

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a.to_kind(Kind::Float) - b.to_kind(Kind::Float)).abs().max().double_value(&[])
    }

    /// On a GPU: the fused kernels run (the test fails if they cannot be built) and agree with the plain libtorch
    /// expressions within one bf16 rounding.
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_fused_kernels_match_plain_libtorch() {
        let dev = crate::device::gpu_for_tests();
        let bf = (Kind::BFloat16, dev);
        // SwiGLU activation: odd row count, several blocks.
        let gu = (Tensor::randn([3, 37, 2 * 200], (Kind::Float, dev)) * 4.0).to_kind(Kind::BFloat16);
        let fused = silu_mul(&gu).expect("the fused SwiGLU kernel ran");
        let plain = gu.narrow(-1, 0, 200).silu() * gu.narrow(-1, 200, 200);
        assert!(max_diff(&fused, &plain) <= plain.abs().max().double_value(&[]) / 128.0);
        let mismatched = fused.ne_tensor(&plain).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
        assert!(mismatched < 0.01, "{mismatched} of the elements differ");
        // Norm and RoPE of q and k sliced out of a stacked projection, with and without the norm, head sizes 128 and
        // 64 (pairs spread over lanes differently).
        for (heads, kv_heads, d) in [(4i64, 2i64, 128i64), (3, 1, 64)] {
            let (b, s) = (2, 33);
            let rope = Rope::new(10000.0, d as usize, RopeScaling::None, dev);
            let positions = Tensor::arange_start(5, 5 + s, (Kind::Int64, dev));
            let (cos, ssin) = rope.cos_sin(&positions, Kind::BFloat16);
            let (cos, ssin) = (cos.unsqueeze(0).unsqueeze(2), ssin.unsqueeze(0).unsqueeze(2));
            let qkv = (Tensor::randn([b, s, (heads + 2 * kv_heads) * d], (Kind::Float, dev)) * 3.0).to_kind(bf.0);
            let weight = (Tensor::rand([d], (Kind::Float, dev)) + 0.5).to_kind(bf.0);
            for (start, count) in [(0, heads), (heads * d, kv_heads)] {
                let x = qkv.narrow(-1, start, count * d).view([b, s, count, d]);
                for w in [Some(&weight), None] {
                    let fused = norm_rope(&x, w, 1e-6, &cos, &ssin).expect("the fused norm-rope kernel ran");
                    let normed = w.map(|w| rms_norm(&x, w, 1e-6));
                    let plain = apply_rope(normed.as_ref().unwrap_or(&x), &cos, &ssin);
                    let scale = plain.abs().max().double_value(&[]);
                    let err = max_diff(&fused, &plain);
                    assert!(err <= scale / 64.0, "d {d} norm {}: max difference {err} of {scale}", w.is_some());
                    assert!(fused.is_contiguous() && fused.size() == x.size());
                }
            }
        }
    }

    /// NVRTC ships with the torch wheel and compiles without a GPU, so a CPU machine checks the kernels' source.
    #[test]
    fn the_kernels_compile() {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: NVRTC not found");
            return;
        }
        let ptx = compile().unwrap().to_src();
        for entry in ["norm_rope", "silu_mul", "softmax_rows", "kl_rows", "masked_softmax", "sample_rows"] {
            assert!(ptx.contains(&format!(".entry {entry}(")), "{entry} missing from the PTX");
        }
    }

    #[test]
    fn nothing_applies_on_the_cpu() {
        let gu = Tensor::ones([4, 32], (Kind::BFloat16, Device::Cpu));
        assert!(silu_mul(&gu).is_none());
        let x = Tensor::ones([1, 2, 3, 8], (Kind::BFloat16, Device::Cpu));
        let f = Tensor::ones([2, 8], (Kind::BFloat16, Device::Cpu));
        assert!(norm_rope(&x, None, 1e-6, &f, &f).is_none());
        let (logits, w) =
            (Tensor::ones([2, 8], (Kind::BFloat16, Device::Cpu)), Tensor::ones([2], (Kind::Float, Device::Cpu)));
        assert!(kl_rows(&mut logits.copy(), &logits, &w, true).is_none());
        let ids = Tensor::zeros([2], (Kind::Int64, Device::Cpu));
        assert!(sample_rows(&logits, &w, &w, &ids, &ids).is_none());
    }
}
