// What tch does not expose, through libtorch's device-agnostic API (no CUDA headers needed): binding the calling
// thread to a device, synchronizing it, the caching allocator's statistics, timing events recorded on the thread's
// current stream, presetting a tensor's `.grad` (so gradients accumulate into a flat buffer), the fused AdamW
// kernel and Muon's update. Tensors cross the boundary as `at::Tensor*`, which is what tch's C API hands out.
// Every function catches C++ exceptions and reports them as a message, never unwinding into Rust.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/empty.h>
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

// One Muon step of one 2-D parameter, as torch.optim.Muon 2.11 writes it (`_single_tensor_muon` with Nesterov and
// `_zeropower_via_newtonschulz`), op for op: the gradient is `grad / grad_divisor`, `buf` its momentum buffer;
// `adjusted_lr` is the learning rate scaled for the parameter's shape, weight decay uses the unadjusted one.
int dflash_muon_step(at::Tensor* param, at::Tensor* grad, at::Tensor* buf, double grad_divisor, double lr,
                     double adjusted_lr, double weight_decay, double momentum, double a, double b, double c,
                     int ns_steps, double eps, char* err, size_t len) {
  return guard(1, err, len, [&] {
    c10::NoGradGuard no_grad;
    at::Tensor g = grad->div(grad_divisor);
    buf->lerp_(g, 1 - momentum);
    at::Tensor update = g.lerp(*buf, momentum);
    at::Tensor x = update.to(at::kBFloat16);
    const bool tall = update.size(0) > update.size(1);
    if (tall) x = x.t();
    x.div_(x.norm().clamp_min(eps));
    for (int i = 0; i < ns_steps; ++i) {
      at::Tensor gram = at::matmul(x, x.t());
      at::Tensor gram_update = at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
      x = at::addmm(x, gram_update, x, /*beta=*/a);
    }
    if (tall) x = x.t();
    param->mul_(1 - lr * weight_decay);
    param->add_(x, -adjusted_lr);
    return 0;
  });
}

}  // extern "C"
