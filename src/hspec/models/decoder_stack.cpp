// The target's decoder layers for one sequence's decode or verify, in C++ (models/native.py builds it).
//
// It calls the operators that models/layers.py and models/llama.py call (ATen's, and hspec's CPU kernels,
// cpu_kernels.cpp, through the dispatcher where the model runs them), with the same arguments in the same
// order, so every result has the Python layers' bits; only the Python interpreter between the
// ~80 operators of a layer is gone (docs/fast-path.md, "The native decoder stack"). Where hspec's kernels
// run, one of them (rope_and_write) replaces the ~20 operators of RoPE and the KV writes, with their bits.
// It covers what `NativeDecoderStack.covers` admits: a chain of T new tokens per sequence (not a tree, not
// a prompt's prefill) whose T * G query rows fit one attention product (layers._ROW_BLOCK), no per-head q/k
// norm, on the CPU in a row-invariant dtype. Everything else runs the Python layers.
//
// Legend: B sequences, T new tokens, S context length (keys), S' >= S the keys read, W S rounded up to
// the key multiple, H hidden, Hq/Hkv heads, G = Hq / Hkv, D head dim, L layers.

// ATen, the dispatcher and torch's pybind11 casters, not <torch/extension.h>: the build takes ~25 s, not ~45.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include "linear_product.h"

#include <cmath>
#include <optional>
#include <vector>

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

namespace {

// The weights of one decoder layer, in the order `NativeDecoderStack` lists them; a None of Python is
// std::nullopt (no bias, a floating weight's missing scale, an unpacked weight).
constexpr int64_t kTensorsPerLayer = 15;

using hspec_native::LinearWeights;
using hspec_native::product;

// layers.linear: x (..., K) -> (..., N), in products of at most row_block rows.
Tensor linear(const Tensor& x, const LinearWeights& w, int64_t row_block) {
  const int64_t k = x.size(-1), rows = x.numel() / k;
  if (x.dim() == 2 && rows <= row_block) return product(x, w);  // the stack's own rows: no reshape either way
  const Tensor flat = x.reshape({rows, k});
  Tensor out;
  if (rows <= row_block) {
    out = product(flat, w);
  } else {
    std::vector<Tensor> blocks;
    for (int64_t start = 0; start < rows; start += row_block) {
      blocks.push_back(product(flat.slice(0, start, start + row_block), w));
    }
    out = at::cat(blocks);
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = w.weight.size(0);
  return out.reshape(shape);
}

// layers.RMSNorm without autograd, bf16 input: hspec's kernel where the model uses it, else weight * F.rms_norm(x).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, bool kernel) {
  if (kernel) {
    static auto norm = c10::Dispatcher::singleton().findSchemaOrThrow("hspec::rms_norm", "")
                           .typed<Tensor(const Tensor&, const Tensor&, double)>();
    return norm.call(x, weight, eps);
  }
  return weight * at::rms_norm(x, {x.size(-1)}, std::nullopt, eps);
}

// layers.apply_rope with cos/sin (B, T, 1, D) and the signed sin table.
Tensor apply_rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const Tensor swapped = x.unflatten(-1, {2, x.size(-1) / 2}).flip({-2}).flatten(-2);
  return x * cos + swapped * sin;
}

struct AttentionShape {
  int64_t hq, hkv, d, s, width, value_chunk, min_rows;
};

// layers._attend_rows then _attend_block for one product: q (B, T, Hq, D) against the first S of keys and
// values (B, S', Hkv, D); hidden_not (B, 1, T G, S) True where a row may NOT see a key, or nullopt.
// Returns (B, T, Hq D).
Tensor attend(const Tensor& q, Tensor keys, Tensor values, const OptionalTensor& hidden_not, const AttentionShape& a) {
  const int64_t b = q.size(0), t = q.size(1), g = a.hq / a.hkv;
  const Tensor rows = q.view({b, t, a.hkv, g, a.d}).permute({0, 2, 1, 3, 4}).reshape({b, a.hkv, t * g, a.d});
  Tensor keys_t, vals;  // (B, Hkv, D, W), (B, Hkv, W, D)
  if (keys.size(1) < a.width) {
    keys_t = at::constant_pad_nd(keys.slice(1, 0, a.s).permute({0, 2, 3, 1}), {0, a.width - a.s});
    vals = at::constant_pad_nd(values.slice(1, 0, a.s).permute({0, 2, 1, 3}), {0, 0, 0, a.width - a.s});
  } else {
    if (keys.size(1) > a.width) {
      keys = keys.slice(1, 0, a.width);
      values = values.slice(1, 0, a.width);
    }
    keys_t = keys.permute({0, 2, 3, 1});
    vals = values.permute({0, 2, 1, 3});
  }
  const int64_t r = rows.size(2);
  // Fewer rows than min_rows: the first rows of a product of min_rows (layers._MIN_ATTENTION_ROWS).
  const Tensor block = r < a.min_rows ? at::constant_pad_nd(rows, {0, 0, 0, a.min_rows - r}) : rows;
  Tensor scores = at::matmul(block.to(keys_t.scalar_type()), keys_t);  // (B, Hkv, rows, W)
  if (scores.size(-1) > a.s) scores = scores.slice(-1, 0, a.s);
  if (hidden_not.has_value()) scores = scores.masked_fill(*hidden_not, -INFINITY);
  Tensor weights = at::softmax(scores.to(at::kFloat) * std::pow(static_cast<double>(a.d), -0.5), -1)
                       .to(vals.scalar_type());
  const int64_t width = vals.size(2);
  if (width > a.s) weights = at::constant_pad_nd(weights, {0, width - a.s});
  Tensor out;
  if (width <= a.value_chunk) {
    out = at::matmul(weights, vals);
  } else {  // fp32 sum over chunks of value_chunk keys
    out = at::matmul(weights.slice(-1, 0, a.value_chunk), vals.slice(2, 0, a.value_chunk)).to(at::kFloat);
    for (int64_t start = a.value_chunk; start < width; start += a.value_chunk) {
      out = out + at::matmul(weights.slice(-1, start, start + a.value_chunk),
                             vals.slice(2, start, start + a.value_chunk)).to(at::kFloat);
    }
  }
  out = out.to(rows.scalar_type());
  if (out.size(2) != r) out = out.slice(2, 0, r);
  return out.view({b, a.hkv, t, g, a.d}).permute({0, 2, 1, 3, 4}).reshape({b, t, a.hq * a.d});
}

// layers.attend with hspec's kernel (cpu_kernels.cpp): q (B, T, Hq, D) over the first s of keys and values
// (B, S', Hkv, D) float32 or bfloat16 (the pool's), mask (B, 1, T, S) or nullopt. Returns (B, T, Hq D).
Tensor kernel_attend(const Tensor& q, const Tensor& keys, const Tensor& values, const OptionalTensor& mask, int64_t s) {
  static auto kernel = c10::Dispatcher::singleton().findSchemaOrThrow("hspec::attention", "")
                           .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&, int64_t)>();
  return kernel.call(q, keys, values, mask, s);
}

// apply_rope of q and k, then k and v written to a float32 or bfloat16 pool's layer at slots, with hspec's kernel
// (cpu_kernels.cpp): projected (B T, (Hq + 2 Hkv) D). Returns q rotated, (B, T, Hq, D).
Tensor rope_and_write(const Tensor& projected, const Tensor& cos, const Tensor& sin, Tensor& layer_k, Tensor& layer_v,
                      const Tensor& slots, int64_t hq, int64_t hkv) {
  static auto kernel = c10::Dispatcher::singleton().findSchemaOrThrow("hspec::rope_and_write", "")
                           .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&,
                                         int64_t, int64_t)>();
  return kernel.call(projected, cos, sin, layer_k, layer_v, slots, hq, hkv);
}

}  // namespace

// TargetModel.forward's layer loop: x (B, T, H) embeddings, cos/sin (B, T, 1, D), `weights` L x
// kTensorsPerLayer, pool_k/pool_v the pool's (L_all, slots, Hkv, D) views, write_slots (B, T), mask
// (B, 1, T, S) or nullopt. The S keys of each sequence (the new tokens' included) are read either at
// `slots` (B, S'), a gather (`PagedKVPool._gather`), or, without it, at the consecutive slots
// start..key_end-1 of a lone sequence (`PagedKVPool._view`); W is S rounded up to the key multiple.
// Returns [x after the last layer, then the output of each layer in `hidden_layers` (1-based, ascending,
// as HF's hidden_states)], each (B, T, H).
std::vector<Tensor> decoder_stack(Tensor x, const Tensor& cos, const Tensor& sin,
                                  const std::vector<OptionalTensor>& weights, const Tensor& pool_k,
                                  const Tensor& pool_v, const Tensor& write_slots, const OptionalTensor& slots,
                                  int64_t start, int64_t key_end, int64_t s, int64_t width,
                                  const OptionalTensor& mask, int64_t hq, int64_t hkv, int64_t d, double eps,
                                  int64_t row_block, int64_t min_attention_rows, int64_t value_chunk,
                                  int64_t fp32_value_chunk, bool kernels,
                                  const std::vector<int64_t>& hidden_layers) {
  TORCH_CHECK(weights.size() % kTensorsPerLayer == 0, "decoder_stack: ", weights.size(),
              " weights is not a whole number of layers of ", kTensorsPerLayer);
  TORCH_CHECK(x.dim() == 3, "decoder_stack takes x of shape (B, T, H), got ", x.sizes());
  TORCH_CHECK(slots.has_value() || x.size(0) == 1, "decoder_stack: a batch of ", x.size(0),
              " sequences needs their slots");
  const int64_t num_layers = static_cast<int64_t>(weights.size()) / kTensorsPerLayer;
  const int64_t b = x.size(0), t = x.size(1), g = hq / hkv, h = x.size(2);
  x = x.reshape({b * t, h});  // the layers run on rows (B T, H): no reshape around each product
  const Tensor flat_slots = write_slots.reshape({-1});
  // hspec's attention kernel takes the pool (float32 or bfloat16) and the mask as they are; the other path's mask
  // is inverted.
  const bool kernel_attention =
      kernels && (pool_v.scalar_type() == at::kFloat || pool_v.scalar_type() == at::kBFloat16);
  OptionalTensor hidden_not;  // (B, 1, max(T G, min_attention_rows), S), computed once, not once per layer
  if (mask.has_value() && !kernel_attention) {
    hidden_not = mask->unsqueeze(3).expand({b, 1, t, g, s}).reshape({b, 1, t * g, s}).logical_not();
    // attend pads fewer than min_attention_rows rows to that many; their rows see every key.
    if (t * g < min_attention_rows) {
      hidden_not = at::constant_pad_nd(*hidden_not, {0, 0, 0, min_attention_rows - t * g}, 0);
    }
  }
  const auto need = [&](int64_t i) -> const Tensor& {
    TORCH_CHECK(weights[i].has_value(), "decoder_stack: weight ", i, " is required");
    return *weights[i];
  };
  std::vector<Tensor> collected;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const int64_t at = layer * kTensorsPerLayer;
    const LinearWeights qkv{need(at + 1), weights[at + 2], weights[at + 3], weights[at + 4]};
    const LinearWeights o_proj{need(at + 5), std::nullopt, weights[at + 6], weights[at + 7]};
    const LinearWeights gate_up{need(at + 9), std::nullopt, weights[at + 10], weights[at + 11]};
    const LinearWeights down{need(at + 12), std::nullopt, weights[at + 13], weights[at + 14]};

    // Attention (llama.Attention, layers.QKVProjection): q and k rotated in one pass.
    const Tensor projected = linear(rms_norm(x, need(at), eps, kernels), qkv, row_block);  // (B T, (Hq + 2 Hkv) D)
    Tensor layer_k = pool_k.select(0, layer), layer_v = pool_v.select(0, layer);  // (slots, Hkv, D)
    Tensor queries;  // (B, T, Hq, D)
    if (kernel_attention) {
      queries = rope_and_write(projected, cos, sin, layer_k, layer_v, flat_slots, hq, hkv);
    } else {
      const int64_t qk_width = (hq + hkv) * d;
      const Tensor qk = apply_rope(projected.slice(-1, 0, qk_width).view({b, t, -1, d}), cos, sin);
      const std::vector<Tensor> q_k = qk.split_with_sizes({hq, hkv}, 2);
      const Tensor v = projected.slice(-1, qk_width).view({b, t, hkv, d});
      layer_k.index_copy_(0, flat_slots, q_k[1].reshape({-1, hkv, d}).to(layer_k.scalar_type()));
      layer_v.index_copy_(0, flat_slots, v.reshape({-1, hkv, d}).to(layer_v.scalar_type()));
      queries = q_k[0];
    }
    const AttentionShape shape{hq, hkv, d, s, width,
                               layer_v.scalar_type() == at::kFloat ? fp32_value_chunk : value_chunk,
                               min_attention_rows};
    Tensor keys, values;  // (B, S', Hkv, D)
    if (slots.has_value()) {
      keys = layer_k.index({*slots});
      values = layer_v.index({*slots});
    } else {
      keys = layer_k.slice(0, start, key_end).unsqueeze(0);
      values = layer_v.slice(0, start, key_end).unsqueeze(0);
    }
    const Tensor attended = kernel_attention
                                ? kernel_attend(queries, keys, values, mask, s)
                                : attend(queries, keys, values, hidden_not, shape);
    x = x + linear(attended.view({b * t, hq * d}), o_proj, row_block);

    // SwiGLU with gate and up fused (layers.SwiGLU).
    const std::vector<Tensor> gate_and_up = linear(rms_norm(x, need(at + 8), eps, kernels), gate_up, row_block).chunk(2, -1);
    x = x + linear(at::silu(gate_and_up[0]) * gate_and_up[1], down, row_block);
    for (const int64_t wanted : hidden_layers) {
      if (wanted == layer + 1) collected.push_back(x.view({b, t, h}));
    }
  }
  collected.insert(collected.begin(), x.view({b, t, h}));
  return collected;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("decoder_stack", &decoder_stack, "The target's decoder layers (decoder_stack.cpp)");
}
