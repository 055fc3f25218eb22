// H-Spec's greedy proposal for one sequence in C++ (drafters/hspec/native.py builds and binds it), and the
// DFlash family's (DFlash, DSpark, DFlash-KVReuse): their layers are H-Spec's attention and MLP without Mamba-2
// or S_init, attending to the whole block, with the same head and (DSpark) Markov head.
//
// The Python proposal (`HSpecDrafter.block_logits`, then `NeuralDrafter.greedy_block`) is ~500 small ATen
// operators and ~40 products; on a 2-core CPU the interpreter and dispatch between them cost as much as the
// products do. This file computes the same math in the same order: the products, norms, RoPE and attention
// through the operators the Python layers call (ATen's, and hspec's CPU kernels, cpu_kernels.cpp, through the
// dispatcher), with their bits; each Mamba-2 mixer between its projections (~70 operators on a few hundred
// values each) and the Markov loop's argmax and softmax sum as plain loops, every value rounded where the
// Python path's tensor rounds and every sum in its order, with the C library's exp and SiLU (ATen's vector
// forms may round otherwise in the last bit). The attention is the exception: where hspec's kernels run, it
// is one call of hspec::block_attention, which reads the context K/V in the pool as the pool stores them
// (bf16 or fp32, no widened copies) and sums in the target's attention's order, not ATen's products'; so its
// outputs differ from the Python path's in the last bits. So the drafts are the Python path's except where
// two logits lie within that rounding (tests/test_native_drafter.py); the target verifies every draft either
// way.

// Per proposal (paper §3.3, drafters/hspec/model.py):
// 1. the block [x0, MASK x (K-1)] embedded (the target's rows, the learned MASK embedding);
// 2. S_init = Proj_dS(Proj_r(concat(h))) from the selected layers' last hidden states;
// 3. per layer: Mamba-2 from S_init -> attention over [target K/V ; block K/V] -> SwiGLU MLP;
// 4. final norm, pruned-vocabulary head: U_k (1, K, Vp);
// 5. slot by slot, l_k = U_k + W2(W1[prev]), d_k = argmax l_k, confidence 1 / sum(exp(l_k - max l_k)).
//
// Legend: K block, S context keys, H hidden, Hq/Hkv heads, D head dim, nh SSM heads, P SSM head dim,
// N SSM state, G B/C groups, Vp draft vocabulary, r Markov rank, n_sel selected target layers.

// ATen, the dispatcher and torch's pybind11 casters, not <torch/extension.h> (as decoder_stack.cpp: a
// shorter build).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include "../../models/linear_product.h"

#include <time.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

namespace {

// The sections of a proposal its optional breakdown times (`propose(..., timed=true)`, `hspec bench draft
// --breakdown`), in the order `section_names` lists them; a section's time adds up over the layers.
enum Section : int {
  kEmbed, kInjection, kNorm, kMambaInProj, kMambaConv, kMambaScan, kMambaOutProj, kAttentionQkv,
  kAttentionNormRope, kAttentionAttend, kAttentionOutProj, kMlpGateUp,
  kMlpActivation, kMlpDown, kResidual, kHead, kMarkovProduct, kMarkovSelect, kOutputs, kSections
};
constexpr std::array<const char*, kSections> kSectionNames = {
    "embed", "injection", "norms", "mamba.in_proj", "mamba.conv_silu", "mamba.scan_gate_norm",
    "mamba.out_proj", "attention.qkv_proj", "attention.qk_norm_rope", "attention.attend", "attention.o_proj", "mlp.gate_up", "mlp.silu_mul", "mlp.down", "residual_adds",
    "head", "markov.w2_product", "markov.argmax_softmax", "outputs"};

inline double thread_cpu_ns() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return 1e9 * static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec);
}

// Nanoseconds per section of one proposal: this thread's CPU time (what the section cost the calling core;
// the products' second thread, where torch has two, is not in it) and wall time; and when the call began (it
// is made as the call enters C++).
struct Timings {
  std::array<double, kSections> thread_ns{}, wall_ns{};
  double call_thread_start = thread_cpu_ns();
  std::chrono::steady_clock::time_point call_wall_start = std::chrono::steady_clock::now();
};

// Adds the time from its construction to its destruction to `section` of `timings` (nothing where null).
class Timed {
 public:
  Timed(Timings* timings, Section section) : timings_(timings), section_(section) {
    if (timings_ != nullptr) thread_ = thread_cpu_ns(), wall_ = std::chrono::steady_clock::now();
  }
  ~Timed() {
    if (timings_ == nullptr) return;
    timings_->thread_ns[section_] += thread_cpu_ns() - thread_;
    timings_->wall_ns[section_] +=
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - wall_).count();
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  Timings* timings_;
  Section section_;
  double thread_ = 0.0;
  std::chrono::steady_clock::time_point wall_;
};

// One linear of the drafter: a `layers.Linear` (`row_invariant`: through layers.linear's product) or a plain
// nn.Linear (F.linear on the input as it is).
struct DrafterLinear {
  hspec_native::LinearWeights weights;
  bool row_invariant;
};

// layers.linear (rows reshaped to (M, K), one product: a block's K rows are far below layers._ROW_BLOCK), or
// F.linear for a plain nn.Linear. x (..., K) -> (..., N).
Tensor linear(const Tensor& x, const DrafterLinear& w) {
  if (!w.row_invariant) return at::linear(x, w.weights.weight, w.weights.bias);
  const int64_t k = x.size(-1);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = w.weights.weight.size(0);
  return hspec_native::product(x.reshape({x.numel() / k, k}), w.weights).reshape(shape);
}

// layers.RMSNorm without autograd: bf16 rows through hspec's kernel where the drafter's norms use it, else
// weight * F.rms_norm(x); other dtypes are normalised in fp32 and rounded back.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, bool kernel) {
  if (x.scalar_type() == at::kBFloat16) {
    if (kernel && weight.scalar_type() == at::kBFloat16) {
      static auto norm = c10::Dispatcher::singleton().findSchemaOrThrow("hspec::rms_norm", "")
                             .typed<Tensor(const Tensor&, const Tensor&, double)>();
      return norm.call(x, weight, eps);
    }
    return weight * at::rms_norm(x, {x.size(-1)}, std::nullopt, eps);
  }
  return weight * at::rms_norm(x.to(at::kFloat), {x.size(-1)}, std::nullopt, eps).to(x.scalar_type());
}

// A T value as fp32, and an fp32 value rounded to T and back (bf16: to nearest even, NaN to 0x7FC0, as
// c10::BFloat16(float) rounds; fp32: itself), without branches, so that loops of them vectorise.
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    const uint32_t out_bits = v != v ? 0x7FC00000u : rounded;
    float out;
    std::memcpy(&out, &out_bits, sizeof(out));
    return out;
  }
}
// An fp32 value that is already a T value (`round_to`'s), stored as T: exact.
inline void store_exact(float v, float* out) { *out = v; }
inline void store_exact(float v, c10::BFloat16* out) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  out->x = static_cast<uint16_t>(bits >> 16);
}

// layers.apply_rope: x (1, K, heads, D) with cos and the signed sin (1, K, 1, D): x * cos + swapped * sin,
// swapped = x with its halves exchanged. Where all three are contiguous and of one dtype, one loop that rounds
// each product and the sum to that dtype as ATen's three elementwise operators do (the same bits, without
// the flip's copy and three tensors); else those operators.
Tensor apply_rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const bool fused = x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
                     cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                     (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 4 &&
                     x.size(0) == 1 && cos.dim() == 4 && cos.size(0) == 1 && cos.size(1) == x.size(1) && cos.size(2) == 1 && cos.size(3) == x.size(3) &&
                     sin.sizes() == cos.sizes() && x.size(3) % 2 == 0;
  if (!fused) {
    const Tensor swapped = x.unflatten(-1, {2, x.size(-1) / 2}).flip({-2}).flatten(-2);
    return x * cos + swapped * sin;
  }
  Tensor out = at::empty_like(x);
  const int64_t length = x.size(1), heads = x.size(2), d = x.size(3), half = d / 2;
  const auto run = [&](const auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    const T *in = x.data_ptr<T>(), *cos_t = cos.data_ptr<T>(), *sin_t = sin.data_ptr<T>();
    T* rotated = out.data_ptr<T>();
    for (int64_t t = 0; t < length; ++t) {
      const T *c = cos_t + t * d, *s = sin_t + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        const T* row = in + (t * heads + h) * d;
        T* o = rotated + (t * heads + h) * d;
        const auto rotate = [&](int64_t i, int64_t partner) {
          const float product = round_to<T>(widen(row[i]) * widen(c[i]));
          const float swapped = round_to<T>(widen(row[partner]) * widen(s[i]));
          store_exact(round_to<T>(product + swapped), o + i);
        };
        for (int64_t i = 0; i < half; ++i) rotate(i, i + half);
        for (int64_t i = half; i < d; ++i) rotate(i, i - half);
      }
    }
  };
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>());
  } else {
    run(x.data_ptr<c10::BFloat16>());
  }
  return out;
}

// Reads the flat weight list in the order `NativePropose` (native.py) writes it.
class Cursor {
 public:
  Cursor(const std::vector<OptionalTensor>& tensors, const std::vector<bool>& row_invariant)
      : tensors_(tensors), row_invariant_(row_invariant) {}

  const Tensor& tensor(const char* what) {
    TORCH_CHECK(next_ < tensors_.size(), "native_propose: the weight list ended before ", what);
    const OptionalTensor& t = tensors_[next_++];
    TORCH_CHECK(t.has_value(), "native_propose: ", what, " (weight ", next_ - 1, ") is required");
    return *t;
  }

  OptionalTensor optional() {
    TORCH_CHECK(next_ < tensors_.size(), "native_propose: the weight list ended early");
    return tensors_[next_++];
  }

  DrafterLinear linear(const char* what) {
    TORCH_CHECK(linears_ < row_invariant_.size(), "native_propose: no row-invariance flag for ", what);
    const Tensor& weight = tensor(what);
    OptionalTensor bias = optional(), scale = optional(), packed = optional();
    return {{weight, bias, scale, packed}, row_invariant_[linears_++]};
  }

  void check_end() const {
    TORCH_CHECK(next_ == tensors_.size() && linears_ == row_invariant_.size(), "native_propose: read ", next_,
                " of ", tensors_.size(), " weights and ", linears_, " of ", row_invariant_.size(),
                " linears: the list does not match the layout");
  }

 private:
  const std::vector<OptionalTensor>& tensors_;
  const std::vector<bool>& row_invariant_;
  size_t next_ = 0, linears_ = 0;
};

// A drafter's sizes: its Mamba-2 heads nh, P, N and B/C groups G; the target's Hq, Hkv and D; the norms' eps
// (RMSNorm's and the gated RMSNorm's), and whether its RMSNorms run hspec's kernel.
struct Sizes {
  int64_t nheads, headdim, d_state, ngroups, hq, hkv, d;
  double eps, mamba_eps;
  bool norm_kernel;
  bool causal;  // a block's query t sees its keys <= t (H-Spec), or all of them (the DFlash family)
  bool attention_kernel;  // attend through hspec::block_attention (cpu_kernels.cpp), else ATen's products
};

// mixer.causal_depthwise_conv of one sequence in one pass: out[t] = x[t - W + 1] tap_0 + ... + x[t] tap_{W-1}
// (+ bias), zeros before the block, each product and sum rounded to T as ATen's elementwise operators round
// them (in fp32, then to nearest even), in the order the Python loop adds them: the same bits as its 2W
// operators. Each channel's value is computed alone, so the loops run along the channels (vectorised).
// x rows of C channels `row_stride` apart (a slice of in_proj's output), taps (W, C) (native.py transposes
// them), bias (C,) or null, out (K, C).
template <typename T>
void causal_conv(const T* x, int64_t length, int64_t channels, int64_t row_stride, const T* taps, int64_t width,
                 const T* bias, T* out) {
  std::vector<float> acc(static_cast<size_t>(channels)), input(acc.size());
  for (int64_t t = 0; t < length; ++t) {
    for (int64_t j = 0; j < width; ++j) {
      const int64_t at_t = t + j - (width - 1);  // padded[t + j]: x[t + j - (W - 1)], zero before the block
      for (int64_t c = 0; c < channels; ++c) input[c] = at_t < 0 ? 0.0f : widen(x[at_t * row_stride + c]);
      const T* tap = taps + j * channels;
      for (int64_t c = 0; c < channels; ++c) {
        const float product = round_to<T>(input[c] * widen(tap[c]));
        acc[c] = j == 0 ? product : round_to<T>(acc[c] + product);
      }
    }
    for (int64_t c = 0; c < channels; ++c) {
      store_exact(bias == nullptr ? acc[c] : round_to<T>(acc[c] + widen(bias[c])), out + t * channels + c);
    }
  }
}

// causal_conv of xbc (1, K, C) (channels contiguous) with taps (W, C) and bias (C,) or nullopt in xbc's dtype
// (bf16 or fp32). Returns (1, K, C).
Tensor causal_depthwise_conv(const Tensor& xbc, const Tensor& taps, const OptionalTensor& bias) {
  TORCH_CHECK(xbc.dim() == 3 && xbc.size(0) == 1 && xbc.stride(2) == 1, "native_propose: the conv takes one "
              "sequence's rows (1, K, C) with contiguous channels, got ", xbc.sizes(), " strides ", xbc.strides());
  const int64_t length = xbc.size(1), channels = xbc.size(2), width = taps.size(0);
  TORCH_CHECK(taps.size(1) == channels && taps.is_contiguous() && taps.scalar_type() == xbc.scalar_type() &&
                  (!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == xbc.scalar_type())),
              "native_propose: conv taps must be contiguous (W, ", channels, ") in ", xbc.scalar_type(), ", got ",
              taps.scalar_type(), " ", taps.sizes());
  Tensor out = at::empty({1, length, channels}, xbc.options());
  const auto run = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    causal_conv<T>(xbc.data_ptr<T>(), length, channels, xbc.stride(1), taps.data_ptr<T>(), width,
                   bias.has_value() ? bias->data_ptr<T>() : nullptr, out.data_ptr<T>());
  };
  if (xbc.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(xbc.scalar_type() == at::kBFloat16, "native_propose: the conv runs float32 or bfloat16, got ",
                xbc.scalar_type());
    run(static_cast<c10::BFloat16*>(nullptr));
  }
  return out;
}

// What stays fixed for a drafter's Mamba-2 mixers: sizes, and per mixer the parameters the Python path turns
// to fp32 (A = -exp(A_log), dt_bias) or to the activations' dtype (D) before it uses them, precomputed by
// native.py with the same torch operators.
struct MambaSizes {
  int64_t nheads, headdim, d_state, ngroups;
  double eps;  // the gated RMSNorm's
};

// Mamba2Mixer.forward of one sequence between in_proj and out_proj, in one pass (the Python path's ~70 operators
// on tensors of a few hundred values each cost far more than their arithmetic). zxbcdt (K, Z) rows `row_stride`
// apart, in T: z (d_inner), [x, B, C] (conv_dim), dt (nh); activated (K, conv_dim) in T, SiLU of the causal conv
// of [x, B, C]; gates (K, d_inner) fp32, SiLU(z) (both by ATen's vectorized SiLU, with the Python path's bits).
// Steps as mixer.py numbers them:
// 2. (the conv and SiLU, given);
// 3. dt = softplus(dt + dt_bias) in fp32;
// 4. the SSD scan of the block as one chunk from S_init (ssd.ssd_chunked steps 1, 3 and 6: the quadratic form
//    y_diag = (L o C B^T)(dt x) plus y_off = C S_init decayed from the block's start; for one chunk the state
//    entering it is S_init itself), in fp32, rounded to T, plus D x;
// 5. gated RMSNorm per group in fp32 (mixer.GatedRMSNorm), rounded to T, times its weight.
// Each value rounds to T where the Python path's tensor does; the sums run in the Python path's order (over n,
// then over s, ascending), but the decays' exp and softplus are the C library's, which may differ from ATen's
// vector forms in the last bit: drafts can then differ from the Python path's only where two logits are that
// close.
// Returns out (K, d_inner) in T, the input of out_proj.
template <typename T>
void mamba_mix(const T* zxbcdt, int64_t length, int64_t row_stride, const T* activated, const float* gates,
               const float* A, const float* dt_bias, const T* D, const T* gate_weight, const T* s_init,
               const MambaSizes& m, T* out) {
  const int64_t nh = m.nheads, P = m.headdim, N = m.d_state, G = m.ngroups, heads_per_group = nh / G;
  const int64_t d_inner = nh * P, group_width = G * N, conv_dim = d_inner + 2 * group_width;
  // 2. xbc (K, conv_dim): the conv's output after SiLU, as floats
  std::vector<float> xbc(static_cast<size_t>(length * conv_dim));
  for (size_t i = 0; i < xbc.size(); ++i) xbc[i] = widen(activated[i]);
  const auto x_at = [&](int64_t l, int64_t h, int64_t p) { return xbc[l * conv_dim + h * P + p]; };
  const auto b_at = [&](int64_t l, int64_t g, int64_t n) { return xbc[l * conv_dim + d_inner + g * N + n]; };
  const auto c_at = [&](int64_t l, int64_t g, int64_t n) { return xbc[l * conv_dim + d_inner + group_width + g * N + n]; };
  // 3. dt (K, nh); log-decays and their running sums along the block (cumsum)
  std::vector<float> dt(static_cast<size_t>(length * nh)), cum(dt.size());
  for (int64_t l = 0; l < length; ++l) {
    for (int64_t h = 0; h < nh; ++h) {
      const float v = static_cast<float>(zxbcdt[l * row_stride + d_inner + conv_dim + h]) + dt_bias[h];
      dt[l * nh + h] = v > 20.0f ? v : std::log1p(std::exp(v));  // F.softplus, threshold 20
      const float decay = dt[l * nh + h] * A[h];
      cum[l * nh + h] = l == 0 ? decay : cum[(l - 1) * nh + h] + decay;
    }
  }
  // S_init per head as (N, P) floats: the loops below run along p (vectorised), each p's sums in the order
  // of the Python path's
  std::vector<float> state(static_cast<size_t>(nh * N * P), 0.0f);
  if (s_init != nullptr) {
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t n = 0; n < N; ++n) state[(h * N + n) * P + p] = widen(s_init[(h * P + p) * N + n]);
  }
  std::vector<float> y(static_cast<size_t>(length * d_inner));
  std::vector<float> weights(static_cast<size_t>(length)), diag(static_cast<size_t>(P)), off(diag.size());
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t g = h / heads_per_group;
    const float skip_weight = widen(D[h]);
    for (int64_t l = 0; l < length; ++l) {
      // 4. weights of the block's earlier inputs s <= l: (C_l . B_s) exp(segsum[l, s]), segsum[l, s] the
      //    log-decays of s+1..l summed in order (ssd.segsum)
      for (int64_t s = 0; s <= l; ++s) {
        float score = 0.0f;
        for (int64_t n = 0; n < N; ++n) score += c_at(l, g, n) * b_at(s, g, n);
        float seg = 0.0f;
        for (int64_t k = s + 1; k <= l; ++k) seg += dt[k * nh + h] * A[h];
        weights[s] = score * std::exp(seg);
      }
      const float from_start = std::exp(cum[l * nh + h]);
      // y_diag[p] = sum over s of weights[s] (x[s, p] dt[s]); y_off[p] = sum over n of C_l[n] S_init[p, n]
      std::fill(diag.begin(), diag.end(), 0.0f);
      for (int64_t s = 0; s <= l; ++s) {
        const float weight = weights[s], step = dt[s * nh + h];
        const float* xs = &xbc[s * conv_dim + h * P];
        for (int64_t p = 0; p < P; ++p) diag[p] += weight * (xs[p] * step);
      }
      std::fill(off.begin(), off.end(), 0.0f);
      for (int64_t n = 0; n < N; ++n) {
        const float c = c_at(l, g, n);
        const float* sn = &state[(h * N + n) * P];
        for (int64_t p = 0; p < P; ++p) off[p] += c * sn[p];
      }
      const float* xl = &xbc[l * conv_dim + h * P];
      float* yl = &y[l * d_inner + h * P];
      for (int64_t p = 0; p < P; ++p) {
        const float scanned = round_to<T>(diag[p] + off[p] * from_start);
        const float skip = round_to<T>(skip_weight * xl[p]);
        yl[p] = round_to<T>(scanned + skip);
      }
    }
  }
  // 5. gate with SiLU(z), RMSNorm per group, weight
  const int64_t group = d_inner / G;
  std::vector<float> gated(static_cast<size_t>(group));
  for (int64_t l = 0; l < length; ++l) {
    for (int64_t gi = 0; gi < G; ++gi) {
      float squares = 0.0f;
      for (int64_t i = 0; i < group; ++i) {
        const int64_t j = gi * group + i;
        gated[i] = y[l * d_inner + j] * gates[l * d_inner + j];
        squares += gated[i] * gated[i];
      }
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(group) + static_cast<float>(m.eps));
      for (int64_t i = 0; i < group; ++i) {
        const int64_t j = gi * group + i;
        store_exact(round_to<T>(round_to<T>(gated[i] * inverse) * widen(gate_weight[j])), out + l * d_inner + j);
      }
    }
  }
}

// ssm.mixer.Mamba2Mixer.forward without its final state: hidden (1, K, H) from S_init (1, nh, P, N) or zeros.
Tensor mamba(const Tensor& hidden, const OptionalTensor& s_init, Cursor& w, const MambaSizes& m, Timings* t) {
  const DrafterLinear in_proj = w.linear("mamba.in_proj");
  const Tensor& taps = w.tensor("mamba.conv1d taps");  // (W, conv_dim) in the activations' dtype
  const OptionalTensor conv_bias = w.optional();         // (conv_dim,) in the activations' dtype
  const Tensor& A = w.tensor("mamba A");                 // (nh,) fp32, -exp(A_log)
  const Tensor& dt_bias = w.tensor("mamba.dt_bias");     // (nh,) fp32
  const Tensor& D = w.tensor("mamba.D");                 // (nh,) in the activations' dtype
  const Tensor& gate_weight = w.tensor("mamba.norm.weight");
  const DrafterLinear out_proj = w.linear("mamba.out_proj");
  const Tensor zxbcdt = [&] {
    Timed timed(t, kMambaInProj);
    return linear(hidden, in_proj);  // (1, K, d_inner + conv_dim + nh), contiguous
  }();
  const int64_t length = hidden.size(1), d_inner = m.nheads * m.headdim;
  const int64_t conv_dim = d_inner + 2 * m.ngroups * m.d_state;
  TORCH_CHECK(!s_init.has_value() || s_init->sizes() == at::IntArrayRef({1, m.nheads, m.headdim, m.d_state}),
              "native_propose: S_init must be (1, ", m.nheads, ", ", m.headdim, ", ", m.d_state, "), got ",
              s_init->sizes());
  const OptionalTensor state = s_init.has_value() ? OptionalTensor(s_init->to(zxbcdt.scalar_type()).contiguous())
                                                  : std::nullopt;
  // 2. the causal conv of [x, B, C] and SiLU; SiLU(z) for the gate
  std::optional<Timed> timed(std::in_place, t, kMambaConv);
  const Tensor activated = at::silu(causal_depthwise_conv(zxbcdt.slice(2, d_inner, d_inner + conv_dim), taps, conv_bias));
  const Tensor gates = at::silu(zxbcdt.slice(2, 0, d_inner).to(at::kFloat)).contiguous();  // (1, K, d_inner)
  timed.emplace(t, kMambaScan);
  Tensor out = at::empty({1, length, d_inner}, zxbcdt.options());
  const auto run = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    mamba_mix<T>(zxbcdt.data_ptr<T>(), length, zxbcdt.size(2), activated.data_ptr<T>(), gates.data_ptr<float>(),
                 A.data_ptr<float>(),
                 dt_bias.data_ptr<float>(), D.data_ptr<T>(), gate_weight.data_ptr<T>(),
                 state.has_value() ? state->data_ptr<T>() : nullptr, m, out.data_ptr<T>());
  };
  TORCH_CHECK(zxbcdt.is_contiguous() && (zxbcdt.scalar_type() == at::kFloat || zxbcdt.scalar_type() == at::kBFloat16),
              "native_propose: Mamba-2 runs float32 or bfloat16 rows, got ", zxbcdt.scalar_type());
  for (const Tensor* t : {&taps, &D, &gate_weight}) {
    TORCH_CHECK(t->scalar_type() == zxbcdt.scalar_type() && t->is_contiguous(), "native_propose: the Mamba-2 "
                "weights must be contiguous and in the activations' dtype ", zxbcdt.scalar_type(), ", got ",
                t->scalar_type());
  }
  if (zxbcdt.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<c10::BFloat16*>(nullptr));
  }
  timed.emplace(t, kMambaOutProj);
  return linear(out, out_proj);
}

// block_attention.BlockAttention.forward (q/k/v unfused, per-head q/k norm) then attend_block: x (1, K, H),
// cos/sin (1, K, 1, D), context k and v (1, S', Hkv, D) with context_mask (1, S') bool, of which the first s
// keys hold every visible one (no mask: the first s keys are all visible, hspec's kernel only).
Tensor attention(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& context_k,
                 const Tensor& context_v, const OptionalTensor& context_mask, int64_t s, Cursor& w, const Sizes& c,
                 Timings* t) {
  const DrafterLinear q_proj = w.linear("attn.q_proj"), k_proj = w.linear("attn.k_proj"),
                      v_proj = w.linear("attn.v_proj");
  const Tensor& q_norm = w.tensor("attn.q_norm.weight");
  const Tensor& k_norm = w.tensor("attn.k_norm.weight");
  const DrafterLinear o_proj = w.linear("attn.o_proj");
  const int64_t n = x.size(0), length = x.size(1), g = c.hq / c.hkv;
  std::optional<Timed> timed(std::in_place, t, kAttentionQkv);
  Tensor q = linear(x, q_proj).view({n, length, c.hq, c.d});
  Tensor k = linear(x, k_proj).view({n, length, c.hkv, c.d});
  const Tensor v = linear(x, v_proj).view({n, length, c.hkv, c.d});
  timed.emplace(t, kAttentionNormRope);
  q = apply_rope(rms_norm(q, q_norm, c.eps, c.norm_kernel), cos, sin);
  k = apply_rope(rms_norm(k, k_norm, c.eps, c.norm_kernel), cos, sin);
  timed.emplace(t, kAttentionAttend);
  Tensor merged;  // (1, K, Hq D)
  if (c.attention_kernel) {
    // hspec's kernel: one softmax over [the s context keys ; the block's], the context read from the pool in
    // its own dtype and layout, each row's sums in the target's attention's order (not ATen's products')
    static auto block_attention =
        c10::Dispatcher::singleton().findSchemaOrThrow("hspec::block_attention", "")
            .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t,
                          const Tensor&, const Tensor&, bool)>();
    merged = block_attention.call(q, context_k, context_v, context_mask, s, k, v, c.causal);
  } else {
    // attend_block's products: the G query heads of a KV head as G K rows; scores against the context and the
    // block share one softmax, the context read where it is
    const Tensor qg = q.view({n, length, c.hkv, g, c.d}).permute({0, 2, 3, 1, 4}).reshape({n, c.hkv, g * length, c.d});
    const int64_t keys = context_k.size(1), rows = g * length;
    const Tensor block_raw = at::matmul(qg, k.permute({0, 2, 3, 1})).to(at::kFloat).contiguous();  // (1, Hkv, G K, K)
    const Tensor ctx_raw = at::matmul(qg.to(context_k.scalar_type()), context_k.permute({0, 2, 3, 1}))
                               .to(at::kFloat).contiguous();  // (1, Hkv, G K, S')
    // [context ; block] scores scaled by D^-1/2 (a float, as ATen multiplies a float tensor by a Python float),
    // -inf where hidden: in one pass, the values of the Python path's scale, masked_fill and cat
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
    Tensor scores = at::empty({n, c.hkv, rows, keys + length}, ctx_raw.options());
    TORCH_CHECK(context_mask.has_value(), "native_propose: attention through ATen's products needs a context mask");
    const bool* visible = context_mask->data_ptr<bool>();
    const float* from_context = ctx_raw.data_ptr<float>();
    const float* from_block = block_raw.data_ptr<float>();
    float* out_scores = scores.data_ptr<float>();
    for (int64_t r = 0; r < c.hkv * rows; ++r) {  // (KV head, query row), the row's token r % K
      float* row = out_scores + r * (keys + length);
      for (int64_t j = 0; j < keys; ++j) row[j] = visible[j] ? from_context[r * keys + j] * scale : -INFINITY;
      const int64_t token = r % length;
      for (int64_t j = 0; j < length; ++j) {
        row[keys + j] = j <= token || !c.causal ? from_block[r * length + j] * scale : -INFINITY;
      }
    }
    const Tensor probs = at::softmax(scores, -1);
    const Tensor out = at::matmul(probs.slice(-1, 0, keys).to(context_v.scalar_type()), context_v.transpose(1, 2))
                           .to(v.scalar_type()) +
                       at::matmul(probs.slice(-1, keys).to(v.scalar_type()), v.transpose(1, 2));  // (1, Hkv, G K, D)
    merged = out.view({n, c.hkv, g, length, c.d}).permute({0, 3, 1, 2, 4}).reshape({n, length, c.hq * c.d});
  }
  timed.emplace(t, kAttentionOutProj);
  return linear(merged, o_proj);
}

// layers.SwiGLU with gate and up unfused: down(silu(gate(x)) * up(x)).
Tensor mlp(const Tensor& x, Cursor& w, Timings* t) {
  const DrafterLinear gate = w.linear("mlp.gate_proj"), up = w.linear("mlp.up_proj"), down = w.linear("mlp.down_proj");
  std::optional<Timed> timed(std::in_place, t, kMlpGateUp);
  const Tensor gated = linear(x, gate), lifted = linear(x, up);
  timed.emplace(t, kMlpActivation);
  const Tensor hidden = at::silu(gated) * lifted;
  timed.emplace(t, kMlpDown);
  return linear(hidden, down);
}

// What one proposal reads besides the drafter's weights: one sequence's block and context.
struct BlockInputs {
  Tensor block_tokens;                 // (1, K) long, [x0, MASK, ...]
  Tensor cos, sin;                     // (1, K, D) the target's RoPE at the block's positions, the drafter's dtype
  Tensor last_hidden;                  // (1, n_sel, H) or (n_sel, H): the selected target layers' at position p - 1
  const std::vector<Tensor>& context;  // per attention module its context k and v, (1, S', Hkv, D) each
  OptionalTensor context_mask;         // (1, S') bool; none: the first context_keys keys are all visible
  int64_t context_keys;                // the keys up to the last visible one: the kernel reads no further
  int64_t anchor;                      // x0, a target id
};

// layers.rope_cos_sin at positions start..start+T-1 of one sequence, by the same ATen operators on the same
// values: inv_freq (D/2,) fp32 -> cos and the signed sin, (1, T, D) each in `dtype`. Each value is computed alone
// (a product, ATen's vectorized sin or cos, a rounding), so a position's row has the same bits whatever other
// positions share the call (tests/test_native_in_place.py checks rows of a long table against the target's rope).
std::pair<Tensor, Tensor> rope_cos_sin(const Tensor& inv_freq, int64_t start, int64_t length, at::ScalarType dtype) {
  const Tensor positions = at::arange(start, start + length, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  const Tensor angles = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;  // (1, T, D/2)
  const Tensor sin = angles.sin();
  return {at::cat({angles, angles}, -1).cos().to(dtype), at::cat({sin.neg(), sin}, -1).to(dtype)};
}

}  // namespace

// The Markov head's corrections W2(W1[prev]) (Vp,) by previous token, for a Proposer whose W2 is its own int8 copy
// (markov 2, made once for inference): a slot's correction depends on that token alone, and the slots of a run of
// steps follow the same tokens again and again, so each computed correction is kept and a later slot after the same
// token copies it (~16 KB in bf16) where it would multiply W2 again (Vp x r, ~2 MB in int8 at 8,192 x 256, read
// from L3 or memory): the same bits, as the product's row does not depend on anything else. The kCapacity
// tokens used last are kept (16 MB at most in bf16).
class Corrections {
 public:
  static constexpr size_t kCapacity = 1024;

  // The correction after `token`, made by `make()` where it is not kept.
  template <typename Make>
  Tensor get(int64_t token, const Make& make) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto found = index_.find(token);
      if (found != index_.end()) {
        order_.splice(order_.begin(), order_, found->second);
        return found->second->second;
      }
    }
    Tensor made = make();
    const std::lock_guard<std::mutex> lock(mutex_);
    if (index_.find(token) == index_.end()) {
      order_.emplace_front(token, made);
      index_[token] = order_.begin();
      if (order_.size() > kCapacity) {
        index_.erase(order_.back().first);
        order_.pop_back();
      }
    }
    return made;
  }

 private:
  std::mutex mutex_;
  std::list<std::pair<int64_t, Tensor>> order_;  // most recently used first
  std::unordered_map<int64_t, std::list<std::pair<int64_t, Tensor>>::iterator> index_;
};

// HSpecDrafter.block_logits (or DFlashBackbone.block_logits) then NeuralDrafter.greedy_block for one sequence,
// bound to one drafter: its weights and sizes, converted from Python once, when it is made (converting ~130
// optional tensors from a Python list cost ~0.15 ms a call).
//
// weights and row_invariant as `NativePropose` writes them; layers: per drafter layer 1 (Mamba) + 2 (attention);
// mask_token_id, vocab_size (V); injects: S_init is projected (else zeros); markov: 0 none, 1 W2 as a (r, Vp)
// matrix, 2 W2 as an int8 linear; dims (nh, P, N, G, Hq, Hkv, D); causal: the block attends causally (H-Spec) or
// bidirectionally (the DFlash family); attention_kernel: the attention runs hspec::block_attention (the context
// K/V as the pool stores them, fp32 or bf16), else ATen's products (the context in the dtype the Python path
// multiplies it in); inv_freq: the target's RoPE inverse frequencies (D/2,), or none (`propose_in_pool` needs
// them); keep_corrections: the Markov head keeps the corrections it computed (`Corrections`, markov 2 only).
//
// Both entries return the drafts as target ids (1, K) long, as draft-vocabulary indices (1, K) long, their
// confidence (1, K) fp32, the backbone logits U (1, K, Vp) and, where timed, the sections' nanoseconds
// (kSections + 1, 2) fp64, this thread's CPU time then wall time, the last row the whole call's (from its entry
// into C++ to its outputs), else an empty tensor.
class Proposer {
 public:
  Proposer(std::vector<OptionalTensor> weights, std::vector<bool> row_invariant, std::vector<int64_t> layers,
           int64_t mask_token_id, int64_t vocab_size, bool injects, int64_t markov, std::vector<int64_t> dims,
           double eps, double mamba_eps, bool norm_kernel, bool causal, bool attention_kernel,
           OptionalTensor inv_freq, bool keep_corrections)
      : weights_(std::move(weights)), row_invariant_(std::move(row_invariant)), layers_(std::move(layers)),
        mask_token_id_(mask_token_id), vocab_size_(vocab_size), markov_(markov), injects_(injects),
        keep_corrections_(keep_corrections) {
    TORCH_CHECK(dims.size() == 7, "native_propose: dims must be (nh, P, N, G, Hq, Hkv, D), got ", dims.size(),
                " values");
    sizes_ = {dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], eps, mamba_eps, norm_kernel, causal,
              attention_kernel};
    TORCH_CHECK(sizes_.hkv > 0 && sizes_.hq % sizes_.hkv == 0 && sizes_.ngroups > 0 &&
                    sizes_.nheads % sizes_.ngroups == 0,
                "native_propose: bad head counts Hq = ", sizes_.hq, ", Hkv = ", sizes_.hkv, ", nh = ", sizes_.nheads,
                ", G = ", sizes_.ngroups);
    TORCH_CHECK(weights_.size() > 1 && weights_[1].has_value(), "native_propose: the weight list has no mask embedding");
    if (inv_freq.has_value()) inv_freq_ = inv_freq->to(at::kFloat).contiguous();
  }

  // The proposal of a block and context built in Python (`NeuralDrafter.block_context`): block_tokens (1, K) long
  // [x0, MASK, ...]; cos, sin (1, K, D) the target's RoPE at the block's positions in the drafter's dtype;
  // last_hidden (1, n_sel, H); context: per attention module its context k and v (1, S, Hkv, D) (pool views: as the
  // pool stores them where attention_kernel, else as the Python path multiplies them), context_mask (1, S) bool;
  // anchor (1,) long.
  std::vector<Tensor> propose(const Tensor& block_tokens, const Tensor& cos, const Tensor& sin,
                              const Tensor& last_hidden, const std::vector<Tensor>& context,
                              const Tensor& context_mask, const Tensor& anchor, bool timed) const {
    std::optional<Timings> timings;
    if (timed) timings.emplace();
    TORCH_CHECK(context_mask.dim() == 2 && context_mask.size(0) == 1 && context_mask.scalar_type() == at::kBool,
                "native_propose: context_mask must be bool (1, S), got ", context_mask.scalar_type(), " ",
                context_mask.sizes());
    TORCH_CHECK(anchor.numel() == 1, "native_propose: the anchor must be one id, got ", anchor.sizes());
    const Tensor visible = context_mask.contiguous();
    // the context keys up to the last visible one: the kernel reads no further (the keys after are padding,
    // `CONTEXT_MULTIPLE`)
    int64_t keys = visible.size(1);
    while (keys > 0 && !visible.data_ptr<bool>()[keys - 1]) --keys;
    return run({block_tokens, cos, sin, last_hidden, context, visible, keys, anchor.item<int64_t>()},
               timed ? &*timings : nullptr);
  }

  // The proposal of a sequence whose context lies in consecutive slots of a pool, read there in place, the block
  // and its RoPE made here as build_block and layers.rope_cos_sin make them (needs inv_freq and hspec's attention
  // kernel): anchor (1,) long x0; position p, the sequence's length (the block sits at p..p+K-1); length K;
  // last_hidden (n_sel, H); pool_k, pool_v the pool's K and V (L_all, slots, Hkv, D), any strides; pool_layers the
  // pool layer each attention module reads, in module order; the context keys the slots start..start+keys-1,
  // every one visible.
  std::vector<Tensor> propose_in_pool(const Tensor& anchor, int64_t position, int64_t length,
                                      const Tensor& last_hidden, const Tensor& pool_k, const Tensor& pool_v,
                                      const std::vector<int64_t>& pool_layers, int64_t start, int64_t keys,
                                      bool timed) {
    std::optional<Timings> timings;
    if (timed) timings.emplace();
    TORCH_CHECK(inv_freq_.has_value() && sizes_.attention_kernel, "native_propose: a proposal from the pool in "
                "place needs the target's RoPE frequencies and hspec's attention kernel");
    TORCH_CHECK(anchor.numel() == 1 && anchor.scalar_type() == at::kLong && length >= 1 && last_hidden.dim() == 2,
                "native_propose: takes one long anchor, K >= 1 and last_hidden (n_sel, H), got ", anchor.sizes(),
                ", K = ", length, " and ", last_hidden.sizes());
    TORCH_CHECK(pool_k.dim() == 4 && pool_v.sizes() == pool_k.sizes() && start >= 0 && keys >= 0 &&
                    start + keys <= pool_k.size(1),
                "native_propose: the pool's K and V must be (L, slots, Hkv, D), the context slots ", start, "..",
                start + keys, " within them; got ", pool_k.sizes(), " and ", pool_v.sizes());
    const int64_t x0 = anchor.item<int64_t>();
    Tensor block_tokens = at::full({1, length}, mask_token_id_, at::TensorOptions().dtype(at::kLong));
    block_tokens.data_ptr<int64_t>()[0] = x0;
    const auto [cos, sin] = rope_rows(position, length);
    // each module's context: slots start..start+keys-1 of its layer, (1, keys, Hkv, D), one view each
    const auto window = [&](const Tensor& pool, int64_t layer) {
      return pool.as_strided({1, keys, pool.size(2), pool.size(3)}, pool.strides(),
                             pool.storage_offset() + layer * pool.stride(0) + start * pool.stride(1));
    };
    std::vector<Tensor> context;
    context.reserve(2 * pool_layers.size());
    for (const int64_t layer : pool_layers) {
      TORCH_CHECK(layer >= 0 && layer < pool_k.size(0), "native_propose: pool layer ", layer, " outside its ",
                  pool_k.size(0), " layers");
      context.push_back(window(pool_k, layer));
      context.push_back(window(pool_v, layer));
    }
    return run({block_tokens, cos, sin, last_hidden, context, std::nullopt, keys, x0}, timed ? &*timings : nullptr);
  }

 private:
  // RoPE rows for positions p..p+K-1, (1, K, D) views of a table of kRopeSpan positions from p, made again (by
  // `rope_cos_sin`) when a block leaves it: a block's RoPE is then one view of each table, where its ~12
  // operators cost ~0.1 ms right after a verify (their code cold in the caches).
  static constexpr int64_t kRopeSpan = 256;
  std::pair<Tensor, Tensor> rope_rows(int64_t position, int64_t length) {
    const std::lock_guard<std::mutex> lock(rope_mutex_);
    if (!rope_cos_.defined() || position < rope_start_ || position + length > rope_start_ + rope_cos_.size(1)) {
      std::tie(rope_cos_, rope_sin_) =
          rope_cos_sin(*inv_freq_, position, std::max(length, kRopeSpan), weights_[1]->scalar_type());
      rope_start_ = position;
    }
    return {rope_cos_.narrow(1, position - rope_start_, length), rope_sin_.narrow(1, position - rope_start_, length)};
  }

  std::vector<Tensor> run(const BlockInputs& in, Timings* t) const {
    const Sizes& c = sizes_;
    TORCH_CHECK(in.block_tokens.dim() == 2 && in.block_tokens.size(0) == 1,
                "native_propose takes one sequence's block (1, K), got ", in.block_tokens.sizes());
    const int64_t length = in.block_tokens.size(1);
    TORCH_CHECK(in.cos.dim() == 3 && in.cos.size(1) == length && in.sin.sizes() == in.cos.sizes(),
                "native_propose: cos and sin must be (1, ", length, ", D), got ", in.cos.sizes(), " and ",
                in.sin.sizes());
    const int64_t context_length = in.context_mask.has_value() ? in.context_mask->size(1) : in.context_keys;
    Cursor w(weights_, row_invariant_);
    const Tensor& embed_weight = w.tensor("the target's embedding");
    const Tensor& mask_embedding = w.tensor("mask_embedding");

    // 1. embed_block
    std::optional<Timed> section(std::in_place, t, kEmbed);
    const Tensor is_mask = in.block_tokens.eq(mask_token_id_);
    const Tensor emb = at::embedding(embed_weight, in.block_tokens.clamp_max(vocab_size_ - 1));  // (1, K, H)
    Tensor x = at::where(is_mask.unsqueeze(-1), mask_embedding.to(emb.scalar_type()), emb);
    const Tensor cos4 = in.cos.unsqueeze(2), sin4 = in.sin.unsqueeze(2);  // (1, K, 1, D): broadcast over heads

    // 2. S_init
    OptionalTensor s_init;
    section.emplace(t, kInjection);
    if (injects_) {
      const DrafterLinear proj_r = w.linear("injection.proj_r"), proj_ds = w.linear("injection.proj_ds");
      const Tensor fused = linear(in.last_hidden.to(x.scalar_type()).reshape({1, -1}), proj_r);  // (1, r)
      s_init = linear(fused, proj_ds).view({-1, c.nheads, c.headdim, c.d_state});
    }
    const MambaSizes mamba_sizes{c.nheads, c.headdim, c.d_state, c.ngroups, c.mamba_eps};

    // 3. the layers
    section.reset();
    const auto norm = [&](const Tensor& rows, const Tensor& weight) {
      Timed timed_norm(t, kNorm);
      return rms_norm(rows, weight, c.eps, c.norm_kernel);
    };
    const auto residual = [&](const Tensor& rows, const Tensor& update) {
      Timed timed_add(t, kResidual);
      return rows + update;
    };
    size_t attention_index = 0;
    for (const int64_t layout : layers_) {
      if (layout & 1) {
        const Tensor& weight = w.tensor("mamba_norm.weight");
        x = residual(x, mamba(norm(x, weight), s_init, w, mamba_sizes, t));
      }
      if (layout & 2) {
        const Tensor& weight = w.tensor("attn_norm.weight");
        TORCH_CHECK(2 * attention_index + 1 < in.context.size(), "native_propose: no context K/V for attention "
                    "module ", attention_index, " (", in.context.size(), " tensors)");
        const Tensor& ck = in.context[2 * attention_index];
        const Tensor& cv = in.context[2 * attention_index + 1];
        TORCH_CHECK(ck.dim() == 4 && ck.size(0) == 1 && ck.size(1) == context_length && cv.sizes() == ck.sizes(),
                    "native_propose: context K/V ", attention_index, " must be (1, ", context_length,
                    ", Hkv, D) twice, got ", ck.sizes(), " and ", cv.sizes());
        x = residual(x, attention(norm(x, weight), cos4, sin4, ck, cv, in.context_mask, in.context_keys, w, c, t));
        ++attention_index;
      }
      const Tensor& weight = w.tensor("mlp_norm.weight");
      x = residual(x, mlp(norm(x, weight), w, t));
    }
    TORCH_CHECK(2 * attention_index == in.context.size(), "native_propose: ", in.context.size(),
                " context tensors for ", attention_index, " attention modules");

    // 4. final norm, pruned-vocabulary head
    const Tensor& final_norm = w.tensor("norm.weight");
    const DrafterLinear head = w.linear("head");
    const Tensor normed = norm(x, final_norm);
    section.emplace(t, kHead);
    const Tensor logits = linear(normed, head);  // (1, K, Vp)
    section.reset();

    // 5. the greedy Markov loop (NeuralDrafter.greedy_block)
    const Tensor& draft_vocab_ids = w.tensor("head.draft_vocab_ids");  // (Vp,) long
    OptionalTensor w1, w2;
    std::optional<DrafterLinear> w2_linear;
    if (markov_ == 1) {
      w1 = w.tensor("markov.W1");
      w2 = w.tensor("markov.W2");
    } else if (markov_ == 2) {
      w1 = w.tensor("markov.W1");
      w2_linear = w.linear("markov.W2 int8");
    }
    w.check_end();
    TORCH_CHECK(draft_vocab_ids.scalar_type() == at::kLong && draft_vocab_ids.is_contiguous(),
                "native_propose: the draft vocabulary must be contiguous long ids, got ", draft_vocab_ids.scalar_type());
    const int64_t* vocab = draft_vocab_ids.data_ptr<int64_t>();
    int64_t prev = in.anchor;  // a target id
    std::vector<int64_t> tokens, targets;
    std::vector<float> confidence;
    const int64_t vp = logits.size(2);
    TORCH_CHECK(logits.is_contiguous() && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
                "native_propose: the head's logits must be contiguous float32 or bfloat16, got ", logits.scalar_type());
    std::vector<float> slot(static_cast<size_t>(vp));  // l_k in fp32, reused by every slot
    const Tensor values = at::from_blob(slot.data(), {vp}, at::TensorOptions().dtype(at::kFloat));
    for (int64_t k = 0; k < length; ++k) {
      OptionalTensor correction;  // (Vp,) W2(W1[prev]) in the logits' dtype
      if (markov_ != 0) {
        TORCH_CHECK(prev >= 0 && prev < w1->size(0), "native_propose: token ", prev, " outside the Markov head's ",
                    w1->size(0), " rows");
        Timed timed_product(t, kMarkovProduct);
        const auto make = [&] {
          const Tensor low_rank = w1->select(0, prev).view({1, 1, -1});  // (1, 1, r): W1[prev], as its embedding
          Tensor made = (markov_ == 1 ? at::matmul(low_rank, *w2) : linear(low_rank, *w2_linear)).view({-1});
          if (made.scalar_type() != logits.scalar_type()) {  // promoted as ATen's add would, then rounded
            made = made.to(at::result_type(logits, made)).to(logits.scalar_type());
          }
          return made.contiguous();
        };
        correction = markov_ == 2 && keep_corrections_ ? corrections_.get(prev, make) : make();
      }
      Timed timed_select(t, kMarkovSelect);
      // l_k = U_k + W2(W1[prev]) rounded to the logits' dtype (as ATen's add rounds it), in fp32
      const auto slot_logits = [&](const auto* backbone) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(backbone)>>;
        const T* u = backbone + k * vp;
        if (correction.has_value()) {
          const T* cr = correction->data_ptr<T>();
          for (int64_t i = 0; i < vp; ++i) slot[i] = round_to<T>(widen(u[i]) + widen(cr[i]));
        } else {
          for (int64_t i = 0; i < vp; ++i) slot[i] = widen(u[i]);
        }
      };
      if (logits.scalar_type() == at::kFloat) {
        slot_logits(logits.data_ptr<float>());
      } else {
        slot_logits(logits.data_ptr<c10::BFloat16>());
      }
      // argmax (the first of equal maxima, as torch.max) and 1 / sum(exp(l - max)) in fp32
      int64_t best = 0;
      for (int64_t i = 1; i < vp; ++i) {
        if (slot[i] > slot[best]) best = i;
      }
      // ATen's vectorized exp and sum, as the Python path's (a scalar exp of 8,192 values cost ~0.1 ms a slot),
      // in place: l_k is not needed after
      const float total = values.sub_(slot[best]).exp_().sum().item<float>();
      tokens.push_back(best);
      confidence.push_back(1.0f / total);
      prev = vocab[best];  // PrunedVocabHead.to_target_ids
      targets.push_back(prev);
    }
    section.emplace(t, kOutputs);
    const auto long_options = at::TensorOptions().dtype(at::kLong);
    const Tensor drafts = at::tensor(targets, long_options).view({1, length});
    const Tensor local = at::tensor(tokens, long_options).view({1, length});
    const Tensor confidences = at::tensor(confidence, at::TensorOptions().dtype(at::kFloat)).view({1, length});
    section.reset();
    Tensor sections = at::empty({0}, at::TensorOptions().dtype(at::kDouble));
    if (t != nullptr) {
      sections = at::empty({kSections + 1, 2}, sections.options());
      double* out = sections.data_ptr<double>();
      for (int i = 0; i < kSections; ++i) out[2 * i] = t->thread_ns[i], out[2 * i + 1] = t->wall_ns[i];
      out[2 * kSections] = thread_cpu_ns() - t->call_thread_start;
      out[2 * kSections + 1] =
          std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t->call_wall_start).count();
    }
    return {drafts, local, confidences, logits, sections};
  }

  std::vector<OptionalTensor> weights_;
  std::vector<bool> row_invariant_;
  std::vector<int64_t> layers_;
  int64_t mask_token_id_, vocab_size_, markov_;
  bool injects_;
  Sizes sizes_{};
  OptionalTensor inv_freq_;
  Tensor rope_cos_, rope_sin_;  // (1, T, D) the RoPE of positions rope_start_.. (`rope_rows`)
  int64_t rope_start_ = 0;
  std::mutex rope_mutex_;
  bool keep_corrections_;
  mutable Corrections corrections_;  // markov 2 only, where keep_corrections_
};

// The names of the sections `propose` times, in the rows' order of its timings.
std::vector<std::string> section_names() { return {kSectionNames.begin(), kSectionNames.end()}; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  pybind11::class_<Proposer>(module, "Proposer", "`propose` bound to one drafter's weights (native.py)")
      .def(pybind11::init<std::vector<OptionalTensor>, std::vector<bool>, std::vector<int64_t>, int64_t, int64_t,
                          bool, int64_t, std::vector<int64_t>, double, double, bool, bool, bool, OptionalTensor,
                          bool>())
      .def("propose", &Proposer::propose, "H-Spec's greedy proposal for one sequence (native_propose.cpp)")
      .def("propose_in_pool", &Proposer::propose_in_pool,
           "H-Spec's greedy proposal for one sequence, its context read from the pool in place");
  module.def("section_names", &section_names, "the sections `propose` times where asked, in its rows' order");
  module.def("rope_cos_sin", &rope_cos_sin, "layers.rope_cos_sin at positions start..start+K-1, as the call makes it");
}
