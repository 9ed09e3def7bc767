// DFlash's training attention as one autograd node around the staircase kernels (src/model/staircase.cu), which the
// Rust side compiles and launches through the function it passes in: this file fills the kernels' argument block,
// allocates their outputs and keeps what the backward needs (the inputs, the output and one log-sum-exp per query
// row: O(tokens), where the grouped attention it replaces kept each group's keys and values).
#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <torch/csrc/autograd/custom_function.h>

#include <initializer_list>
#include <vector>

#include "kernel_args.h"
#include "shim_error.h"

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Launches kernel `kernel` (0 forward, 1 dQ, 2 dK and dV) on `stream`; `outputs` in the kernel's order. 0 on success,
// else the message in `err`.
typedef int (*Launch)(int kernel, int device, int head_dim, int batch, void* stream, const StaircaseArgs* args,
                      void* const* outputs, char* err, size_t len);

StaircaseArgs args_of(const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx, const at::Tensor& k_blk,
                      const at::Tensor& v_blk, const at::Tensor& lo, const at::Tensor& hi, bool causal, int64_t window,
                      double scale) {
  TORCH_CHECK(lo.is_contiguous() && hi.is_contiguous() && lo.scalar_type() == at::kInt,
              "staircase attention: the ranges must be contiguous int32");
  // Blocks of 16 queries, or of 8 two to a warp's 16 rows.
  const int64_t queries = q.size(2), blocks = lo.size(1);
  TORCH_CHECK(queries % 16 == 0 && (queries == 16 * blocks || queries == 8 * blocks),
              "staircase attention: ", queries, " queries a row in ", blocks,
              " blocks; the kernels take blocks of 16, or an even number of blocks of 8");
  StaircaseArgs a;
  const auto bf = [](const at::Tensor& t) { return static_cast<const bf16*>(t.data_ptr()); };
  a.q = bf(q);
  a.q_b = q.stride(0), a.q_h = q.stride(1), a.q_t = q.stride(2);
  a.k_ctx = bf(k_ctx), a.v_ctx = bf(v_ctx);
  a.c_b = k_ctx.stride(0), a.c_h = k_ctx.stride(1), a.c_t = k_ctx.stride(2);
  a.cv_b = v_ctx.stride(0), a.cv_h = v_ctx.stride(1), a.cv_t = v_ctx.stride(2);
  a.k_blk = bf(k_blk), a.v_blk = bf(v_blk);
  a.k_b = k_blk.stride(0), a.k_h = k_blk.stride(1), a.k_t = k_blk.stride(2);
  a.bv_b = v_blk.stride(0), a.bv_h = v_blk.stride(1), a.bv_t = v_blk.stride(2);
  a.lo = lo.data_ptr<int32_t>(), a.hi = hi.data_ptr<int32_t>();
  a.heads = q.size(1), a.kv_heads = k_ctx.size(1), a.units = queries / 16, a.context = k_ctx.size(2);
  a.per = static_cast<int32_t>(blocks * 16 / queries);
  a.causal_block = causal ? 1 : 0;
  a.window = static_cast<int32_t>(window);
  a.scale = static_cast<float>(scale);
  return a;
}

void launch(int64_t launcher, int kernel, const at::Tensor& q, const StaircaseArgs& a, std::initializer_list<void*> outputs) {
  std::vector<void*> out(outputs);
  auto index = q.device().index();
  void* stream = at::accelerator::getCurrentStream(index).native_handle();
  char err[512] = {0};
  auto f = reinterpret_cast<Launch>(launcher);
  TORCH_CHECK(f(kernel, index, q.size(3), q.size(0), stream, &a, out.data(), err, sizeof err) == 0,
              "staircase attention: ", err);
}

struct StaircaseAttention : public torch::autograd::Function<StaircaseAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k_ctx,
                            const at::Tensor& v_ctx, const at::Tensor& k_blk, const at::Tensor& v_blk,
                            const at::Tensor& lo, const at::Tensor& hi, bool causal, int64_t window,
                            double scale, int64_t launcher) {
    auto o = at::empty(q.sizes(), q.options());
    auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    auto a = args_of(q, k_ctx, v_ctx, k_blk, v_blk, lo, hi, causal, window, scale);
    launch(launcher, 0, q, a, {o.data_ptr(), lse.data_ptr()});
    ctx->save_for_backward({q, k_ctx, v_ctx, k_blk, v_blk, lo, hi, o, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window"] = window;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["launcher"] = launcher;
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto &q = s[0], &k_ctx = s[1], &v_ctx = s[2], &k_blk = s[3], &v_blk = s[4], &lo = s[5], &hi = s[6],
               &o = s[7], &lse = s[8];
    auto causal = ctx->saved_data["causal"].toBool();
    auto window = ctx->saved_data["window"].toInt();
    auto scale = ctx->saved_data["scale"].toDouble();
    auto launcher = ctx->saved_data["launcher"].toInt();
    auto dout = grads[0].contiguous();
    // The softmax's backward term, sum over D of dO * O, in f32 from the bf16 output as flash attention takes it.
    auto drow = (dout.to(at::kFloat) * o.to(at::kFloat)).sum(-1).contiguous();
    auto dq = at::empty(q.sizes(), q.options());
    auto dk_ctx = at::empty(k_ctx.sizes(), k_ctx.options()), dv_ctx = at::empty(v_ctx.sizes(), v_ctx.options());
    auto dk_blk = at::empty(k_blk.sizes(), k_blk.options()), dv_blk = at::empty(v_blk.sizes(), v_blk.options());
    auto a = args_of(q, k_ctx, v_ctx, k_blk, v_blk, lo, hi, causal, window, scale);
    launch(launcher, 1, q, a, {dout.data_ptr(), lse.data_ptr(), drow.data_ptr(), dq.data_ptr()});
    launch(launcher, 2, q, a,
           {dout.data_ptr(), lse.data_ptr(), drow.data_ptr(), dk_ctx.data_ptr(), dv_ctx.data_ptr(),
            dk_blk.data_ptr(), dv_blk.data_ptr()});
    return {dq,          dk_ctx,      dv_ctx,      dk_blk,      dv_blk,     at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

extern "C" {

// Block queries q [B, H, bs N, D] (blocks of bs = 16, or 8 with N even) over context keys and values [B, KV, S, D]
// (block n sees [lo, hi) of its row, [B, N] int32, ascending) and block keys and values [B, KV, bs N, D] (its own;
// `causal`: those at or before each query's slot); `window` > 0: only keys fewer than that many positions from each
// query. bf16 on one GPU, every tensor's last dimension contiguous. Returns [B, H, bs N, D] recorded as one autograd
// node, or null with the message in `err`. `launcher`: the Rust function that launches the kernels.
at::Tensor* dflash_staircase_attention(const at::Tensor* q, const at::Tensor* k_ctx, const at::Tensor* v_ctx,
                                       const at::Tensor* k_blk, const at::Tensor* v_blk, const at::Tensor* lo,
                                       const at::Tensor* hi, int causal, int64_t window, double scale,
                                       void* launcher, char* err, size_t len) {
  return guard(static_cast<at::Tensor*>(nullptr), err, len, [&] {
    return new at::Tensor(StaircaseAttention::apply(*q, *k_ctx, *v_ctx, *k_blk, *v_blk, *lo, *hi, causal != 0,
                                                    window, scale, reinterpret_cast<int64_t>(launcher)));
  });
}

}  // extern "C"
