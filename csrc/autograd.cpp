// Autograd functions whose backward libtorch's generic one does worse: each saves less for the backward pass (the
// drafter's activation memory) and writes its input gradient in one buffer. Forward and backward use the same ATen
// kernels, with the same roundings, as the plain expressions they replace, so results are unchanged.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "shim_error.h"

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// `[a, b] -> [b, a]` over the last dimension (halves swapped): a permutation that is its own inverse.
at::Tensor swap_halves(const at::Tensor& x) {
  auto half = x.size(-1) / 2;
  return x.unflatten(-1, {2, half}).flip({-2}).flatten(-2, -1);
}

// HF's rotate-half RoPE, `x * cos + rotate_half(x) * sin`, written `x * cos + swap(x) * ssin` with
// `ssin = [-sin, sin]`. It is linear in x, so the backward needs only the factors (the plain expression keeps x and
// its swapped copy alive): dx = g * cos + swap(g * ssin) = g * cos - swap(g) * ssin, since swap(ssin) = -ssin.
struct Rope : public torch::autograd::Function<Rope> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& ssin) {
    auto out = x * cos;
    out.addcmul_(swap_halves(x), ssin);
    TORCH_CHECK(out.sizes() == x.sizes(), "rope factors of shape ", cos.sizes(), " do not broadcast to ",
                x.sizes());
    ctx->save_for_backward({cos, ssin});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& g = grads[0];
    auto dx = g * saved[0];
    dx.addcmul_(swap_halves(g), saved[1], -1);
    return {dx, at::Tensor(), at::Tensor()};
  }
};

// The SwiGLU activation `silu(gate) * up` of a stacked projection `[..., 2I]` (gate first). The plain expression
// keeps silu(gate) (half the projection's size) for the backward and sums two zero-padded gradients of the halves;
// this keeps only the projection, recomputes silu(gate) and writes both halves of the gradient in place.
struct SwigluActivation : public torch::autograd::Function<SwigluActivation> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    auto inter = gate_up.size(-1) / 2;
    auto out = at::silu(gate_up.narrow(-1, 0, inter));
    out.mul_(gate_up.narrow(-1, inter, inter));
    ctx->save_for_backward({gate_up});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto gate_up = ctx->get_saved_variables()[0];
    auto inter = gate_up.size(-1) / 2;
    auto gate = gate_up.narrow(-1, 0, inter);
    auto up = gate_up.narrow(-1, inter, inter);
    const auto& g = grads[0];
    auto d = at::empty_like(gate_up, at::MemoryFormat::Contiguous);
    auto d_gate = d.narrow(-1, 0, inter);
    auto d_up = d.narrow(-1, inter, inter);
    at::silu_backward_out(d_gate, g * up, gate);
    at::mul_out(d_up, g, at::silu(gate));
    return {d};
  }
};

// `down(silu(gate) * up)`: the activation is recomputed in the backward rather than kept for the down projection's
// weight gradient (with SwigluActivation's saving, each MLP keeps only its stacked projection).
struct SwigluDown : public torch::autograd::Function<SwigluDown> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up, const at::Tensor& down) {
    auto inter = gate_up.size(-1) / 2;
    auto act = at::silu(gate_up.narrow(-1, 0, inter));
    act.mul_(gate_up.narrow(-1, inter, inter));
    ctx->save_for_backward({gate_up, down});
    return at::linear(act, down);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& gate_up = saved[0];
    const auto& down = saved[1];
    auto inter = gate_up.size(-1) / 2;
    auto gate = gate_up.narrow(-1, 0, inter);
    auto up = gate_up.narrow(-1, inter, inter);
    const auto& g = grads[0];
    auto silu = at::silu(gate);
    at::Tensor d_down;
    {
      auto act = silu * up;
      d_down = g.reshape({-1, g.size(-1)}).t().mm(act.reshape({-1, inter}));
    }
    auto d_act = g.matmul(down);
    auto d = at::empty_like(gate_up, at::MemoryFormat::Contiguous);
    auto d_gate = d.narrow(-1, 0, inter);
    auto d_up = d.narrow(-1, inter, inter);
    at::mul_out(d_up, d_act, silu);
    d_act.mul_(up);
    at::silu_backward_out(d_gate, d_act, gate);
    return {d, d_down};
  }
};

// The compute-dtype copy of a master-weight leaf whose `.grad` is preset to a slice of the flat fp32 gradient
// buffer. Its backward adds the compute-dtype gradient into that slice in one kernel (the fp32 sum of the same
// values), where the generic cast would first materialise an fp32 copy of the gradient and then add it.
struct WeightCast : public torch::autograd::Function<WeightCast> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& leaf, int64_t kind) {
    ctx->saved_data["leaf"] = leaf;
    return leaf.to(static_cast<at::ScalarType>(kind));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto leaf = ctx->saved_data["leaf"].toTensor();
    const auto& g = grads[0];
    auto& accumulated = leaf.mutable_grad();
    if (!g.defined()) return {at::Tensor(), at::Tensor()};
    if (accumulated.defined()) {
      accumulated.add_(g);
      return {at::Tensor(), at::Tensor()};
    }
    return {g.to(leaf.scalar_type()), at::Tensor()};
  }
};

template <typename F>
at::Tensor* guarded(F&& f, char* err, size_t len) {
  return guard(nullptr, err, len, [&] { return new at::Tensor(f()); });
}
}  // namespace

extern "C" {

// A new tensor, or null with the message in `err`.
at::Tensor* dflash_rope(const at::Tensor* x, const at::Tensor* cos, const at::Tensor* ssin, char* err, size_t len) {
  return guarded([&] { return Rope::apply(*x, *cos, *ssin); }, err, len);
}

at::Tensor* dflash_swiglu_activation(const at::Tensor* gate_up, char* err, size_t len) {
  return guarded([&] { return SwigluActivation::apply(*gate_up); }, err, len);
}

at::Tensor* dflash_swiglu_down(const at::Tensor* gate_up, const at::Tensor* down, char* err, size_t len) {
  return guarded([&] { return SwigluDown::apply(*gate_up, *down); }, err, len);
}

// `kind` is a c10::ScalarType code (tch's Kind::c_int).
at::Tensor* dflash_weight_cast(const at::Tensor* leaf, int kind, char* err, size_t len) {
  return guarded([&] { return WeightCast::apply(*leaf, static_cast<int64_t>(kind)); }, err, len);
}

}  // extern "C"
