// One product of models/layers.py's `_product` in C++, through the operators it calls (hspec's CPU kernels,
// cpu_kernels.cpp, through the dispatcher; ATen's), so its bits are the Python layer's. Shared by the native
// decoder stack (decoder_stack.cpp) and H-Spec's native proposal (drafters/hspec/native_propose.cpp).
//
// Legend: M rows, K inputs, N outputs.

#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace hspec_native {

// layers.W4A8_TILE_BYTES: the last dim of a w4a8 weight's tiles.
constexpr int64_t kW4a8TileBytes = 160;

// One linear as models/layers.py stores it (`Linear`: weight, bias, weight_scale, weight_packed); a None of
// Python is std::nullopt.
struct LinearWeights {
  at::Tensor weight;                 // (N, K): floating, int8, or an int4 weight's floating values
  std::optional<at::Tensor> bias;    // (N,)
  std::optional<at::Tensor> scale;   // int8 (N,), int4 (K / 32, N, 2) or hspec's int4 kernel's (N, K / 32, 2)
  std::optional<at::Tensor> packed;  // oneDNN's prepacked bf16 copy, the int4 levels or w4a8/w8a8 tiles, an
                                     // int8 kernel's matrix
};

// layers._product: flat (M, K) -> (M, N), M at most layers._ROW_BLOCK. The quantized storages go to their
// kernels as they are (a row alone gets the bits it gets among others); one row of a row-invariant (reduced
// precision CPU) tensor times a floating weight is computed as the first of two (oneDNN's one-row kernel
// rounds otherwise).
inline at::Tensor product(const at::Tensor& flat, const LinearWeights& w) {
  using Kernel = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
  using Tiles = at::Tensor(const at::Tensor&, const at::Tensor&);
  const auto op = [](const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); };
  const auto with_bias = [&](const at::Tensor& out) { return w.bias.has_value() ? out + *w.bias : out; };
  const std::optional<at::Tensor>& packed = w.packed;
  if (packed.has_value() && packed->scalar_type() == at::kByte && packed->dim() == 3 &&
      packed->size(2) == kW4a8TileBytes) {  // w4a8, hspec's kernel
    static auto w4a8_linear = op("hspec::w4a8_linear").typed<Tiles>();
    return with_bias(w4a8_linear.call(flat, *packed));
  }
  if (packed.has_value() && packed->scalar_type() == at::kChar && packed->dim() == 3) {  // w8a8 tiles
    static auto w8a8_linear = op("hspec::w8a8_linear").typed<Kernel>();
    return with_bias(w8a8_linear.call(flat, *packed, *w.scale));
  }
  if (packed.has_value() && packed->scalar_type() == at::kByte && packed->dim() == 3) {  // int4, hspec's kernel
    static auto int4_linear = op("hspec::int4_linear").typed<Kernel>();
    return with_bias(int4_linear.call(flat, *packed, *w.scale));
  }
  if (packed.has_value() && packed->scalar_type() == at::kChar) {  // int8, hspec's kernel
    static auto int8_linear = op("hspec::int8_linear").typed<Kernel>();
    return with_bias(int8_linear.call(flat, *packed, *w.scale));
  }
  if (packed.has_value() && packed->scalar_type() == at::kByte) {  // int4, torch's kernel
    return with_bias(at::_weight_int4pack_mm_for_cpu(flat.contiguous(), *packed, w.weight.size(1) / w.scale->size(0),
                                                     *w.scale));
  }
  if (w.scale.has_value()) return with_bias(at::_weight_int8pack_mm(flat, w.weight, *w.scale));  // int8, torch's
  const bool padded = flat.size(0) == 1 && flat.scalar_type() != at::kFloat && flat.device().is_cpu();
  const at::Tensor rows = padded ? flat.expand({2, -1}) : flat;
  at::Tensor out;
  if (packed.has_value()) {
    static auto linear_pointwise =
        op("mkldnn::_linear_pointwise")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                              c10::string_view, c10::List<std::optional<at::Scalar>>,
                              std::optional<c10::string_view>)>();
    out = linear_pointwise.call(rows, *packed, w.bias, "none", c10::List<std::optional<at::Scalar>>(),
                                c10::string_view(""));
  } else {
    out = at::linear(rows, w.weight, w.bias);
  }
  return padded ? out.slice(0, 0, 1) : out;
}

}  // namespace hspec_native
