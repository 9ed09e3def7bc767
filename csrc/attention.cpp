// Attention on the GPU through libtorch's flash-attention kernel where the public SDPA entry does not reach it:
// GPT-OSS's (a sliding window, and the log-sum-exp it does not return), and packed rows (variable-length sequences
// one after the other, which SDPA could only take as an explicit mask, leaving the flash kernel out).
//
// For GPT-OSS, the sink (one logit per head that takes part in the softmax and adds no value) is folded in
// afterwards: with `lse` the log-sum-exp of a query's scaled scores, softmax over [scores, sink] scales the plain
// output by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink).
#include <ATen/ATen.h>
#include <ATen/ops/_flash_attention_forward.h>

#include "shim_error.h"

extern "C" {

// q [B, T, H, d], k and v [B, T, KV, d] (the same positions; grouped-query heads as they are), sinks [H]; causal,
// and with window > 0 each query sees itself and the window - 1 positions before it. Returns [B, T, H, d], or null
// with the message in `err`.
at::Tensor* dflash_sink_flash_attention(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v,
                                        const at::Tensor* sinks, int64_t window, char* err, size_t len) {
  return guard(static_cast<at::Tensor*>(nullptr), err, len, [&] {
    std::optional<int64_t> left, right;
    if (window > 0) {
      left = window - 1;
      right = 0;
    }
    auto result = at::_flash_attention_forward(*q, *k, *v, std::nullopt, std::nullopt, q->size(1), k->size(1), 0.0,
                                               /*is_causal=*/true, /*return_debug_mask=*/false, std::nullopt, left,
                                               right);
    auto out = std::get<0>(result);
    const auto& lse = std::get<1>(result);  // [B, H, T], f32
    auto keep = at::sigmoid(lse - sinks->to(at::kFloat).view({1, -1, 1}));
    out.mul_(keep.transpose(1, 2).unsqueeze(-1).to(out.scalar_type()));
    return new at::Tensor(std::move(out));
  });
}

// Causal attention within each of the sequences laid one after the other in q [N, H, d], k and v [N, KV, d]
// (grouped-query heads as they are): sequence i holds positions cu_seqlens[i] .. cu_seqlens[i + 1] (int32, on q's
// device, the last entry N), the longest `longest` tokens; no position sees another sequence's. Returns [N, H, d],
// or null with the message in `err`.
at::Tensor* dflash_varlen_flash_attention(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v,
                                          const at::Tensor* cu_seqlens, int64_t longest, char* err, size_t len) {
  return guard(static_cast<at::Tensor*>(nullptr), err, len, [&] {
    auto result = at::_flash_attention_forward(*q, *k, *v, *cu_seqlens, *cu_seqlens, longest, longest, 0.0,
                                               /*is_causal=*/true, /*return_debug_mask=*/false);
    return new at::Tensor(std::move(std::get<0>(result)));
  });
}

}  // extern "C"
