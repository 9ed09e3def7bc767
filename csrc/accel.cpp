// What tch does not expose, through libtorch's device-agnostic API (no CUDA headers needed): binding the calling
// thread to a device, synchronizing it, the caching allocator's statistics, timing events recorded on the thread's
// current stream, presetting a tensor's `.grad` (so gradients accumulate into a flat buffer), the fused AdamW
// kernel and Muon's update (orthogonalised in batches of one shape). Tensors cross the boundary as `at::Tensor*`, which is what tch's C API hands out.
// Every function catches C++ exceptions and reports them as a message, never unwinding into Rust.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_lerp.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/stack.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <vector>

#include "shim_error.h"

extern "C" {

// Process-wide: libtorch's deterministic algorithms (an operation without a deterministic kernel raises).
int dflash_set_deterministic(int on, char* err, size_t len) {
  return guard(1, err, len, [&] {
    at::globalContext().setDeterministicAlgorithms(on != 0, false);
    return 0;
  });
}

int dflash_set_device(int index, char* err, size_t len) {
  return guard(1, err, len, [&] {
    at::accelerator::setDeviceIndex(static_cast<c10::DeviceIndex>(index));
    return 0;
  });
}

// Moves the calling thread onto a stream of the device's pool (until then it launches on the default stream, shared
// by every thread of the process); a high-priority stream's blocks are dispatched before pending normal ones.
int dflash_use_pool_stream(int index, int high_priority, char* err, size_t len) {
  return guard(1, err, len, [&] {
    auto type = at::accelerator::getAccelerator(true).value();
    c10::Device device(type, static_cast<c10::DeviceIndex>(index));
    const auto* impl = c10::impl::getDeviceGuardImpl(type);
    impl->exchangeStream(impl->getStreamFromGlobalPool(device, high_priority != 0));
    return 0;
  });
}

// The native handle (a `cudaStream_t`) of the calling thread's current stream on device `index`, for kernels launched
// outside libtorch that must stay ordered with its work.
int dflash_current_stream(int index, void** out, char* err, size_t len) {
  return guard(1, err, len, [&] {
    *out = at::accelerator::getCurrentStream(static_cast<c10::DeviceIndex>(index)).native_handle();
    return 0;
  });
}

// The calling thread's current device index (-1 on failure).
int dflash_current_device(char* err, size_t len) {
  return guard(-1, err, len, [&] {
    return static_cast<int>(at::accelerator::getDeviceIndex());
  });
}

int dflash_synchronize(int index, char* err, size_t len) {
  return guard(1, err, len, [&] {
    at::accelerator::synchronizeDevice(static_cast<c10::DeviceIndex>(index));
    return 0;
  });
}

// Waits for the work queued on the calling thread's current stream of device `index` only.
int dflash_synchronize_stream(int index, char* err, size_t len) {
  return guard(1, err, len, [&] {
    at::accelerator::getCurrentStream(static_cast<c10::DeviceIndex>(index)).synchronize();
    return 0;
  });
}

// out: [allocated, peak allocated, reserved, free on device, total on device]
// The accelerator's runtime and caching allocator start lazily, at the first tensor on the device: before that
// the allocator refuses statistics ("Invalid device argument ... did you call init?"), as for a target loaded from
// files on a fresh thread. Starting them here is what that first tensor would do.
static void start_accelerator() {
  at::globalContext().lazyInitDevice(at::accelerator::getAccelerator(true).value());
}

int dflash_memory_stats(int index, int64_t* out, char* err, size_t len) {
  return guard(1, err, len, [&] {
    start_accelerator();
    auto idx = static_cast<c10::DeviceIndex>(index);
    auto stats = at::accelerator::getDeviceStats(idx);
    auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[all].current;
    out[1] = stats.allocated_bytes[all].peak;
    out[2] = stats.reserved_bytes[all].current;
    auto info = at::accelerator::getMemoryInfo(idx);
    out[3] = static_cast<int64_t>(info.first);
    out[4] = static_cast<int64_t>(info.second);
    return 0;
  });
}

int dflash_reset_peak_memory(int index, char* err, size_t len) {
  return guard(1, err, len, [&] {
    start_accelerator();
    at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
    return 0;
  });
}

// A timing event on device `index`; null on failure.
void* dflash_event_new(int index, char* err, size_t len) {
  return guard(nullptr, err, len, [&] {
    (void)index;
    return new c10::Event(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  });
}

int dflash_event_record(void* event, int index, char* err, size_t len) {
  return guard(1, err, len, [&] {
    auto stream = at::accelerator::getCurrentStream(static_cast<c10::DeviceIndex>(index));
    static_cast<c10::Event*>(event)->record(stream);
    return 0;
  });
}

// Milliseconds from `start` to `end`; both must have completed (synchronize first).
int dflash_event_elapsed_ms(void* start, void* end, double* ms, char* err, size_t len) {
  return guard(1, err, len, [&] {
    *ms = static_cast<c10::Event*>(start)->elapsedTime(*static_cast<c10::Event*>(end));
    return 0;
  });
}

// An uninitialised host tensor shaped like `like`, in page-locked memory (from libtorch's caching host allocator, so repeated snapshots
// reuse it): device-to-host copies into it run at full bus speed, where pageable memory is staged in small pieces.
at::Tensor* dflash_empty_pinned_like(const at::Tensor* like, char* err, size_t len) {
  return guard(nullptr, err, len, [&] {
    auto options = at::TensorOptions().dtype(like->scalar_type()).device(at::kCPU).pinned_memory(true);
    return new at::Tensor(at::empty(like->sizes(), options));
  });
}

// Whether the event's recorded work has completed (never blocks).
int dflash_event_query(void* event, int* done, char* err, size_t len) {
  return guard(1, err, len, [&] {
    *done = static_cast<c10::Event*>(event)->query() ? 1 : 0;
    return 0;
  });
}

void dflash_event_free(void* event) { delete static_cast<c10::Event*>(event); }

// Makes `grad` the `.grad` of `param`; autograd then accumulates into it in place.
int dflash_set_grad(at::Tensor* param, at::Tensor* grad, char* err, size_t len) {
  return guard(1, err, len, [&] {
    param->mutable_grad() = *grad;
    return 0;
  });
}

// One AdamW step (decoupled weight decay) over `count` parameter tensors (the flat buffer, or views of it) with their
// gradients and moments; `step` (float32, same device) must already count this step and serves every tensor.
// Gradients are divided by `grad_scale` (nullable) inside the kernel.
int dflash_fused_adamw(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs, at::Tensor** exp_avg_sqs,
                       size_t count, at::Tensor* step, double lr, double beta1, double beta2, double weight_decay,
                       double eps, at::Tensor* grad_scale, char* err, size_t len) {
  return guard(1, err, len, [&] {
    std::optional<at::Tensor> scale;
    if (grad_scale != nullptr) scale = *grad_scale;
    std::vector<at::Tensor> p, g, m, v, steps;
    for (size_t i = 0; i < count; ++i) {
      p.push_back(*params[i]);
      g.push_back(*grads[i]);
      m.push_back(*exp_avgs[i]);
      v.push_back(*exp_avg_sqs[i]);
      steps.push_back(*step);
    }
    at::_fused_adamw_(p, g, m, v, {}, steps, lr, beta1, beta2, weight_decay, eps, /*amsgrad=*/false,
                      /*maximize=*/false, scale, std::nullopt);
    return 0;
  });
}

}  // extern "C"

// Gram Newton-Schulz (Dao lab, 2026; DeepSpeed 0.19's `zeropower_via_gram_newtonschulz`): Newton-Schulz's quintic
// X <- (a I + b R + c R^2) X with R = X X^T, iterated on the small square R of each wide matrix `x` [count, short,
// long] instead of on x itself. Q accumulates the polynomials (X_k = Q X_0) and R follows as R <- (aI + Z)^2 R, Z
// being a polynomial in R; one restart at iteration 2 forms X and R afresh, which keeps half precision stable. The
// long side enters only in the first Gram matrix, the restart and the last product: 8 s^2 l + 28 s^3 FLOPs for five
// steps where Newton-Schulz takes 20 s^2 l + 10 s^3 (a quarter fewer for the MLP's 3:1 matrices).
static at::Tensor gram_newton_schulz(at::Tensor x, double a, double b, double c, int steps) {
  constexpr int restart = 2;
  at::Tensor r = at::matmul(x, x.transpose(1, 2));
  at::Tensor q;
  for (int i = 0; i < steps; ++i) {
    if (i == restart) {
      x = at::matmul(q, x);
      r = at::matmul(x, x.transpose(1, 2));
      q = at::Tensor();
    }
    at::Tensor z = at::baddbmm(r, r, r, /*beta=*/b, /*alpha=*/c);
    if (q.defined()) {
      q = at::baddbmm(q, z, q, /*beta=*/a);
    } else {
      q = z.clone();
      q.diagonal(0, 1, 2).add_(a);
    }
    if (i + 1 < steps && i + 1 != restart) {
      at::Tensor rz = at::baddbmm(r, z, r, /*beta=*/a);
      r = at::baddbmm(rz, z, rz, /*beta=*/a);
    }
  }
  return q.defined() ? at::matmul(q, x) : x;
}

extern "C" {

// Muon's momentum for `count` 2-D parameters of one shape, as torch.optim.Muon 2.11 writes it (`_single_tensor_muon`
// with Nesterov): each gradient is `grad / grad_divisor`, `bufs[i]` its momentum buffer, updated in place. With `out`
// non-null the Nesterov updates are also orthogonalised as one batch of matrix products, each matrix normalised by
// its own norm, and `*out` is the result in bf16, [count, rows, cols] in the parameters' orientation: by
// `_zeropower_via_newtonschulz`, op for op, in bf16; or, with `gram` and matrices not square, by Gram Newton-Schulz
// (gram_newton_schulz below).
int dflash_muon_orthogonalize(at::Tensor** grads, at::Tensor** bufs, size_t count, double grad_divisor,
                              double momentum, double a, double b, double c, int ns_steps, double eps, int gram,
                              at::Tensor** out, char* err, size_t len) {
  return guard(1, err, len, [&] {
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> g, m;
    for (size_t i = 0; i < count; ++i) {
      g.push_back(grads[i]->div(grad_divisor));
      m.push_back(*bufs[i]);
    }
    at::_foreach_lerp_(m, g, 1 - momentum);
    if (out == nullptr) return 0;
    at::_foreach_lerp_(g, m, momentum);
    const bool tall = g[0].size(0) > g[0].size(1);
    const bool wide_gram = gram != 0 && g[0].size(0) != g[0].size(1);
    std::vector<at::Tensor> stacked;
    // Gram's iteration normalises before its cast to fp16 (whose range a gradient can leave); Muon's casts first.
    for (const auto& update : g) stacked.push_back(wide_gram ? update.to(at::kFloat) : update.to(at::kBFloat16));
    g.clear();
    at::Tensor x = at::stack(stacked);
    stacked.clear();
    if (tall) x = x.transpose(1, 2);
    x.div_(at::linalg_vector_norm(x, 2, at::IntArrayRef{1, 2}, /*keepdim=*/true).clamp_min(eps));
    if (wide_gram) {
      x = gram_newton_schulz(x.to(at::kHalf), a, b, c, ns_steps).to(at::kBFloat16);
    } else {
      for (int i = 0; i < ns_steps; ++i) {
        at::Tensor gram_matrix = at::matmul(x, x.transpose(1, 2));
        at::Tensor gram_update = at::baddbmm(gram_matrix, gram_matrix, gram_matrix, /*beta=*/b, /*alpha=*/c);
        x = at::baddbmm(x, gram_update, x, /*beta=*/a);
      }
    }
    if (tall) x = x.transpose(1, 2);
    *out = new at::Tensor(x);
    return 0;
  });
}

// Muon's step of `count` 2-D parameters of one shape from their orthogonalised updates (`updates[i]`, bf16): each
// parameter decays by `1 - lr * weight_decay` (the unadjusted rate), then steps by `-adjusted_lr` times its update.
int dflash_muon_apply(at::Tensor** params, at::Tensor** updates, size_t count, double lr, double weight_decay,
                      double adjusted_lr, char* err, size_t len) {
  return guard(1, err, len, [&] {
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> p, u;
    for (size_t i = 0; i < count; ++i) {
      p.push_back(*params[i]);
      u.push_back(*updates[i]);
    }
    at::_foreach_mul_(p, 1 - lr * weight_decay);
    at::_foreach_add_(p, u, -adjusted_lr);
    return 0;
  });
}

}  // extern "C"
