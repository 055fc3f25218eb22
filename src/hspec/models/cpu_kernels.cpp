// hspec's own CPU kernels for the few rows of a decode or a verify: int8 and int4 weight-only products, the
// w4a8 and w8a8 integer products (rows rounded to int8 blocks, --dtype w4a8), the bf16 RMSNorm and attention, registered as torch.ops.hspec.* for the Python layers and decoder_stack.cpp alike
// (models/native.py builds them; docs/fast-path.md, "hspec's CPU kernels").
//
// Why: on an AVX2-only CPU torch's int4 kernel takes ~3x a row's time for 8 rows, its int8 one ~3x, and
// F.rms_norm ~40 us for one 576-wide row, 61 calls a SmolLM2 token. These kernels unpack a weight block
// once for up to 8 rows, and the norm is a loop. The attention kernel replaces ~25 operators a layer by
// one call, and its softmax exponentiates 8 scores at a time (std::exp one by one cost 20-25% of it).
//
// Row invariance by construction: an output element is the dot product of its input row with its weight
// row, summed over the inputs in one order that depends on K alone (8 fp32 lanes, blocks of 32 inputs
// in ascending order, the lanes added in a fixed tree at the end; the integer products sum each block
// exactly, then the blocks in ascending order), and a row rounded to int8 is rounded alone. How many rows share the call, how they
// are tiled and how many threads split the outputs never change it, so a verify row has the bits of its
// 1-token decode.
//
// Legend: M rows, K inputs, N outputs, a block = 32 inputs (an int4 group).

// ATen and the operator registry, not <torch/extension.h> (no Python binding here): the build takes about half as long.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define HSPEC_X86 1
#define HSPEC_AVX2 __attribute__((target("avx2,fma")))
// The integer products' vpdpbusd (AVX512-VNNI: one instruction where AVX2 takes maddubs, an int16 add and
// madd), on 512-bit vectors of 16 outputs.
#define HSPEC_VNNI __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")))
#endif
// Before a loop over a register tile's rows or vectors: unrolled whole, so that GCC keeps the tile's
// accumulators in registers (left to itself it stored all 24 of a 6-row tile's to the stack every step).
#define HSPEC_UNROLL _Pragma("GCC unroll 32")

namespace hspec {

// Whether this CPU runs the kernels (x86-64 with AVX2 and FMA); where it does not, models keep torch's.
bool cpu_kernels_available() {
#ifdef HSPEC_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#ifdef HSPEC_X86
namespace {

// Whether the kernels take their AVX-512 forms: the w4a8 and w8a8 products' VNNI tiles and the attention's
// 512-bit value sums. By default where the CPU has AVX512-VNNI (with VL and BW); HSPEC_CPU_CAPABILITY=avx2
// keeps the AVX2 forms, as torch's ATEN_CPU_CAPABILITY does for its kernels. Each AVX-512 form computes
// every output with the same integer sums and floating-point steps as its AVX2 form, so the outputs are
// equal bit for bit (tests/test_fast_path.py runs both). Read once per process.
bool avx512_kernels() {
  static const bool vnni = [] {
    const bool supported = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("avx512bw");
    const char* asked = std::getenv("HSPEC_CPU_CAPABILITY");
    if (asked == nullptr || *asked == '\0') return supported;
    const std::string name(asked);
    TORCH_CHECK(name == "avx2" || name == "avx512_vnni",
                "HSPEC_CPU_CAPABILITY must be avx2 or avx512_vnni, got '", name, "'");
    TORCH_CHECK(name == "avx2" || supported, "HSPEC_CPU_CAPABILITY=avx512_vnni, but this CPU lacks AVX512-VNNI");
    return name == "avx512_vnni";
  }();
  return vnni;
}

constexpr int64_t kBlock = 32;
// Most rows one tile keeps in registers; a call of more rows runs tile after tile over the same weights.
constexpr int kMaxTileRows = 8;
// Output tiles per thread chunk at least (a tile is 1-8 outputs).
constexpr int64_t kGrain = 4;

inline void store(float* out, float value) { *out = value; }
inline void store(c10::BFloat16* out, float value) { *out = c10::BFloat16(value); }  // round to nearest even

inline float read(const float* p) { return *p; }
inline float read(const c10::BFloat16* p) { return static_cast<float>(*p); }

// Rows [row0, row0 + rows) of x (M, K) in fp32, block-major: [K/32][rows][32], so that a tile reads every
// row of a block from one pointer.
template <typename In>
std::vector<float> pack_rows(const In* x, int64_t k, int64_t row0, int64_t rows) {
  std::vector<float> packed(static_cast<size_t>(rows * k));
  for (int64_t r = 0; r < rows; ++r) {
    const In* row = x + (row0 + r) * k;
    for (int64_t i = 0; i < k; ++i) packed[((i / kBlock) * rows + r) * kBlock + i % kBlock] = read(row + i);
  }
  return packed;
}

HSPEC_AVX2 inline float lane_sum(__m256 v) {  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One tile: MT rows (block-major, `pack_rows`) times NT consecutive int4 output rows from n0.
template <int MT, int NT, typename Out>
HSPEC_AVX2 void int4_tile(const float* x, int64_t k, const uint8_t* levels, const float* step_offset, int64_t n0,
                          Out* out, int64_t ldo) {
  const int64_t blocks = k / kBlock;
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi32(0xF);
  for (int64_t g = 0; g < blocks; ++g) {
    const float* xg = x + g * kBlock * MT;
    for (int j = 0; j < NT; ++j) {
      const int64_t at = (n0 + j) * blocks + g;
      const uint8_t* b = levels + at * 16;  // byte i: input i in its low nibble, input i + 16 in its high one
      const __m256 step = _mm256_broadcast_ss(step_offset + 2 * at);
      const __m256 offset = _mm256_broadcast_ss(step_offset + 2 * at + 1);
      const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
      const __m256i high = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8)));
      const __m256i quarters[4] = {_mm256_and_si256(low, nibble), _mm256_and_si256(high, nibble),
                                   _mm256_srli_epi32(low, 4), _mm256_srli_epi32(high, 4)};
      for (int q = 0; q < 4; ++q) {  // inputs 8q .. 8q + 7 of the block
        const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quarters[q]), step, offset);  // level * step + offset
        for (int m = 0; m < MT; ++m) acc[m][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + m * kBlock + 8 * q), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) store(out + m * ldo + n0 + j, lane_sum(acc[m][j]));
}

// 8 fp32 values from 8 bf16 or fp32 ones.
HSPEC_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
HSPEC_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The first n (1-8) of 8 values as fp32, the other lanes 0, nothing read past them; `used` has lane i set
// for i < n. bf16 has no masked 16-bit load in AVX2: the n values go through a zeroed buffer.
HSPEC_AVX2 inline __m256 load8_first(const float* p, int64_t, __m256i used) { return _mm256_maskload_ps(p, used); }
HSPEC_AVX2 inline __m256 load8_first(const c10::BFloat16* p, int64_t n, __m256i) {
  c10::BFloat16 first[8] = {};
  std::memcpy(first, p, static_cast<size_t>(n) * sizeof(c10::BFloat16));
  return load8(first);
}

// The first index of the largest of n values (bf16 or fp32) of one row, a NaN counting as larger than any
// number (torch.argmax's order, which `sampling.greedy_tokens` reads). Two passes, each a few instructions a
// vector and free of branches on the data: the largest value in 4 x 8 lanes (vmaxps; whether any value is a
// NaN beside it), then the first index holding a value equal to it (a float compare, so -0 and +0 are equal,
// as torch's compare finds them). A NaN anywhere sends the row to a loop that returns the first.
template <typename In>
HSPEC_AVX2 int64_t first_argmax(const In* row, int64_t n) {
  constexpr int64_t kStride = 32;
  const int64_t vectors_end = n - n % kStride;
  float best = -std::numeric_limits<float>::infinity();
  bool unordered = false;
  if (vectors_end > 0) {
    __m256 m0 = _mm256_set1_ps(best), m1 = m0, m2 = m0, m3 = m0, nan = _mm256_setzero_ps();
    for (int64_t i = 0; i < vectors_end; i += kStride) {
      const __m256 a0 = load8(row + i), a1 = load8(row + i + 8), a2 = load8(row + i + 16), a3 = load8(row + i + 24);
      nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a0, a1, _CMP_UNORD_Q), _mm256_cmp_ps(a2, a3, _CMP_UNORD_Q)));
      m0 = _mm256_max_ps(m0, a0);
      m1 = _mm256_max_ps(m1, a1);
      m2 = _mm256_max_ps(m2, a2);
      m3 = _mm256_max_ps(m3, a3);
    }
    unordered = _mm256_movemask_ps(nan) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (const float lane : lanes) best = std::max(best, lane);
  }
  for (int64_t i = vectors_end; i < n; ++i) {
    const float value = read(row + i);
    unordered = unordered || std::isnan(value);
    best = std::max(best, value);
  }
  if (unordered) {
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(read(row + i))) return i;
    }
  }
  const __m256 target = _mm256_set1_ps(best);
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    const int equal = _mm256_movemask_ps(_mm256_cmp_ps(load8(row + i), target, _CMP_EQ_OQ));
    if (equal != 0) return i + __builtin_ctz(static_cast<unsigned>(equal));
  }
  for (int64_t i = n - n % 8; i < n; ++i) {
    if (read(row + i) == best) return i;
  }
  TORCH_CHECK(false, "hspec::greedy_tokens: no value equals the row's largest");  // unreachable without NaNs
}

// 8-value vectors of KV keys or values in a 64-byte cache line: the attention prefetches one address a line.
template <typename KV>
constexpr int kVectorsPerLine = 64 / (8 * static_cast<int>(sizeof(KV)));

// Rows [row0, row0 + rows) of x (M, K) as int8 blocks of 32 (llama.cpp's Q8_1): per block of a row a step
// d = max |x| / 127 and levels q = x * (127 / max |x|) rounded to nearest even (-127..127), block-major like
// pack_rows ([K/32][rows][32]), with d, d * sum(q) and 128 * sum(q) (an int32, for the wide w8a8 tile) per
// [K/32][rows]. A row's levels depend on that row alone.
struct Int8Rows {
  std::vector<int8_t> levels;
  std::vector<float> step, step_sum;
  std::vector<int32_t> shifted_sum;
};

template <typename In>
HSPEC_AVX2 Int8Rows quantize_rows(const In* x, int64_t k, int64_t row0, int64_t rows) {
  const int64_t blocks = k / kBlock;
  const auto per_block = static_cast<size_t>(blocks * rows);
  Int8Rows q{std::vector<int8_t>(static_cast<size_t>(rows * k)), std::vector<float>(per_block),
             std::vector<float>(per_block), std::vector<int32_t>(per_block)};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < blocks; ++g) {
      const In* v = x + (row0 + r) * k + g * kBlock;
      __m256 values[4];
      __m256 largest = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        values[c] = load8(v + 8 * c);
        largest = _mm256_max_ps(largest, _mm256_and_ps(values[c], magnitude));
      }
      __m128 top = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
      top = _mm_max_ps(top, _mm_movehl_ps(top, top));
      const float most = _mm_cvtss_f32(_mm_max_ss(top, _mm_movehdup_ps(top)));
      const __m256 inverse = _mm256_set1_ps(most > 0.0f ? 127.0f / most : 0.0f);
      __m256i level[4];
      for (int c = 0; c < 4; ++c) level[c] = _mm256_cvtps_epi32(_mm256_mul_ps(values[c], inverse));  // nearest even
      const __m256i total = _mm256_add_epi32(_mm256_add_epi32(level[0], level[1]), _mm256_add_epi32(level[2], level[3]));
      const __m256i packed = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(level[0], level[1]), _mm256_packs_epi32(level[2], level[3])), in_order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.levels.data() + (g * rows + r) * kBlock), packed);
      __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
      sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
      const float step = most / 127.0f;
      const int32_t level_sum = _mm_cvtsi128_si32(sum);
      q.step[g * rows + r] = step;
      q.step_sum[g * rows + r] = step * static_cast<float>(level_sum);
      q.shifted_sum[g * rows + r] = 128 * level_sum;
    }
  }
  return q;
}

// w4a8 weights in tiles (models.formats.w4a8.pack_w4a8; where each tile's blocks lie: `TileBlocks`): for each
// 8 consecutive outputs and block of 32 inputs
// 160 bytes: 128 bytes of levels, then the 8 outputs' bf16 steps and their 8 bf16 zeros; a weight is
// level * step + (zero - 8 step) in fp32 (the same levels, steps and zeros as llama.cpp's Q4_1 blocks).
// The levels are laid out for products whose lanes are outputs: 8 vectors of 32 levels, vector q holding
// inputs 4q .. 4q + 3 of output j in bytes 4j .. 4j + 3; 32-byte chunk c holds vector 2c in its low
// nibbles and vector 2c + 1 in its high ones.
constexpr int kW4a8Outputs = 8;
constexpr int64_t kW4a8Tile = kW4a8Outputs * (kBlock / 2 + 4);
// Bytes per 8 outputs and block of 32 inputs of a w8a8 weight (`w8a8_tile`).
constexpr int64_t kW8a8Tile = kW4a8Outputs * kBlock;

// Where the blocks of one tile of 8 outputs lie in a packed w4a8 or w8a8 weight: the tiles come in pairs
// (2p, 2p + 1) whose blocks alternate, tile 2p's block g, then tile 2p + 1's, then block g + 1
// (models.formats.w4a8, `_pairs_interleaved`), and a last tile where N / 8 is odd stands alone, its blocks in
// order. Block g of the tile starts at first + g * stride; in a pair, the second tile's block g follows the
// first's. So the VNNI tiles, which take a pair's 16 outputs at once, read one run of memory in order: on Zen 4
// the hardware prefetchers followed one such run and not the two runs K / 32 blocks apart of tiles stored one
// after the other, and a product of several rows with its weights in memory ran at 0.5-0.7x its speed with them
// in the caches (results/epyc_zen4/README.md).
struct TileBlocks {
  const uint8_t* first;
  int64_t stride;
};

// The TileBlocks of outputs n0 .. n0 + 7 (n0 a multiple of 8) of a packed weight of n outputs, each tile
// `blocks` blocks of `tile_bytes`.
inline TileBlocks tile_blocks(const void* weight, int64_t n, int64_t n0, int64_t blocks, int64_t tile_bytes) {
  const auto* base = static_cast<const uint8_t*>(weight);
  const int64_t tile = n0 / kW4a8Outputs;
  if (tile < n / (2 * kW4a8Outputs) * 2) {
    return {base + ((tile - tile % 2) * blocks + tile % 2) * tile_bytes, 2 * tile_bytes};
  }
  return {base + tile * blocks * tile_bytes, tile_bytes};
}

// 8 bf16 -> 8 fp32.
HSPEC_AVX2 inline __m256 bf16x8(const uint8_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// 4 bytes of a row's int8 block, inputs 4q .. 4q + 3, in every 32-bit lane.
HSPEC_AVX2 inline __m256i inputs_in_every_lane(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  return _mm256_set1_epi32(four);
}

// One block of a w4a8 tile (`tile`: its 160 bytes): the 8 vectors of levels (0..15) into w, and the 8 outputs'
// steps and offsets (zero - 8 step) in fp32. nibble: 0x0F in every byte.
HSPEC_AVX2 inline void unpack_w4a8_block(const uint8_t* tile, __m256i nibble, __m256i* w, __m256& step, __m256& offset) {
  for (int c = 0; c < 4; ++c) {
    const __m256i chunk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * c));
    w[2 * c] = _mm256_and_si256(chunk, nibble);
    w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), nibble);
  }
  step = bf16x8(tile + 128);
  offset = _mm256_fmadd_ps(_mm256_set1_ps(-8.0f), step, bf16x8(tile + 144));
}

// Lane j of `values` into out[j], each converted as `store` converts one value (c10's rounding for bf16).
template <typename Out>
HSPEC_AVX2 inline void store8(Out* out, __m256 values) {
  alignas(32) float lanes[kW4a8Outputs];
  _mm256_store_ps(lanes, values);
  for (int j = 0; j < kW4a8Outputs; ++j) store(out + j, lanes[j]);
}

// The scales of outputs n0 .. n0 + 7 as fp32 lanes.
template <typename Scale>
HSPEC_AVX2 inline __m256 scales8(const Scale* scale, int64_t n0) {
  alignas(32) float lanes[kW4a8Outputs];
  for (int j = 0; j < kW4a8Outputs; ++j) lanes[j] = read(scale + n0 + j);
  return _mm256_load_ps(lanes);
}

// One tile: MT int8 rows (`quantize_rows`) times the 8 w4a8 outputs from n0, lane j of each vector being
// output n0 + j. Per block and row, maddubs multiplies vector q's levels (0..15) by the row's inputs
// 4q .. 4q + 3 (-127..127) and adds them in pairs; the 8 vectors' pair sums add up in int16 (at most 8 x 2
// x 15 x 127 = 30,480, no overflow) and madd adds each output's two: every output's 32 products summed
// exactly, converted once and scaled by the weight's step times the row's. The offset term (the weight's
// offset times the row's d * sum(q)) is summed apart and added at the end. Every output's sums run in
// block order whatever MT, n0 or the thread. Halves: the tiles of 8 outputs taken block by block (2: both
// tiles of a pair, reading it in memory order; 1: one tile).
template <int MT, int Halves, typename Out>
HSPEC_AVX2 void w4a8_tile(const Int8Rows& x, int64_t k, TileBlocks tiles, int64_t n0, Out* out, int64_t ldo) {
  const int64_t blocks = k / kBlock;
  __m256 acc[Halves][MT], offsets[Halves][MT];
  for (int h = 0; h < Halves; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_ps(), offsets[h][m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nibble = _mm256_set1_epi8(0xF);
  for (int64_t g = 0; g < blocks; ++g) {
    HSPEC_UNROLL
    for (int h = 0; h < Halves; ++h) {
      __m256i w[8];
      __m256 step, offset;
      unpack_w4a8_block(tiles.first + g * tiles.stride + h * kW4a8Tile, nibble, w, step, offset);
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = x.levels.data() + (g * MT + m) * kBlock;
        __m256i pairs = _mm256_maddubs_epi16(w[0], inputs_in_every_lane(xm));
        for (int q = 1; q < 8; ++q) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[q], inputs_in_every_lane(xm + 4 * q)));
        const __m256 scale = _mm256_mul_ps(step, _mm256_set1_ps(x.step[g * MT + m]));
        acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), scale, acc[h][m]);
        offsets[h][m] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.step_sum[g * MT + m]), offsets[h][m]);
      }
    }
  }
  for (int h = 0; h < Halves; ++h)
    for (int m = 0; m < MT; ++m) store8(out + m * ldo + n0 + h * kW4a8Outputs, _mm256_add_ps(acc[h][m], offsets[h][m]));
}

// Blocks of inputs and tiles of 8 outputs per pass of `w4a8_tile_in_passes` (its buffers on the stack: 20 KB
// at 8 rows).
constexpr int64_t kPassBlocks = 64;
// Fewest rows for which the AVX2 w4a8 product takes `w4a8_tile_in_passes`: one row runs faster in one pass,
// two rows about as fast either way (results/avx2_zen1/ab_products.md; docs/fast-path.md, w4a8).
constexpr int kPassRows = 3;

// `w4a8_tile` for several rows, in two passes over each run of up to kPassBlocks blocks: first every block's
// integer sums for all MT rows (as fp32, exact) into a buffer, with the block's steps and offsets; then row by
// row the same floating-point steps as `w4a8_tile`, in block order, its two sums carried from run to run. So
// every output gets `w4a8_tile`'s bits. In one pass the 8 unpacked weight vectors, MT rows' two sums, the
// steps and temporaries exceed AVX2's 16 registers and GCC spills (docs/fast-path.md, w4a8); here the integer
// pass keeps the weights and a row's two pair-sum chains in registers, and the float pass a row's two sums.
template <int MT, int Halves, typename Out>
HSPEC_AVX2 void w4a8_tile_in_passes(const Int8Rows& x, int64_t k, TileBlocks tiles, int64_t n0, Out* out,
                                    int64_t ldo) {
  const int64_t blocks = k / kBlock;
  constexpr int64_t kRun = kPassBlocks / Halves;  // blocks a pass: the buffers as large whatever Halves
  alignas(32) float steps[kRun][Halves][kW4a8Outputs], offsets_of[kRun][Halves][kW4a8Outputs];
  alignas(32) float sums[kRun][Halves][MT][kW4a8Outputs];
  alignas(32) float acc[Halves][MT][kW4a8Outputs] = {}, offsets[Halves][MT][kW4a8Outputs] = {};
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nibble = _mm256_set1_epi8(0xF);
  for (int64_t g0 = 0; g0 < blocks; g0 += kRun) {
    const int64_t run = std::min(kRun, blocks - g0);
    for (int64_t bh = 0; bh < run * Halves; ++bh) {
      const int64_t b = bh / Halves, h = bh % Halves;
      __m256i w[8];
      __m256 step, offset;
      unpack_w4a8_block(tiles.first + (g0 + b) * tiles.stride + h * kW4a8Tile, nibble, w, step, offset);
      _mm256_store_ps(steps[b][h], step);
      _mm256_store_ps(offsets_of[b][h], offset);
      const int8_t* xg = x.levels.data() + (g0 + b) * MT * kBlock;
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = xg + m * kBlock;
        // Two chains of int16 pair sums, joined before madd: int16 addition is exact here, so the order of
        // the 8 pair sums does not change the block's sum.
        __m256i even = _mm256_maddubs_epi16(w[0], inputs_in_every_lane(xm));
        __m256i odd = _mm256_maddubs_epi16(w[1], inputs_in_every_lane(xm + 4));
        for (int q = 2; q < 8; q += 2) {
          even = _mm256_add_epi16(even, _mm256_maddubs_epi16(w[q], inputs_in_every_lane(xm + 4 * q)));
          odd = _mm256_add_epi16(odd, _mm256_maddubs_epi16(w[q + 1], inputs_in_every_lane(xm + 4 * q + 4)));
        }
        _mm256_store_ps(sums[b][h][m], _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(even, odd), ones)));
      }
    }
    HSPEC_UNROLL
    for (int h = 0; h < Halves; ++h) {
      for (int m = 0; m < MT; ++m) {
        __m256 sum = _mm256_load_ps(acc[h][m]), offset = _mm256_load_ps(offsets[h][m]);
        for (int64_t b = 0; b < run; ++b) {
          const int64_t at = (g0 + b) * MT + m;
          const __m256 scale = _mm256_mul_ps(_mm256_load_ps(steps[b][h]), _mm256_set1_ps(x.step[at]));
          sum = _mm256_fmadd_ps(_mm256_load_ps(sums[b][h][m]), scale, sum);
          offset = _mm256_fmadd_ps(_mm256_load_ps(offsets_of[b][h]), _mm256_set1_ps(x.step_sum[at]), offset);
        }
        _mm256_store_ps(acc[h][m], sum);
        _mm256_store_ps(offsets[h][m], offset);
      }
    }
  }
  for (int h = 0; h < Halves; ++h)
    for (int m = 0; m < MT; ++m) {
      store8(out + m * ldo + n0 + h * kW4a8Outputs,
             _mm256_add_ps(_mm256_load_ps(acc[h][m]), _mm256_load_ps(offsets[h][m])));
    }
}

// One tile: MT int8 rows (`quantize_rows`) times the 8 int8 outputs from n0 of a weight stored in tiles (N / 8, K / 32,
// 256, models.formats.w4a8.pack_w8a8, blocks where `TileBlocks` says: per block 8 vectors, vector q holding inputs 4q
// .. 4q + 3 of output j in bytes 4j .. 4j + 3), lane j of each vector being output n0 + j. Per vector, maddubs takes
// |w| and the row's inputs with w's signs (both within -127..127: a pair sum fits int16) and madd adds each output's
// pairs into int32; the 8 vectors add up to every output's 32 products, exactly, converted once and scaled by the row's
// step. The weight's scale multiplies the sum at the end. Every output's sums run in block order whatever MT, n0 or the
// thread.
template <int MT, int Halves, typename Out, typename Scale>
HSPEC_AVX2 void w8a8_tile(const Int8Rows& x, int64_t k, TileBlocks tiles, const Scale* scale, int64_t n0,
                          Out* out, int64_t ldo) {
  const int64_t blocks = k / kBlock;
  __m256 acc[Halves][MT];
  for (int h = 0; h < Halves; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < blocks; ++g) {
    HSPEC_UNROLL
    for (int h = 0; h < Halves; ++h) {
      const __m256i* tile = reinterpret_cast<const __m256i*>(tiles.first + g * tiles.stride + h * kW8a8Tile);
      __m256i w[8], magnitude[8];
      for (int q = 0; q < 8; ++q) {
        w[q] = _mm256_loadu_si256(tile + q);
        magnitude[q] = _mm256_abs_epi8(w[q]);
      }
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = x.levels.data() + (g * MT + m) * kBlock;
        __m256i sums = _mm256_setzero_si256();
        for (int q = 0; q < 8; ++q) {
          const __m256i signed_inputs = _mm256_sign_epi8(inputs_in_every_lane(xm + 4 * q), w[q]);
          sums = _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[q], signed_inputs), ones));
        }
        acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(x.step[g * MT + m]), acc[h][m]);
      }
    }
  }
  HSPEC_UNROLL
  for (int h = 0; h < Halves; ++h) {
    const __m256 weight_scale = scales8(scale, n0 + h * kW4a8Outputs);
    for (int m = 0; m < MT; ++m) store8(out + m * ldo + n0 + h * kW4a8Outputs, _mm256_mul_ps(acc[h][m], weight_scale));
  }
}

// The wide VNNI tiles: two adjacent tiles of 8 outputs side by side in 512-bit vectors (lanes 0-7 the
// outputs from n0, 8-15 those from n0 + 8), each lane computing exactly what `w4a8_tile` and `w8a8_tile` do
// for its output (the same integer sums, then the same floating-point steps). Per row and vector q of a
// block, one vpdpbusd adds the 4 products of each output's unsigned weight bytes with the row's signed
// inputs 4q .. 4q + 3 to its int32 sum, the inputs read as the instruction's broadcast memory operand.
//
// Register plan per block (docs/fast-path.md, "AVX512-VNNI tiles"): the 8 weight vectors, unpacked once for
// all the tile's rows, stay in registers, with MT fp32 sums (2 MT for w4a8: the offset term apart), so up to
// 8 rows fit the 32 zmm registers without a spill; a row then costs 8 vpdpbusd and 3-4 floating-point
// instructions a block, and no broadcast or shift of its inputs.

// 16 bf16 from two runs of 8 -> 16 fp32.
HSPEC_VNNI inline __m512 bf16x16(const uint8_t* low, const uint8_t* high) {
  const __m256i bits = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(high)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 32 bytes from `low` and 32 from `high` as one 512-bit vector.
HSPEC_VNNI inline __m512i join(const void* low, const void* high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)), 1);
}

// sums + the 4-byte dot products of `weights` (unsigned bytes) with the 4 signed bytes at `inputs` in every
// 32-bit lane: vpdpbusd with an embedded-broadcast memory operand. Written in assembly because GCC loads the
// broadcast into a register first (one more instruction per row and vector q).
HSPEC_VNNI inline __m512i dot_with_broadcast(__m512i sums, __m512i weights, const int8_t* inputs) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sums) : "v"(weights), "m"(*reinterpret_cast<const int32_t*>(inputs)));
  return sums;
}

// `dot_with_broadcast` on 8 lanes (AVX512-VL): the narrow tiles' vectors of one tile's 8 outputs.
HSPEC_VNNI inline __m256i dot_with_broadcast(__m256i sums, __m256i weights, const int8_t* inputs) {
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(sums) : "v"(weights), "m"(*reinterpret_cast<const int32_t*>(inputs)));
  return sums;
}

HSPEC_VNNI inline __m512i add32(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }
HSPEC_VNNI inline __m256i add32(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }

// Independent vpdpbusd chains per row and block: one row alone would otherwise wait out each vpdpbusd's latency
// in turn (a tile of 8 rows has 8 chains already).
constexpr int dot_chains(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

// One row's integer sums over a block, lane by lane: the 8 vpdpbusd of weights w[q] (unsigned bytes) with the
// row's inputs 4q .. 4q + 3, spread over `Chains` sums added at the end (exact int32 sums: the same sum in
// any order).
template <int Chains, typename V>
HSPEC_VNNI inline V block_dot(const V* w, const int8_t* inputs) {
  V sums[Chains];
  for (int c = 0; c < Chains; ++c) sums[c] = V{};
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) sums[q % Chains] = dot_with_broadcast(sums[q % Chains], w[q], inputs + 4 * q);
  for (int c = 1; c < Chains; ++c) sums[0] = add32(sums[0], sums[c]);
  return sums[0];
}

// 16 fp32 -> 16 bf16 rounded to nearest even, NaN to 0x7FC0: c10::BFloat16(float)'s bits, 16 lanes at once.
HSPEC_VNNI inline __m256i bf16_of(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

HSPEC_VNNI inline void store16(float* out, __m512 values) { _mm512_storeu_ps(out, values); }
HSPEC_VNNI inline void store16(c10::BFloat16* out, __m512 values) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16_of(values));
}

// The 16 lanes of each of MT rows into outputs n0 .. n0 + 15 of out (MT, ldo).
template <int MT, typename Out>
HSPEC_VNNI inline void store_wide_rows(const __m512* sums, int64_t n0, Out* out, int64_t ldo) {
  for (int m = 0; m < MT; ++m) store16(out + m * ldo + n0, sums[m]);
}

// `w4a8_tile` over the 16 outputs of a pair of tiles from n0 (`tiles`: the pair's first).
template <int MT, typename Out>
HSPEC_VNNI void w4a8_tile_wide(const Int8Rows& x, int64_t k, TileBlocks tiles, int64_t n0, Out* out, int64_t ldo) {
  const int64_t blocks = k / kBlock;
  __m512 acc[MT], offsets[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps(), offsets[m] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0xF);
  for (int64_t g = 0; g < blocks; ++g) {
    const uint8_t* a = tiles.first + g * tiles.stride;
    const uint8_t* b = a + kW4a8Tile;
    __m512i w[8];
    for (int c = 0; c < 4; ++c) {
      const __m512i chunk = join(a + 32 * c, b + 32 * c);
      w[2 * c] = _mm512_and_si512(chunk, nibble);
      w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), nibble);
    }
    const __m512 step = bf16x16(a + 128, b + 128);
    const __m512 offset = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), step, bf16x16(a + 144, b + 144));
    const int8_t* xg = x.levels.data() + g * MT * kBlock;
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512i sums = block_dot<dot_chains(MT)>(w, xg + m * kBlock);
      const __m512 scale = _mm512_mul_ps(step, _mm512_set1_ps(x.step[g * MT + m]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[m]);
      offsets[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.step_sum[g * MT + m]), offsets[m]);
    }
  }
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_add_ps(acc[m], offsets[m]);
  store_wide_rows<MT>(acc, n0, out, ldo);
}

// `w8a8_tile` over the 16 outputs of a pair of tiles from n0 (`tiles`: the pair's first). vpdpbusd takes unsigned bytes
// in its register operand and signed ones in the broadcast, so the weights enter shifted to unsigned, w + 128 (one XOR
// per vector a block, shared by the tile's rows), against the row's signed inputs, and each row's 128 * sum(q) over the
// block (`quantize_rows`) comes off: the exact sum of w x.
template <int MT, typename Out, typename Scale>
HSPEC_VNNI void w8a8_tile_wide(const Int8Rows& x, int64_t k, TileBlocks tiles, const Scale* scale, int64_t n0,
                               Out* out, int64_t ldo) {
  const int64_t blocks = k / kBlock;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i shift = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < blocks; ++g) {
    const uint8_t* a = tiles.first + g * tiles.stride;
    const uint8_t* b = a + kW8a8Tile;
    __m512i w[8];
    for (int q = 0; q < 8; ++q) w[q] = _mm512_xor_si512(join(a + 32 * q, b + 32 * q), shift);
    const int8_t* xg = x.levels.data() + g * MT * kBlock;
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512i sums = _mm512_sub_epi32(block_dot<dot_chains(MT)>(w, xg + m * kBlock),
                                            _mm512_set1_epi32(x.shifted_sum[g * MT + m]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(x.step[g * MT + m]), acc[m]);
    }
  }
  alignas(64) float scales[2 * kW4a8Outputs];
  for (int j = 0; j < 2 * kW4a8Outputs; ++j) scales[j] = read(scale + n0 + j);
  const __m512 weight_scale = _mm512_load_ps(scales);
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_mul_ps(acc[m], weight_scale);
  store_wide_rows<MT>(acc, n0, out, ldo);
}

// The narrow VNNI tiles: `w4a8_tile` and `w8a8_tile` with vpdpbusd on 8 lanes, over `Halves` tiles of 8 outputs
// (the two of a pair block by block, in memory order, or a last tile alone), for products of at most
// kNarrowRows rows. With few rows a product is bound by reading its weights, and 256-bit vectors read a pair
// as fast as the wide tiles' 512-bit ones with fewer instructions; the wide tiles take more rows, where the
// multiply-adds bound it and a 512-bit vpdpbusd does twice the work of a 256-bit one for the same broadcast
// operand. Both give the AVX2 tiles' bits (the same exact integer sums, then the same floating-point steps in
// the same order).
constexpr int64_t kNarrowRows = 2;


template <int MT, int Halves, typename Out>
HSPEC_VNNI void w4a8_tile_narrow(const Int8Rows& x, int64_t k, TileBlocks tiles, int64_t n0, Out* out,
                                 int64_t ldo) {
  const int64_t blocks = k / kBlock;
  __m256 acc[Halves][MT], offsets[Halves][MT];
  for (int h = 0; h < Halves; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_ps(), offsets[h][m] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0xF);
  for (int64_t g = 0; g < blocks; ++g) {
    HSPEC_UNROLL
    for (int h = 0; h < Halves; ++h) {
      __m256i w[8];
      __m256 step, offset;
      unpack_w4a8_block(tiles.first + g * tiles.stride + h * kW4a8Tile, nibble, w, step, offset);
      for (int m = 0; m < MT; ++m) {
        const __m256i sums = block_dot<dot_chains(MT)>(w, x.levels.data() + (g * MT + m) * kBlock);
        const __m256 scale = _mm256_mul_ps(step, _mm256_set1_ps(x.step[g * MT + m]));
        acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[h][m]);
        offsets[h][m] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.step_sum[g * MT + m]), offsets[h][m]);
      }
    }
  }
  for (int h = 0; h < Halves; ++h)
    for (int m = 0; m < MT; ++m) store8(out + m * ldo + n0 + h * kW4a8Outputs, _mm256_add_ps(acc[h][m], offsets[h][m]));
}

template <int MT, int Halves, typename Out, typename Scale>
HSPEC_VNNI void w8a8_tile_narrow(const Int8Rows& x, int64_t k, TileBlocks tiles, const Scale* scale, int64_t n0,
                                 Out* out, int64_t ldo) {
  const int64_t blocks = k / kBlock;
  __m256 acc[Halves][MT];
  for (int h = 0; h < Halves; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_ps();
  const __m256i shift = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < blocks; ++g) {
    HSPEC_UNROLL
    for (int h = 0; h < Halves; ++h) {
      const __m256i* tile = reinterpret_cast<const __m256i*>(tiles.first + g * tiles.stride + h * kW8a8Tile);
      __m256i w[8];
      for (int q = 0; q < 8; ++q) w[q] = _mm256_xor_si256(_mm256_loadu_si256(tile + q), shift);
      for (int m = 0; m < MT; ++m) {
        const __m256i sums = _mm256_sub_epi32(block_dot<dot_chains(MT)>(w, x.levels.data() + (g * MT + m) * kBlock),
                                              _mm256_set1_epi32(x.shifted_sum[g * MT + m]));
        acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(x.step[g * MT + m]), acc[h][m]);
      }
    }
  }
  HSPEC_UNROLL
  for (int h = 0; h < Halves; ++h) {
    const __m256 weight_scale = scales8(scale, n0 + h * kW4a8Outputs);
    for (int m = 0; m < MT; ++m) {
      store8(out + m * ldo + n0 + h * kW4a8Outputs, _mm256_mul_ps(acc[h][m], weight_scale));
    }
  }
}

// One tile: MT rows times NT consecutive int8 output rows from n0, each scaled once summed.
template <int MT, int NT, typename Out, typename Scale>
HSPEC_AVX2 void int8_tile(const float* x, int64_t k, const int8_t* weight, const Scale* scale, int64_t n0, Out* out,
                          int64_t ldo) {
  const int64_t blocks = k / kBlock;
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < blocks; ++g) {
    const float* xg = x + g * kBlock * MT;
    for (int j = 0; j < NT; ++j) {
      const int8_t* row = weight + (n0 + j) * k + g * kBlock;
      for (int q = 0; q < 4; ++q) {
        const __m256 w = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * q))));
        for (int m = 0; m < MT; ++m) acc[m][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + m * kBlock + 8 * q), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) store(out + m * ldo + n0 + j, lane_sum(acc[m][j]) * read(scale + n0 + j));
}

// Outputs per tile for MT rows: as many accumulators as registers allow (16 ymm: MT * NT <= 8 leaves
// room for the unpacked weights), so that a decode's one row still keeps 8 sums in flight.
template <int MT>
constexpr int tile_outputs() {
  return MT == 1 ? 8 : MT == 2 ? 4 : MT <= 4 ? 2 : 1;
}

// Every output of MT rows: tiles of NT outputs split among threads, the N % NT last ones one at a time.
template <int MT, typename Tile>
void for_each_tile(int64_t n, const Tile& tile) {
  constexpr int NT = tile_outputs<MT>();
  const int64_t tiles = n / NT;
  at::parallel_for(0, tiles, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tile(std::integral_constant<int, NT>(), t * NT);
  });
  for (int64_t n0 = tiles * NT; n0 < n; ++n0) tile(std::integral_constant<int, 1>(), n0);
}

// Calls body(std::integral_constant<int, MT>(), row0) for the tiles of up to kMaxTileRows rows of M.
template <typename Body>
void for_each_row_tile(int64_t m, const Body& body) {
  for (int64_t row0 = 0; row0 < m; row0 += kMaxTileRows) {
    switch (std::min<int64_t>(m - row0, kMaxTileRows)) {
      case 8: body(std::integral_constant<int, 8>(), row0); break;
      case 7: body(std::integral_constant<int, 7>(), row0); break;
      case 6: body(std::integral_constant<int, 6>(), row0); break;
      case 5: body(std::integral_constant<int, 5>(), row0); break;
      case 4: body(std::integral_constant<int, 4>(), row0); break;
      case 3: body(std::integral_constant<int, 3>(), row0); break;
      case 2: body(std::integral_constant<int, 2>(), row0); break;
      default: body(std::integral_constant<int, 1>(), row0); break;
    }
  }
}

// Every output of x's m rows: tiles of up to 8 rows, each packed once (`pack_rows`) and multiplied into every
// tile of outputs by tile(rows, outputs, packed, n0, out), rows and outputs the tile's sizes as integral
// constants, out the tile's first output row.
template <typename In, typename Out, typename Tile>
void tiled_product(const In* x, int64_t m, int64_t k, int64_t n, Out* out, const Tile& tile) {
  for_each_row_tile(m, [&](auto rows, int64_t row0) {
    const std::vector<float> packed = pack_rows(x, k, row0, decltype(rows)::value);
    for_each_tile<decltype(rows)::value>(n, [&](auto outputs, int64_t n0) {
      tile(rows, outputs, packed.data(), n0, out + row0 * n);
    });
  });
}

// Every output of x's m rows times w4a8 or w8a8 weights: tiles of up to 8 rows, each quantized once
// (`quantize_rows`) and multiplied into each pair of tiles of 8 outputs (`TileBlocks`), and the last 8 outputs
// alone where N / 8 is odd, by tile(rows, halves, quantized, n0, out): rows the row tile's size and halves the
// tiles of 8 outputs (2, or 1 for a last one alone) as integral constants, out the row tile's first output
// row. Every row tile runs over a pair before the next pair, so more than 8 rows (a tree's verify) read the
// weights from memory once, not once per row tile; each output's sums are the same either way.
template <typename In, typename Out, typename Tile>
void quantized_product(const In* x, int64_t m, int64_t k, int64_t n, Out* out, const Tile& tile) {
  std::vector<Int8Rows> quantized;
  for_each_row_tile(m, [&](auto rows, int64_t row0) {
    quantized.push_back(quantize_rows(x, k, row0, decltype(rows)::value));
  });
  const auto unit = [&](auto halves, int64_t n0) {
    for_each_row_tile(m, [&](auto rows, int64_t row0) {
      tile(rows, halves, quantized[row0 / kMaxTileRows], n0, out + row0 * n);
    });
  };
  constexpr int64_t kPair = 2 * kW4a8Outputs;
  const int64_t pairs = n / kPair;
  at::parallel_for(0, pairs, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) unit(std::integral_constant<int, 2>(), t * kPair);
  });
  if (pairs * kPair < n) unit(std::integral_constant<int, 1>(), pairs * kPair);
}

// 8 lanes over the first h - h % 8 values, then the rest one by one.
HSPEC_AVX2 float sum_of_squares(const c10::BFloat16* row, int64_t h) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
    const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));  // bf16 -> fp32
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = lane_sum(acc);
  for (; i < h; ++i) sum += static_cast<float>(row[i]) * static_cast<float>(row[i]);
  return sum;
}

// 8 fp32 lanes rounded to bf16 as c10::BFloat16(float) rounds (nearest even, a NaN to 0x7FC0), the bits left
// in each 32-bit lane's low half: the glue kernels below take 8 values a step with the scalar conversion's bits.
HSPEC_AVX2 inline __m256i bf16_bits(__m256 values) {
  const __m256i bits = _mm256_castps_si256(values);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256 nan = _mm256_cmp_ps(values, values, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                              _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
}

// The bf16 value `bf16_bits` rounds to, as fp32 (exact).
HSPEC_AVX2 inline __m256 rounded_to_bf16(__m256 values) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(values), 16));
}

// 8 fp32 lanes stored as 8 bf16, rounded as `bf16_bits`.
HSPEC_AVX2 inline void store8_bf16(c10::BFloat16* out, __m256 values) {
  const __m256i bits = bf16_bits(values);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

// One row of hspec::rms_norm after its sum of squares: out = bf16(w * bf16(x * inverse)), 8 values a step,
// the last h % 8 one by one, each the scalar steps' bits.
HSPEC_AVX2 void scale_row(const c10::BFloat16* in, const c10::BFloat16* w, float inverse, int64_t h,
                          c10::BFloat16* out) {
  const __m256 by = _mm256_set1_ps(inverse);
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    const __m256 normed = rounded_to_bf16(_mm256_mul_ps(load8(in + i), by));
    store8_bf16(out + i, _mm256_mul_ps(load8(w + i), normed));
  }
  for (; i < h; ++i) {
    const c10::BFloat16 normed(static_cast<float>(in[i]) * inverse);
    out[i] = c10::BFloat16(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

// One head of d values rotated (apply_rope's x * cos + swapped * sin, each product and the sum rounded to bf16
// as torch's bf16 mul and add round), d a multiple of 16 so that a step of 8 never straddles the halves.
HSPEC_AVX2 void rotate_head(const c10::BFloat16* head, const c10::BFloat16* cos, const c10::BFloat16* sin, int64_t d,
                            c10::BFloat16* out) {
  const int64_t half = d / 2;
  for (int64_t e = 0; e < d; e += 8) {
    const __m256 turned = rounded_to_bf16(_mm256_mul_ps(load8(head + e), load8(cos + e)));
    const __m256 swapped = rounded_to_bf16(_mm256_mul_ps(load8(head + (e < half ? e + half : e - half)), load8(sin + e)));
    store8_bf16(out + e, _mm256_add_ps(turned, swapped));
  }
}

// The scores of R query rows q (R, D) of one KV head against up to 8 V consecutive keys from j0 (n of
// them) of K^T (D, S) with row stride ld: V vectors side by side per row, the last one masked where n is
// not a multiple of 8; each key vector is loaded once for the R rows. scores: R rows of stride lds.
template <int R, int V, typename KV>
HSPEC_AVX2 void score_block(const float* q, const KV* kt, int64_t ld, int64_t d, int64_t j0, int64_t n,
                            float* scores, int64_t lds) {
  const int64_t rest = n - 8 * (V - 1);  // keys in the last vector, 1-8
  const __m256i last = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rest)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 acc[R][V];
  HSPEC_UNROLL
  for (int r = 0; r < R; ++r)
    HSPEC_UNROLL
    for (int c = 0; c < V; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m256 qi[R];
    HSPEC_UNROLL
    for (int r = 0; r < R; ++r) qi[r] = _mm256_broadcast_ss(q + r * d + i);
    const KV* row = kt + i * ld + j0;
    // The same row two blocks on: a pass reads D rows of K^T side by side, more streams than the hardware
    // prefetcher follows, so each block's keys would otherwise come from memory at full latency. One
    // prefetch per 64-byte line: 2 vectors of fp32 keys, 4 of bf16.
    for (int c = 0; c < V; c += kVectorsPerLine<KV>) {
      _mm_prefetch(reinterpret_cast<const char*>(row + 16 * V + 8 * c), _MM_HINT_T0);
    }
    HSPEC_UNROLL
    for (int c = 0; c < V; ++c) {
      const __m256 keys = c < V - 1 || rest == 8 ? load8(row + 8 * c) : load8_first(row + 8 * c, rest, last);
      HSPEC_UNROLL
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(qi[r], keys, acc[r][c]);
    }
  }
  HSPEC_UNROLL
  for (int r = 0; r < R; ++r) {
    HSPEC_UNROLL
    for (int c = 0; c < V - 1; ++c) _mm256_storeu_ps(scores + r * lds + j0 + 8 * c, acc[r][c]);
    _mm256_maskstore_ps(scores + r * lds + j0 + 8 * (V - 1), last, acc[r][V - 1]);
  }
}

// The scores of R query rows q (R, D) of one KV head against keys j_begin <= j < j_end, K^T (D, S) with row
// stride ld, into scores (R, lds): score_rj = sum over d = 0..D-1 of q_rd k_dj, one FMA chain per (row, key) in d
// order, whichever vector lane the key falls in and however many rows share the pass, so a score depends
// on its row and key alone. KEYS keys at a time (64 for one row, 32 for up to 3, the accumulators fitting
// the 16 registers).
template <int R, typename KV>
HSPEC_AVX2 void key_scores(const float* q, const KV* kt, int64_t ld, int64_t d, int64_t j_begin, int64_t j_end,
                           float* scores, int64_t lds) {
  constexpr int64_t kKeys = R == 1 ? 64 : 32;
  for (int64_t j = j_begin; j < j_end; j += kKeys) {
    const int64_t n = std::min<int64_t>(kKeys, j_end - j);
    switch ((n + 7) / 8) {
      case 8: score_block<R, R == 1 ? 8 : 4, KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 7: score_block<R, R == 1 ? 7 : 4, KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 6: score_block<R, R == 1 ? 6 : 4, KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 5: score_block<R, R == 1 ? 5 : 4, KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 4: score_block<R, 4, KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 3: score_block<R, 3, KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 2: score_block<R, 2, KV>(q, kt, ld, d, j, n, scores, lds); break;
      default: score_block<R, 1, KV>(q, kt, ld, d, j, n, scores, lds); break;
    }
  }
}

// 16 fp32 values from 16 fp32 or bf16 ones (a bf16 value widened exactly: its bits, then 16 zero bits).
HSPEC_VNNI inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
HSPEC_VNNI inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// `load16` of the lanes set in `used`, the others 0, nothing read past them.
HSPEC_VNNI inline __m512 load16_used(const float* p, __mmask16 used) { return _mm512_maskz_loadu_ps(used, p); }
HSPEC_VNNI inline __m512 load16_used(const c10::BFloat16* p, __mmask16 used) {
  const __m256i bits = _mm256_maskz_loadu_epi16(used, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 32 consecutive bf16 values widened exactly to fp32 in two vectors, one instruction each (`load16` takes two
// a vector): even (lane l: value 2l, its bits shifted up) and odd (lane l: value 2l + 1, masked in place).
HSPEC_VNNI inline void load32_split(const c10::BFloat16* p, __m512& even, __m512& odd) {
  const __m512i bits = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 32 fp32 numbers in order (low: 0-15, high: 16-31) as `load32_split` lays them out (even, odd), and back.
HSPEC_VNNI inline void split_lanes(__m512 low, __m512 high, __m512& even, __m512& odd) {
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  even = _mm512_permutex2var_ps(low, evens, high);
  odd = _mm512_permutex2var_ps(low, _mm512_add_epi32(evens, _mm512_set1_epi32(1)), high);
}
HSPEC_VNNI inline void join_lanes(__m512 even, __m512 odd, __m512& low, __m512& high) {
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  low = _mm512_permutex2var_ps(even, first, odd);
  high = _mm512_permutex2var_ps(even, _mm512_add_epi32(first, _mm512_set1_epi32(8)), odd);
}

// `score_block_wide`'s prefetch: the same row of K^T two blocks of 16 V keys on, one address a 64-byte line.
template <int V, typename KV>
HSPEC_VNNI inline void prefetch_two_blocks_on(const KV* row) {
  HSPEC_UNROLL
  for (int c = 0; c < V; c += kVectorsPerLine<KV> / 2) {
    _mm_prefetch(reinterpret_cast<const char*>(row + 32 * V + 16 * c), _MM_HINT_T0);
  }
}

// The scores of R query rows q (R, D) against up to 16 V consecutive keys from j0 (n of them, 1 <= n <= 16 V)
// of K^T (D, S) with row stride ld, in 512-bit vectors (AVX-512): `score_block`'s FMA chain per (row, key),
// 16 keys a vector; lanes past the n keys load 0 and are not stored. scores: R rows of stride lds.
template <int R, int V, typename KV>
HSPEC_VNNI void score_block_wide(const float* q, const KV* kt, int64_t ld, int64_t d, int64_t j0, int64_t n,
                                 float* scores, int64_t lds) {
  __mmask16 used[V];
  HSPEC_UNROLL
  for (int c = 0; c < V; ++c) {
    const int64_t rest = n - 16 * c;
    used[c] = rest >= 16 ? 0xFFFF : rest <= 0 ? 0 : static_cast<__mmask16>((1u << rest) - 1);
  }
  __m512 acc[R][V];
  HSPEC_UNROLL
  for (int r = 0; r < R; ++r)
    HSPEC_UNROLL
    for (int c = 0; c < V; ++c) acc[r][c] = _mm512_setzero_ps();
  // A whole block of bf16 keys in pairs of vectors laid out by `load32_split` (keys in lanes by parity), put
  // back in key order as they are stored: each key's chain is the same.
  if (std::is_same_v<KV, c10::BFloat16> && V % 2 == 0 && n == 16 * V) {
    for (int64_t i = 0; i < d; ++i) {
      const KV* row = kt + i * ld + j0;
      prefetch_two_blocks_on<V>(row);
      HSPEC_UNROLL
      for (int c = 0; c + 1 < V; c += 2) {
        __m512 even, odd;
        load32_split(reinterpret_cast<const c10::BFloat16*>(row + 16 * c), even, odd);
        HSPEC_UNROLL
        for (int r = 0; r < R; ++r) {
          const __m512 query = _mm512_set1_ps(q[r * d + i]);
          acc[r][c] = _mm512_fmadd_ps(query, even, acc[r][c]);
          acc[r][c + 1] = _mm512_fmadd_ps(query, odd, acc[r][c + 1]);
        }
      }
    }
    HSPEC_UNROLL
    for (int r = 0; r < R; ++r)
      HSPEC_UNROLL
      for (int c = 0; c + 1 < V; c += 2) {
        __m512 low, high;
        join_lanes(acc[r][c], acc[r][c + 1], low, high);
        _mm512_storeu_ps(scores + r * lds + j0 + 16 * c, low);
        _mm512_storeu_ps(scores + r * lds + j0 + 16 * c + 16, high);
      }
    return;
  }
  for (int64_t i = 0; i < d; ++i) {
    const KV* row = kt + i * ld + j0;
    prefetch_two_blocks_on<V>(row);
    HSPEC_UNROLL
    for (int c = 0; c < V; ++c) {
      const __m512 keys = load16_used(row + 16 * c, used[c]);
      HSPEC_UNROLL
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + i]), keys, acc[r][c]);
    }
  }
  HSPEC_UNROLL
  for (int r = 0; r < R; ++r)
    HSPEC_UNROLL
    for (int c = 0; c < V; ++c) _mm512_mask_storeu_ps(scores + r * lds + j0 + 16 * c, used[c], acc[r][c]);
}

// `key_scores` in 512-bit vectors, for up to 6 rows: R x V accumulators of 16 keys (24 at most, of 32
// registers), fewer vectors for the last keys. The same FMA chain per (row, key), so the same bits.
template <int R, typename KV>
HSPEC_VNNI void key_scores_wide(const float* q, const KV* kt, int64_t ld, int64_t d, int64_t j_begin,
                                int64_t j_end, float* scores, int64_t lds) {
  constexpr int kVectors = R <= 3 ? 8 : 4;
  for (int64_t j = j_begin; j < j_end; j += 16 * kVectors) {
    const int64_t n = std::min<int64_t>(16 * kVectors, j_end - j);
    switch ((n + 15) / 16) {
      case 8: score_block_wide<R, kVectors, KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 7: score_block_wide<R, std::min(kVectors, 7), KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 6: score_block_wide<R, std::min(kVectors, 6), KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 5: score_block_wide<R, std::min(kVectors, 5), KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 4: score_block_wide<R, 4, KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 3: score_block_wide<R, 3, KV>(q, kt, ld, d, j, n, scores, lds); break;
      case 2: score_block_wide<R, 2, KV>(q, kt, ld, d, j, n, scores, lds); break;
      default: score_block_wide<R, 1, KV>(q, kt, ld, d, j, n, scores, lds); break;
    }
  }
}

// The keys of a tile's rows (`attend_head`): every row sees the keys j < common; row r sees a later key j
// < s where seen[r][j] (seen[r] is nullptr only where common = s).
struct Visible {
  const bool* const* seen;
  int64_t common;
};

// acc (R, D) += for each of R rows, p_rj v_j over the keys j_begin <= j < j_end past `common` that it sees,
// in key order, one FMA an element (std::fma rounds once, as the vector FMAs do); a key the row does not see
// leaves its sums as they are (skipped, not weighted 0, which a non-finite value would spoil). A verify's
// last keys, a tree's branches, a batch's padding: few keys, so plain loops.
template <typename KV>
HSPEC_AVX2 void weighted_values_seen(const float* p, int64_t ldp, const Visible& visible, int rows, const KV* v,
                                     int64_t ld, int64_t d, int64_t j_begin, int64_t j_end, float* acc) {
  for (int64_t j = std::max(j_begin, visible.common); j < j_end; ++j) {
    for (int r = 0; r < rows; ++r) {
      if (!visible.seen[r][j]) continue;
      const float weight = p[r * ldp + j];
      for (int64_t i = 0; i < d; ++i) acc[r * d + i] = std::fma(weight, read(v + j * ld + i), acc[r * d + i]);
    }
  }
}

// acc (R, D) += for each of R rows, the sum over the keys j_begin <= j < j_end it sees (ascending) of p_rj
// v_j, V (S, D) with row stride ld and p (R, ldp): one FMA chain per output element in key order, continued
// from acc; the keys every row sees here, then `weighted_values_seen`. Each value vector is loaded once for
// the R rows. 64 outputs at a time for one row, 32 for up to 3, so that 8 or 12 chains run side by side in
// registers.
template <int R, typename KV>
HSPEC_AVX2 void weighted_values(const float* p, int64_t ldp, const Visible& visible, const KV* v, int64_t ld,
                                int64_t d, int64_t j_begin, int64_t j_end, float* acc_rows) {
  constexpr int kChunks = R == 1 ? 8 : 4;
  const int64_t shared_end = std::min(j_end, visible.common);
  for (int64_t i0 = 0; i0 < d && j_begin < shared_end; i0 += 8 * kChunks) {
    const int chunks = static_cast<int>(std::min<int64_t>(d - i0, 8 * kChunks) / 8);
    __m256 acc[R][kChunks];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < chunks; ++c) acc[r][c] = _mm256_loadu_ps(acc_rows + r * d + i0 + 8 * c);
    for (int64_t j = j_begin; j < shared_end; ++j) {
      __m256 weight[R];
      HSPEC_UNROLL
      for (int r = 0; r < R; ++r) weight[r] = _mm256_set1_ps(p[r * ldp + j]);
      const KV* row = v + j * ld + i0;
      for (int c = 0; c < chunks; c += kVectorsPerLine<KV>) {  // the values 8 keys on (the hardware's prefetch lags)
        _mm_prefetch(reinterpret_cast<const char*>(row + 8 * ld + 8 * c), _MM_HINT_T0);
      }
      if (chunks == kChunks) {  // a constant bound: unrolled, the accumulators stay in registers
        HSPEC_UNROLL
        for (int c = 0; c < kChunks; ++c) {
          const __m256 values = load8(row + 8 * c);
          HSPEC_UNROLL
          for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(weight[r], values, acc[r][c]);
        }
      } else {
        for (int c = 0; c < chunks; ++c) {
          const __m256 values = load8(row + 8 * c);
          for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(weight[r], values, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(acc_rows + r * d + i0 + 8 * c, acc[r][c]);
  }
  weighted_values_seen(p, ldp, visible, R, v, ld, d, j_begin, j_end, acc_rows);
}

// The keys every row sees of `weighted_values`, in 512-bit vectors (AVX-512): 64 outputs at a time for up to
// 6 rows (24 accumulators), so a 64-wide head reads each value vector once per tile; every output element
// is the same FMA chain in key order: the same bits. D a multiple of 64.
template <int R, typename KV>
HSPEC_VNNI void weighted_values_wide(const float* p, int64_t ldp, const Visible& visible, const KV* v,
                                     int64_t ld, int64_t d, int64_t j_begin, int64_t j_end, float* acc_rows) {
  constexpr int kChunks = 4;
  const int64_t shared_end = std::min(j_end, visible.common);
  for (int64_t i0 = 0; i0 < d && j_begin < shared_end; i0 += 16 * kChunks) {
    __m512 acc[R][kChunks];
    HSPEC_UNROLL
    for (int r = 0; r < R; ++r)
      HSPEC_UNROLL
      for (int c = 0; c < kChunks; ++c) acc[r][c] = _mm512_loadu_ps(acc_rows + r * d + i0 + 16 * c);
    if constexpr (std::is_same_v<KV, c10::BFloat16>) {  // 32 values a load (`load32_split`): outputs by parity
      HSPEC_UNROLL
      for (int r = 0; r < R; ++r)
        HSPEC_UNROLL
        for (int c = 0; c < kChunks; c += 2) split_lanes(acc[r][c], acc[r][c + 1], acc[r][c], acc[r][c + 1]);
    }
    for (int64_t j = j_begin; j < shared_end; ++j) {
      const KV* row = v + j * ld + i0;
      // The values 32 keys on: a tile of 6 rows spends ~6 ns a key, so 8 keys on (the AVX2 form's distance)
      // came under the memory's latency, and the first tile of each key block waited on its values.
      HSPEC_UNROLL
      for (int c = 0; c < kChunks; c += kVectorsPerLine<KV> / 2) {
        _mm_prefetch(reinterpret_cast<const char*>(row + 32 * ld + 16 * c), _MM_HINT_T0);
      }
      if constexpr (std::is_same_v<KV, c10::BFloat16>) {
        HSPEC_UNROLL
        for (int c = 0; c < kChunks; c += 2) {
          __m512 even, odd;
          load32_split(row + 16 * c, even, odd);
          HSPEC_UNROLL
          for (int r = 0; r < R; ++r) {
            const __m512 weight = _mm512_set1_ps(p[r * ldp + j]);
            acc[r][c] = _mm512_fmadd_ps(weight, even, acc[r][c]);
            acc[r][c + 1] = _mm512_fmadd_ps(weight, odd, acc[r][c + 1]);
          }
        }
      } else {
        HSPEC_UNROLL
        for (int c = 0; c < kChunks; ++c) {
          const __m512 values = load16(row + 16 * c);
          HSPEC_UNROLL
          for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * ldp + j]), values, acc[r][c]);
        }
      }
    }
    if constexpr (std::is_same_v<KV, c10::BFloat16>) {
      HSPEC_UNROLL
      for (int r = 0; r < R; ++r)
        HSPEC_UNROLL
        for (int c = 0; c < kChunks; c += 2) join_lanes(acc[r][c], acc[r][c + 1], acc[r][c], acc[r][c + 1]);
    }
    HSPEC_UNROLL
    for (int r = 0; r < R; ++r)
      HSPEC_UNROLL
      for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc_rows + r * d + i0 + 16 * c, acc[r][c]);
  }
  weighted_values_seen(p, ldp, visible, R, v, ld, d, j_begin, j_end, acc_rows);
}

// exp(x) of 8 softmax arguments x <= 0 at once, lane by lane (a lane's result depends on its x alone):
// x = n ln 2 + r with n = floor(x log2 e + 1/2) and |r| <= ln 2 / 2, e^r by Cephes' degree-5 polynomial
// (1 + r + r^2 p(r)), times 2^n put into the exponent bits. Below -87 it returns 0 (e^-87 ~ 1.6e-38 is
// not a normal fp32 number). Within ~2 ulp of exp (tests/test_fast_path.py).
HSPEC_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: exact n * 0.693359375
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

// `exp_nonpositive` of 16 arguments (AVX-512): the same steps lane by lane, so the same bits.
HSPEC_VNNI inline __m512 exp_nonpositive_wide(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(normal, p, _mm512_castsi512_ps(exponent));
}

// The largest of n scores (exact in any order).
HSPEC_AVX2 float largest(const float* scores, int64_t n) {
  __m256 high = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) high = _mm256_max_ps(high, _mm256_loadu_ps(scores + i));
  float top = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, high);
  for (float lane : lanes) top = std::max(top, lane);
  for (int64_t j = i; j < n; ++j) top = std::max(top, scores[j]);
  return top;
}

// a b, rounded to fp32 on its own: the empty asm keeps the compiler from fusing the product into the next
// addition or subtraction (GCC contracts a b - c into one FMA, rounded once, unless told otherwise).
HSPEC_AVX2 inline __m256 rounded_product(__m256 a, __m256 b) {
  __m256 product = _mm256_mul_ps(a, b);
  __asm__("" : "+x"(product));
  return product;
}
HSPEC_VNNI inline __m512 rounded_product(__m512 a, __m512 b) {
  __m512 product = _mm512_mul_ps(a, b);
  __asm__("" : "+v"(product));
  return product;
}

// A softmax's numerators from score i on: e_j = exp(score_j scale - shift) in place for i <= j < n (the
// product rounded, then the difference), each added to lane j % 8 of total (i a multiple of 8); the unused
// lanes of the last vector add 0.
HSPEC_AVX2 __m256 exponentiate_from(float* scores, int64_t i, int64_t n, __m256 scale, __m256 shift, __m256 total) {
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(rounded_product(_mm256_loadu_ps(scores + i), scale), shift));
    _mm256_storeu_ps(scores + i, e);
    total = _mm256_add_ps(total, e);
  }
  if (i < n) {
    const __m256i used = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 rest = _mm256_maskload_ps(scores + i, used);
    const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(rounded_product(rest, scale), shift)),
                                   _mm256_castsi256_ps(used));
    _mm256_maskstore_ps(scores + i, used, e);
    total = _mm256_add_ps(total, e);
  }
  return total;
}

// A softmax's numerators and their sum over n scores (of the keys a row sees, in key order) times scale > 0,
// in place: e_i = exp(score_i scale - max_j score_j scale); returns their total. One pass after the max:
// rounding is monotone, so the largest scaled score is the largest score scaled (the same bits as scaling
// the row first). The sum runs in 8 lanes, score i in lane i % 8, the lanes added in `lane_sum`'s tree,
// so it depends on the n scores alone (not on keys the row does not see, nor on where they sat).
HSPEC_AVX2 float exponentiate(float* scores, int64_t n, float scale) {
  const __m256 shift = _mm256_set1_ps(largest(scores, n) * scale);
  return lane_sum(exponentiate_from(scores, 0, n, _mm256_set1_ps(scale), shift, _mm256_setzero_ps()));
}

// `exponentiate` 16 scores at a time (AVX-512): each vector's two halves added to the 8 lanes in order,
// as two of `exponentiate`'s steps, so the same sum.
HSPEC_VNNI float exponentiate_wide(float* scores, int64_t n, float scale) {
  const float top = largest(scores, n) * scale;
  const __m512 shift = _mm512_set1_ps(top);
  const __m512 factor = _mm512_set1_ps(scale);
  __m256 total = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_nonpositive_wide(_mm512_sub_ps(rounded_product(_mm512_loadu_ps(scores + i), factor), shift));
    _mm512_storeu_ps(scores + i, e);
    total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
    total = _mm256_add_ps(total, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  return lane_sum(exponentiate_from(scores, i, n, _mm256_set1_ps(scale), _mm256_set1_ps(top), total));
}

// Query rows of one KV head that share a tile, each key and value vector loaded once for them: their
// accumulators fill the 16 AVX2 registers with 3 rows, the 32 AVX-512 ones with 6.
constexpr int kTileRows = 3;
constexpr int kWideTileRows = 6;
// Keys a block: every tile of a head's rows takes a block of its keys (32 KB at D = 64, within the core's L1
// cache) before the next, then likewise its values, so that each is read from memory once per call, not
// once per tile.
constexpr int64_t kKeyBlock = 128;
// Most rows of one head one thread takes at a time (their scores, rows x S fp32, stay in its L2 cache).
constexpr int64_t kMaxHeadRows = 48;

// One KV head of one sequence: K^T (D, S) with row stride kt_ld, V (S, D) with row stride v_ld, in fp32 or
// bf16 (KV: a pool's dtype; each key and value is widened to fp32 exactly as it is loaded).
template <typename KV>
struct Head {
  const KV* kt;
  int64_t kt_ld;
  const KV* v;
  int64_t v_ld;
};

// Which of the first s keys a query row sees: seen (s flags, nullptr for all), how many, and how many
// before the first it does not see (`lead` = `count` when it sees a prefix, as a decode or a causal
// verify row does).
struct RowKeys {
  const bool* seen;
  int64_t count;
  int64_t lead;
};

// The RowKeys of a row's n flags.
RowKeys row_keys(const bool* seen, int64_t n) {
  int64_t lead = 0;
  while (lead < n && seen[lead]) ++lead;
  return RowKeys{seen, lead + std::count(seen + lead, seen + n, true), lead};
}

// body(std::integral_constant<int, R>, first) for the tiles of n rows, Tile rows each but the last.
template <int Tile, typename Body>
void for_each_query_tile(int64_t n, const Body& body) {
  for (int64_t first = 0; first < n; first += Tile) {
    switch (std::min<int64_t>(Tile, n - first)) {
      case 6: if constexpr (Tile >= 6) body(std::integral_constant<int, 6>{}, first); break;
      case 5: if constexpr (Tile >= 5) body(std::integral_constant<int, 5>{}, first); break;
      case 4: if constexpr (Tile >= 4) body(std::integral_constant<int, 4>{}, first); break;
      case 3: body(std::integral_constant<int, 3>{}, first); break;
      case 2: body(std::integral_constant<int, 2>{}, first); break;
      default: body(std::integral_constant<int, 1>{}, first); break;
    }
  }
}

// Attention of n query rows q (n, D) of one KV head over its first s keys, then (a drafter's block,
// `block_attention`) the sb keys of `block`, each row over the keys it sees of the s + sb (keys[r]), into out
// (n, D): 1. the scores of both segments side by side in the row, key block by key block, tile by tile;
// 2. per row one softmax of its seen keys' scaled scores (`exponentiate`); 3. the weighted values, key block
// by key block, tile by tile, each output element one FMA chain over the row's seen keys in key order (the
// s keys, then the block's), then times the row's inverse total. scores (n, s + sb) and compact (s + sb,)
// are the caller's scratch. Wide: the AVX-512 forms (the same bits). With sb = 0 (`attention`) the block is
// not read.
template <bool Wide, typename KV>
void attend_head(const float* q, const RowKeys* keys, int64_t n, const Head<KV>& head, int64_t s,
                 const Head<float>& block, int64_t sb, int64_t d, float scale, float* scores, float* compact,
                 float* out) {
  constexpr int kTile = Wide ? kWideTileRows : kTileRows;
  const int64_t ls = s + sb;  // a row of scores
  const auto scores_of = [&](const auto& segment, int64_t j, int64_t j_end, float* at) {
    for_each_query_tile<kTile>(n, [&](auto rows, int64_t first) {
      constexpr int R = decltype(rows)::value;
      if constexpr (Wide) {
        key_scores_wide<R>(q + first * d, segment.kt, segment.kt_ld, d, j, j_end, at + first * ls, ls);
      } else {
        key_scores<R>(q + first * d, segment.kt, segment.kt_ld, d, j, j_end, at + first * ls, ls);
      }
    });
  };
  for (int64_t j = 0; j < s; j += kKeyBlock) scores_of(head, j, std::min(s, j + kKeyBlock), scores);  // 1.
  if (sb > 0) scores_of(block, 0, sb, scores + s);
  std::vector<float> inverse_total(static_cast<size_t>(n));
  std::vector<const bool*> seen(static_cast<size_t>(n)), block_seen(static_cast<size_t>(n));
  std::vector<int64_t> block_lead(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {  // 2.
    float* row = scores + r * ls;
    const RowKeys& own = keys[r];
    seen[r] = own.seen;
    if (sb > 0) {  // the block's flags, and how many of its first keys the row sees
      block_seen[r] = own.seen + s;
      int64_t lead = own.lead >= s ? own.lead - s : 0;
      while (lead < sb && block_seen[r][lead]) ++lead;
      block_lead[r] = lead;
    }
    if (own.lead == own.count) {  // a prefix of the keys, in place
      inverse_total[r] = 1.0f / (Wide ? exponentiate_wide(row, own.count, scale) : exponentiate(row, own.count, scale));
    } else {  // the seen keys' scores side by side, exponentiated, and put back
      int64_t m = 0;
      for (int64_t j = 0; j < ls; ++j) {
        if (own.seen[j]) compact[m++] = row[j];
      }
      inverse_total[r] = 1.0f / (Wide ? exponentiate_wide(compact, m, scale) : exponentiate(compact, m, scale));
      for (int64_t j = 0, i = 0; j < ls; ++j) {
        if (own.seen[j]) row[j] = compact[i++];
      }
    }
  }
  std::fill(out, out + n * d, 0.0f);
  // acc += the weighted values of keys j..j_end of a segment whose keys every row of a tile sees before its
  // rows' least `lead`, its probabilities at p (rows of stride ls) and its flags seen_at[r]
  const auto values_of = [&](const auto& segment, int64_t j, int64_t j_end, const float* p,
                             const std::vector<const bool*>& seen_at, const auto& lead) {
    for_each_query_tile<kTile>(n, [&](auto rows, int64_t first) {
      constexpr int R = decltype(rows)::value;
      int64_t common = std::numeric_limits<int64_t>::max();
      for (int r = 0; r < R; ++r) common = std::min(common, lead(first + r));
      const Visible visible{seen_at.data() + first, common};
      if constexpr (Wide) {
        weighted_values_wide<R>(p + first * ls, ls, visible, segment.v, segment.v_ld, d, j, j_end, out + first * d);
      } else {
        weighted_values<R>(p + first * ls, ls, visible, segment.v, segment.v_ld, d, j, j_end, out + first * d);
      }
    });
  };
  const auto context_lead = [&](int64_t r) { return std::min(s, keys[r].lead); };
  for (int64_t j = 0; j < s; j += kKeyBlock) {  // 3.
    values_of(head, j, std::min(s, j + kKeyBlock), scores, seen, context_lead);
  }
  if (sb > 0) values_of(block, 0, sb, scores + s, block_seen, [&](int64_t r) { return block_lead[r]; });
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < d; ++i) out[r * d + i] *= inverse_total[r];
}

// `attention`'s and `block_attention`'s work once their inputs are checked. rows (B, T, Hq, D) contiguous, bf16
// or fp32; kt and values (B, S', Hkv, D), both fp32 or both bf16, of which the first s keys are read: kt with
// each head's K^T (D, S') rows at stride(3), consecutive keys 1 apart (stride(1) = 1), values with stride(3)
// = 1; token_keys: per token (B T) what its rows see of the s + sb keys; block_kt (B, Hkv, D, sb) and block_v
// (B, Hkv, sb, D) contiguous fp32, or undefined (sb = 0). Returns (B, T, Hq D) in the rows' dtype.
// The T G query rows of a sequence that share a KV head (the G = Hq / Hkv heads of each of its T tokens,
// token-major) run together (`attend_head`). Threads split the (sequence, KV head) pairs, and a pair's rows
// into groups where pairs are fewer than twice the threads; none of this changes a row's sums.
at::Tensor attend_sequences(const at::Tensor& rows, const at::Tensor& kt, const at::Tensor& values, int64_t s,
                            const std::vector<RowKeys>& token_keys, const at::Tensor& block_kt,
                            const at::Tensor& block_v, int64_t hq) {
  const int64_t b = rows.size(0), t = rows.size(1), d = rows.size(3), hkv = kt.size(2);
  const int64_t sb = block_kt.defined() ? block_kt.size(3) : 0;
  const float* bkt = sb > 0 ? block_kt.data_ptr<float>() : nullptr;
  const float* bv = sb > 0 ? block_v.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({b, t, hq * d}, rows.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t g = hq / hkv;
  const bool wide = d % 64 == 0 && avx512_kernels();
  const int64_t head_rows = t * g;
  const int64_t tile = wide ? kWideTileRows : kTileRows;
  const int64_t wanted = (2 * at::get_num_threads() + b * hkv - 1) / (b * hkv);  // groups per pair
  int64_t group_rows = std::min(kMaxHeadRows, (head_rows + wanted - 1) / wanted);
  group_rows = std::min(head_rows, (group_rows + tile - 1) / tile * tile);
  const int64_t groups = (head_rows + group_rows - 1) / group_rows;
  const auto run = [&](const auto* qp, auto* op, const auto* kp, const auto* vp) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    at::parallel_for(0, b * hkv * groups, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(static_cast<size_t>(group_rows * (s + sb))), compact(static_cast<size_t>(s + sb));
      std::vector<float> query(static_cast<size_t>(group_rows * d)), result(static_cast<size_t>(group_rows * d));
      std::vector<RowKeys> keys(static_cast<size_t>(group_rows));
      for (int64_t item = begin; item < end; ++item) {  // (sequence, KV head, group of its rows)
        const int64_t bi = item / (hkv * groups), kv = (item / groups) % hkv, first = (item % groups) * group_rows;
        const int64_t n = std::min(group_rows, head_rows - first);
        const Head<KV> head{kp + bi * kt.stride(0) + kv * kt.stride(2), kt.stride(3),
                        vp + bi * values.stride(0) + kv * values.stride(2), values.stride(1)};
        const Head<float> block{bkt == nullptr ? nullptr : bkt + (bi * hkv + kv) * d * sb, sb,
                                bv == nullptr ? nullptr : bv + (bi * hkv + kv) * sb * d, d};
        const auto row_at = [&](int64_t r) {  // row first + r: token (first + r) / G, query head kv G + (first + r) % G
          return ((bi * t + (first + r) / g) * hq + kv * g + (first + r) % g) * d;
        };
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t i = 0; i < d; ++i) query[r * d + i] = read(qp + row_at(r) + i);
          keys[r] = token_keys[bi * t + (first + r) / g];
        }
        if (wide) {
          attend_head<true>(query.data(), keys.data(), n, head, s, block, sb, d, scale, scores.data(), compact.data(), result.data());
        } else {
          attend_head<false>(query.data(), keys.data(), n, head, s, block, sb, d, scale, scores.data(), compact.data(), result.data());
        }
        for (int64_t r = 0; r < n; ++r) {  // bf16: rounded to nearest even
          for (int64_t i = 0; i < d; ++i) store(op + row_at(r) + i, result[r * d + i]);
        }
      }
    });
  };
  const auto with_kv = [&](const auto* qp, auto* op) {
    if (kt.scalar_type() == at::kBFloat16) {
      run(qp, op, kt.data_ptr<c10::BFloat16>(), values.data_ptr<c10::BFloat16>());
    } else {
      run(qp, op, kt.data_ptr<float>(), values.data_ptr<float>());
    }
  };
  if (rows.scalar_type() == at::kBFloat16) {
    with_kv(rows.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  } else {
    with_kv(rows.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

// A product's (M, N) output in x's dtype: body(rows, out) gets x's rows and the output as bf16 or fp32 pointers.
template <typename Body>
at::Tensor product_of_rows(const at::Tensor& x, int64_t n, const Body& body) {
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::empty({rows.size(0), n}, rows.options());
  if (rows.scalar_type() == at::kBFloat16) {
    body(rows.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  } else {
    body(rows.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "hspec::", op, " takes CPU rows (M, K), got ", x.sizes(), " on ",
              x.device());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "hspec::", op,
              " takes bfloat16 or float32 rows, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kBlock == 0, "hspec::", op, " takes inputs in blocks of ", kBlock, ", got K = ", x.size(1));
  TORCH_CHECK(cpu_kernels_available(), "hspec::", op, " needs a CPU with AVX2 and FMA");
}

// The weights and scales of a product: read through raw pointers, so they must be CPU tensors too.
void check_on_cpu(const at::Tensor& tensor, const char* op, const char* name) {
  TORCH_CHECK(tensor.device().is_cpu(), "hspec::", op, ": ", name, " must be a CPU tensor, got one on ",
              tensor.device());
}

}  // namespace
#endif

// Which forms the kernels take on this CPU: "avx512_vnni" or "avx2" (`avx512_kernels`), "none" where they do
// not run.
std::string integer_capability() {
#ifdef HSPEC_X86
  if (!cpu_kernels_available()) return "none";
  return avx512_kernels() ? "avx512_vnni" : "avx2";
#else
  return "none";
#endif
}

// weight * rms_norm(x) for bf16 rows x (..., H) and a bf16 weight (H,), as layers.RMSNorm computes it.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
#ifdef HSPEC_X86
  TORCH_CHECK(cpu_kernels_available(), "hspec::rms_norm needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
                  weight.device().is_cpu(),
              "hspec::rms_norm takes bfloat16 CPU tensors, got ", x.scalar_type(), " on ", x.device(), " and ",
              weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "hspec::rms_norm takes rows (..., H) with H >= 1, got ", x.sizes());
  const int64_t h = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h, "hspec::rms_norm: weight ", weight.sizes(), " for rows of ",
              h);
  const at::Tensor rows = x.contiguous();
  // A named local: a pointer into the temporary that `weight.contiguous()` returns would dangle once the
  // statement ends (the copy is freed) wherever the weight is not contiguous already.
  const at::Tensor gains = weight.contiguous();
  at::Tensor out = at::empty_like(rows);
  const c10::BFloat16* in = rows.data_ptr<c10::BFloat16>();
  const c10::BFloat16* w = gains.data_ptr<c10::BFloat16>();
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  for (int64_t r = 0, n = rows.numel() / h; r < n; ++r) {
    // F.rms_norm's steps: x / sqrt(mean(x^2) + eps) rounded to bf16, then times the weight, rounded again
    const float inverse = 1.0f / std::sqrt(sum_of_squares(in + r * h, h) / static_cast<float>(h) +
                                           static_cast<float>(eps));
    scale_row(in + r * h, w, inverse, h, o + r * h);
  }
  return out;
#else
  TORCH_CHECK(false, "hspec::rms_norm runs on x86-64 CPUs only");
#endif
}

// logits (..., V) bf16 or fp32 -> (...) int64: each row's first index of its largest value, NaN the largest, as
// `logits.float().argmax(-1)` (`sampling.greedy_tokens`), without the fp32 copy; torch's argmax took ~130 us a
// 49,152-value row here (1 thread), this ~4.
at::Tensor greedy_tokens(const at::Tensor& logits) {
#ifdef HSPEC_X86
  TORCH_CHECK(cpu_kernels_available(), "hspec::greedy_tokens needs a CPU with AVX2 and FMA");
  TORCH_CHECK(logits.device().is_cpu() && (logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat),
              "hspec::greedy_tokens takes bfloat16 or float32 CPU logits, got ", logits.scalar_type(), " on ",
              logits.device());
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) > 0, "hspec::greedy_tokens takes logits (..., V) with V >= 1, got ",
              logits.sizes());
  const at::Tensor rows = logits.contiguous();
  const int64_t v = rows.size(-1), count = rows.numel() / v;
  std::vector<int64_t> shape = rows.sizes().vec();
  shape.pop_back();
  at::Tensor out = at::empty(shape, rows.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (rows.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* in = rows.data_ptr<c10::BFloat16>();
    for (int64_t r = 0; r < count; ++r) o[r] = first_argmax(in + r * v, v);
  } else {
    const float* in = rows.data_ptr<float>();
    for (int64_t r = 0; r < count; ++r) o[r] = first_argmax(in + r * v, v);
  }
  return out;
#else
  TORCH_CHECK(false, "hspec::greedy_tokens runs on x86-64 CPUs only");
#endif
}

// One row's hidden states (F values, bf16 or fp32) -> (K,) fp32 sigmoid(bias[k] + weight[k] . hidden): an
// outlook's S_1..S_K (drafters/outlook.py), each dot in 8 fp32 lanes and then the tail, the lanes summed alike
// for either dtype (bf16 widens exactly), so the features it was fitted on give the bits decoding's give. One
// call where torch took four operators and ~90 us right after a decode step on a 2 GHz Zen 1.
#ifdef HSPEC_X86
template <typename T>
HSPEC_AVX2 float dot_fp32(const float* w, const T* h, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), load8(h + i), acc);
  float sum = lane_sum(acc);
  for (; i < n; ++i) sum += w[i] * read(h + i);
  return sum;
}
#endif

at::Tensor outlook_survival(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias) {
#ifdef HSPEC_X86
  TORCH_CHECK(cpu_kernels_available(), "hspec::outlook_survival needs a CPU with AVX2 and FMA");
  TORCH_CHECK(hidden.device().is_cpu() && (hidden.scalar_type() == at::kBFloat16 || hidden.scalar_type() == at::kFloat),
              "hspec::outlook_survival takes bfloat16 or float32 CPU hidden states, got ", hidden.scalar_type(),
              " on ", hidden.device());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu() &&
                  bias.scalar_type() == at::kFloat && bias.device().is_cpu() && bias.dim() == 1 &&
                  bias.size(0) == weight.size(0),
              "hspec::outlook_survival takes a float32 CPU weight (K, F) and bias (K,), got ", weight.sizes(), " ",
              weight.scalar_type(), " and ", bias.sizes(), " ", bias.scalar_type());
  TORCH_CHECK(hidden.numel() == weight.size(1), "hspec::outlook_survival: the weight reads ", weight.size(1),
              " features, the hidden states hold ", hidden.numel());
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous(), b = bias.contiguous();
  const int64_t k = w.size(0), f = w.size(1);
  at::Tensor out = at::empty({k}, w.options());
  float* o = out.data_ptr<float>();
  for (int64_t row = 0; row < k; ++row) {
    const float* wr = w.data_ptr<float>() + row * f;
    const float dot = h.scalar_type() == at::kBFloat16 ? dot_fp32(wr, h.data_ptr<c10::BFloat16>(), f)
                                                        : dot_fp32(wr, h.data_ptr<float>(), f);
    o[row] = 1.0f / (1.0f + std::exp(-(b.data_ptr<float>()[row] + dot)));
  }
  return out;
#else
  TORCH_CHECK(false, "hspec::outlook_survival runs on x86-64 CPUs only");
#endif
}

// x (M, K) times an int8 weight (N, K) with one scale per output row (N,) -> (M, N) in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
#ifdef HSPEC_X86
  check_rows(x, "int8_linear");
  check_on_cpu(weight, "int8_linear", "weight");
  check_on_cpu(scale, "int8_linear", "scale");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.size(1) == x.size(1) &&
                  weight.is_contiguous(),
              "hspec::int8_linear: weight must be a contiguous int8 (N, ", x.size(1), "), got ", weight.scalar_type(),
              " ", weight.sizes());
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == weight.size(0) && scale.is_contiguous() &&
                  (scale.scalar_type() == at::kBFloat16 || scale.scalar_type() == at::kFloat),
              "hspec::int8_linear: scale must be a contiguous bf16 or fp32 (", weight.size(0), ",), got ",
              scale.scalar_type(), " ", scale.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const int8_t* w = weight.data_ptr<int8_t>();
  const auto rows_with = [&](const auto* scales) {
    return product_of_rows(x, n, [&](const auto* in, auto* out) {
      tiled_product(in, m, k, n, out, [&](auto rows, auto outputs, const float* packed, int64_t n0, auto* o) {
        int8_tile<decltype(rows)::value, decltype(outputs)::value>(packed, k, w, scales, n0, o, n);
      });
    });
  };
  return scale.scalar_type() == at::kFloat ? rows_with(scale.data_ptr<float>())
                                           : rows_with(scale.data_ptr<c10::BFloat16>());
#else
  TORCH_CHECK(false, "hspec::int8_linear runs on x86-64 CPUs only");
#endif
}

// x (M, K) times int4 groups of 32: levels (N, K/32, 16) uint8, step_offset (N, K/32, 2) fp32 -> (M, N).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& levels, const at::Tensor& step_offset) {
#ifdef HSPEC_X86
  check_rows(x, "int4_linear");
  check_on_cpu(levels, "int4_linear", "levels");
  check_on_cpu(step_offset, "int4_linear", "step_offset");
  const int64_t blocks = x.size(1) / kBlock;
  TORCH_CHECK(levels.scalar_type() == at::kByte && levels.dim() == 3 && levels.size(1) == blocks &&
                  levels.size(2) == kBlock / 2 && levels.is_contiguous(),
              "hspec::int4_linear: levels must be contiguous uint8 (N, ", blocks, ", 16), got ", levels.scalar_type(),
              " ", levels.sizes());
  TORCH_CHECK(step_offset.scalar_type() == at::kFloat && step_offset.is_contiguous() &&
                  step_offset.sizes() == at::IntArrayRef({levels.size(0), blocks, 2}),
              "hspec::int4_linear: step_offset must be contiguous fp32 (N, ", blocks, ", 2), got ",
              step_offset.scalar_type(), " ", step_offset.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = levels.size(0);
  const uint8_t* l = levels.data_ptr<uint8_t>();
  const float* so = step_offset.data_ptr<float>();
  return product_of_rows(x, n, [&](const auto* in, auto* out) {
    tiled_product(in, m, k, n, out, [&](auto rows, auto outputs, const float* packed, int64_t n0, auto* o) {
      int4_tile<decltype(rows)::value, decltype(outputs)::value>(packed, k, l, so, n0, o, n);
    });
  });
#else
  TORCH_CHECK(false, "hspec::int4_linear runs on x86-64 CPUs only");
#endif
}

// x (M, K), each row quantized to int8 blocks of 32, times w4a8 weights (N / 8, K / 32, 160) uint8 (N outputs)
// -> (M, N) in x's dtype: llama.cpp's Q4_1 x Q8_1 product, integer dot products per block.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight) {
#ifdef HSPEC_X86
  check_rows(x, "w4a8_linear");
  check_on_cpu(weight, "w4a8_linear", "weight");
  const int64_t blocks = x.size(1) / kBlock;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 3 && weight.size(1) == blocks &&
                  weight.size(2) == kW4a8Tile && weight.is_contiguous(),
              "hspec::w4a8_linear: weight must be contiguous uint8 (N / 8, ", blocks, ", ", kW4a8Tile, "), got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0) * kW4a8Outputs;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  return product_of_rows(x, n, [&](const auto* in, auto* out) {
    const bool vnni = avx512_kernels();
    quantized_product(in, m, k, n, out, [&](auto rows, auto halves, const Int8Rows& q, int64_t n0, auto* o) {
      constexpr int MT = decltype(rows)::value, Halves = decltype(halves)::value;
      const TileBlocks tiles = tile_blocks(w, n, n0, blocks, kW4a8Tile);
      if (!vnni) {
        if constexpr (MT >= kPassRows) {
          w4a8_tile_in_passes<MT, Halves>(q, k, tiles, n0, o, n);
        } else {
          w4a8_tile<MT, Halves>(q, k, tiles, n0, o, n);
        }
      } else if constexpr (Halves == 1 || MT <= kNarrowRows) {
        w4a8_tile_narrow<MT, Halves>(q, k, tiles, n0, o, n);
      } else {
        w4a8_tile_wide<MT>(q, k, tiles, n0, o, n);
      }
    });
  });
#else
  TORCH_CHECK(false, "hspec::w4a8_linear runs on x86-64 CPUs only");
#endif
}

// x (M, K), each row quantized to int8 blocks of 32, times an int8 weight stored in tiles (N / 8, K / 32,
// 256) with one scale per output (N,) -> (M, N) in x's dtype: integer dot products per block.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
#ifdef HSPEC_X86
  check_rows(x, "w8a8_linear");
  check_on_cpu(weight, "w8a8_linear", "weight");
  check_on_cpu(scale, "w8a8_linear", "scale");
  const int64_t blocks = x.size(1) / kBlock;
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 3 && weight.size(1) == blocks &&
                  weight.size(2) == kW8a8Tile && weight.is_contiguous(),
              "hspec::w8a8_linear: weight must be contiguous int8 (N / 8, ", blocks, ", ", kW8a8Tile,
              "), got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0) * kW4a8Outputs;
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n && scale.is_contiguous() &&
                  (scale.scalar_type() == at::kBFloat16 || scale.scalar_type() == at::kFloat),
              "hspec::w8a8_linear: scale must be a contiguous bf16 or fp32 (", n, ",), got ", scale.scalar_type(), " ",
              scale.sizes());
  const int8_t* w = weight.data_ptr<int8_t>();
  const auto rows_with = [&](const auto* scales) {
    return product_of_rows(x, n, [&](const auto* in, auto* out) {
      const bool vnni = avx512_kernels();
      quantized_product(in, m, k, n, out, [&](auto rows, auto halves, const Int8Rows& q, int64_t n0, auto* o) {
        constexpr int MT = decltype(rows)::value, Halves = decltype(halves)::value;
        const TileBlocks tiles = tile_blocks(w, n, n0, blocks, kW8a8Tile);
        if (!vnni) {
          w8a8_tile<MT, Halves>(q, k, tiles, scales, n0, o, n);
        } else if constexpr (Halves == 1 || MT <= kNarrowRows) {
          w8a8_tile_narrow<MT, Halves>(q, k, tiles, scales, n0, o, n);
        } else {
          w8a8_tile_wide<MT>(q, k, tiles, scales, n0, o, n);
        }
      });
    });
  };
  return scale.scalar_type() == at::kFloat ? rows_with(scale.data_ptr<float>())
                                           : rows_with(scale.data_ptr<c10::BFloat16>());
#else
  TORCH_CHECK(false, "hspec::w8a8_linear runs on x86-64 CPUs only");
#endif
}

// Attention of the rows q (B, T, Hq, D) over the first s keys of k and v (B, S', Hkv, D), both fp32 or both
// bf16 (a pool's dtype: each key and value is widened to fp32 as it is loaded, exactly, so a bf16 pool gives
// the bits a fp32 pool holding the same values gives, at half the bytes read); mask
// (B, 1, T, S') True where a row may see a key, or none (every row sees all s). Returns (B, T, Hq D) in q's
// dtype. Each row's numbers are its own: its scores (`key_scores`), scaled by D^-1/2, a softmax over the
// keys it sees in fp32 (`exponentiate`: the max, then exp and their sum in the seen keys' order), and the
// weighted sum of their values (`weighted_values`); a key a row may not see contributes nothing anywhere,
// so a verify row, whose call holds more keys, computes exactly what its 1-token decode did.
// The T G query rows of a sequence that share a KV head run together (`attend_sequences`): tiles of up to 6
// rows (AVX-512; 3 in AVX2) take each block of the head's keys, then of its values, in turn, so a call reads
// them from memory once, however many tokens it verifies. None of this changes a row's sums.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                     int64_t s) {
#ifdef HSPEC_X86
  TORCH_CHECK(cpu_kernels_available(), "hspec::attention needs a CPU with AVX2 and FMA");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.device().is_cpu() && k.device().is_cpu() &&
                  v.device().is_cpu(),
              "hspec::attention takes q (B, T, Hq, D), k and v (B, S', Hkv, D) on the CPU, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  // Checked before the one below, which takes Hq % Hkv: Hkv = 0 would divide by zero (SIGFPE, not an error).
  TORCH_CHECK(q.size(2) > 0 && k.size(2) > 0 && q.size(3) > 0,
              "hspec::attention needs Hq, Hkv and D >= 1, got q ", q.sizes(), " and k ", k.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "hspec::attention takes bfloat16 or float32 queries, got ", q.scalar_type());
  const int64_t b = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3), hkv = k.size(2);
  TORCH_CHECK((k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                  v.scalar_type() == k.scalar_type() && k.sizes() == v.sizes() && k.size(0) == b &&
                  k.size(3) == d && hq % hkv == 0 && d % 8 == 0 && s >= 1 && s <= k.size(1),
              "hspec::attention: k and v must be both float32 or both bfloat16 (", b, ", S' >= ", s,
              ", Hkv dividing ", hq, ", ", d, "), D a multiple of 8; got ", k.scalar_type(), " ", k.sizes(), " and ",
              v.scalar_type(), " ", v.sizes());
  // K^T of each (sequence, KV head) as rows over consecutive keys: the pool's own layout (a view), else a copy.
  const at::Tensor kt = k.stride(1) == 1 ? k : k.permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2});
  const at::Tensor values = v.stride(3) == 1 ? v : v.contiguous();
  const at::Tensor rows = q.contiguous();  // bf16 or float32, converted row by row
  // What each token's rows see (B T entries): its mask row, how many keys, how many before the first hidden.
  std::vector<RowKeys> token_keys(static_cast<size_t>(b * t), RowKeys{nullptr, s, s});
  at::Tensor visible;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->device().is_cpu() && mask->dim() == 4 &&
                    mask->size(0) == b && mask->size(1) == 1 && mask->size(2) == t && mask->size(3) >= s,
                "hspec::attention: mask must be bool (", b, ", 1, ", t, ", S >= ", s, "), got ", mask->sizes());
    visible = mask->slice(3, 0, s).contiguous();
    const bool* flags = visible.data_ptr<bool>();
    for (int64_t i = 0; i < b * t; ++i) token_keys[static_cast<size_t>(i)] = row_keys(flags + i * s, s);
  }
  return attend_sequences(rows, kt, values, s, token_keys, at::Tensor(), at::Tensor(), hq);
#else
  TORCH_CHECK(false, "hspec::attention runs on x86-64 CPUs only");
#endif
}

// A drafter's block attention (drafters/block_attention.py's attend_block for one context per row, as H-Spec's
// and the DFlash family's layers attend): the T block tokens' queries q (B, T, Hq, D) over [the first s
// context keys of k and v (B, S', Hkv, D) ; the block's own keys and values block_k, block_v (B, T, Hkv, D)],
// one softmax over the keys a row sees of both: the context keys where context_mask (B, S') is True (all s
// where it is None), and the block keys j <= t of token t where `causal` (H-Spec), all T where not (the
// DFlash family). The context is read where it lies, fp32 or bf16 (a pool's views, K^T in its layout or not:
// each key and value widened to fp32 as it is loaded, as `attention` reads it); the block's K/V (fp32 or bf16)
// are widened to fp32 copies (T keys). Each row's numbers are `attention`'s: its scores of both segments
// (one FMA chain each, in D order), scaled by D^-1/2, one softmax over its seen keys in fp32, and one FMA
// chain per output element over the context's seen values then the block's. Returns (B, T, Hq D) in q's
// dtype.
at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::optional<at::Tensor>& context_mask, int64_t s, const at::Tensor& block_k,
                           const at::Tensor& block_v, bool causal) {
#ifdef HSPEC_X86
  TORCH_CHECK(cpu_kernels_available(), "hspec::block_attention needs a CPU with AVX2 and FMA");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && block_k.dim() == 4 && block_v.dim() == 4 &&
                  q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && block_k.device().is_cpu() &&
                  block_v.device().is_cpu(),
              "hspec::block_attention takes q (B, T, Hq, D), k and v (B, S', Hkv, D), block_k and block_v (B, T, "
              "Hkv, D) on the CPU, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", ", block_k.sizes(), ", ",
              block_v.sizes());
  TORCH_CHECK(q.size(1) > 0 && q.size(2) > 0 && block_k.size(2) > 0 && q.size(3) > 0,
              "hspec::block_attention needs T, Hq, Hkv and D >= 1, got q ", q.sizes(), " and block_k ",
              block_k.sizes());
  const int64_t b = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3), hkv = block_k.size(2);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "hspec::block_attention takes bfloat16 or float32 queries, got ", q.scalar_type());
  TORCH_CHECK((k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                  v.scalar_type() == k.scalar_type() && k.sizes() == v.sizes() && k.size(0) == b &&
                  k.size(2) == hkv && k.size(3) == d && hq % hkv == 0 && d % 8 == 0 && s >= 0 && s <= k.size(1),
              "hspec::block_attention: k and v must be both float32 or both bfloat16 (", b, ", S' >= ", s, ", ",
              hkv, " dividing ", hq, ", ", d, "), D a multiple of 8; got ", k.scalar_type(), " ", k.sizes(),
              " and ", v.scalar_type(), " ", v.sizes());
  TORCH_CHECK((block_k.scalar_type() == at::kFloat || block_k.scalar_type() == at::kBFloat16) &&
                  block_v.scalar_type() == block_k.scalar_type() &&
                  block_k.sizes() == at::IntArrayRef({b, t, hkv, d}) && block_v.sizes() == block_k.sizes(),
              "hspec::block_attention: block_k and block_v must be both float32 or both bfloat16 (", b, ", ", t,
              ", ", hkv, ", ", d, "), got ", block_k.scalar_type(), " ", block_k.sizes(), " and ",
              block_v.scalar_type(), " ", block_v.sizes());
  // K^T of each (sequence, KV head) as rows over consecutive keys: the pool's own layout (a view), else a copy
  // of the s keys read.
  const at::Tensor kt = k.stride(1) == 1 || s == 0 ? k : k.slice(1, 0, s).permute({0, 2, 3, 1}).contiguous()
                                                           .permute({0, 3, 1, 2});
  const at::Tensor values = v.stride(3) == 1 ? v : v.contiguous();
  const at::Tensor rows = q.contiguous();
  const at::Tensor block_kt = block_k.to(at::kFloat).permute({0, 2, 3, 1}).contiguous();  // (B, Hkv, D, T)
  const at::Tensor block_values = block_v.to(at::kFloat).permute({0, 2, 1, 3}).contiguous();  // (B, Hkv, T, D)
  // Each token's flags over its s + T keys, [context ; block], and what its rows see of them.
  at::Tensor flags = at::empty({b * t, s + t}, at::TensorOptions().dtype(at::kBool));
  bool* f = flags.data_ptr<bool>();
  at::Tensor visible;
  if (context_mask.has_value()) {
    TORCH_CHECK(context_mask->scalar_type() == at::kBool && context_mask->device().is_cpu() &&
                    context_mask->dim() == 2 && context_mask->size(0) == b && context_mask->size(1) >= s,
                "hspec::block_attention: context_mask must be bool (", b, ", S >= ", s, "), got ",
                context_mask->scalar_type(), " ", context_mask->sizes());
    visible = context_mask->slice(1, 0, s).contiguous();
  }
  std::vector<RowKeys> token_keys(static_cast<size_t>(b * t));
  for (int64_t i = 0; i < b * t; ++i) {  // token i % T of sequence i / T
    bool* row = f + i * (s + t);
    if (visible.defined()) {
      std::copy_n(visible.data_ptr<bool>() + (i / t) * s, s, row);
    } else {
      std::fill_n(row, s, true);
    }
    for (int64_t j = 0; j < t; ++j) row[s + j] = !causal || j <= i % t;
    token_keys[static_cast<size_t>(i)] = row_keys(row, s + t);
  }
  return attend_sequences(rows, kt, values, s, token_keys, block_kt, block_values, hq);
#else
  TORCH_CHECK(false, "hspec::block_attention runs on x86-64 CPUs only");
#endif
}

// The new tokens' queries and keys rotated by position, and their keys and values written to one layer of
// a float32 or bfloat16 KV pool: what decoder_stack.cpp's apply_rope, split, index_copy_ and .to(pool) did with ~20
// operators, in one call and with the same bits (each bf16 product and sum rounded as torch's bf16 mul and
// add round: the fp32 result to nearest even). projected (B T, (Hq + 2 Hkv) D) or (B, T, (Hq + 2 Hkv) D)
// bf16 (q, k, v side by side), cos and the signed sin (B, T, 1, D) bf16 (layers.rope_cos_sin), pool_k and pool_v one layer's
// (slots, Hkv, D) views, both float32 or both bf16 (any strides: the pool keeps K transposed; a rotated key is
// a bf16 value, so either holds it exactly), slots (B T,) long. Returns the
// rotated queries (B, T, Hq, D) bf16.
at::Tensor rope_and_write(const at::Tensor& projected, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& pool_k,
                          at::Tensor& pool_v, const at::Tensor& slots, int64_t hq, int64_t hkv) {
  TORCH_CHECK(cos.dim() == 4 && cos.size(2) == 1 && cos.size(3) > 0,
              "hspec::rope_and_write: cos must be (B, T, 1, D >= 1), got ", cos.sizes());
  TORCH_CHECK(hq >= 1 && hkv >= 1, "hspec::rope_and_write needs hq and hkv >= 1, got hq = ", hq, ", hkv = ", hkv);
  const int64_t b = cos.size(0), t = cos.size(1), d = cos.size(3);
  TORCH_CHECK(projected.scalar_type() == at::kBFloat16 && projected.device().is_cpu() &&
                  projected.numel() == b * t * (hq + 2 * hkv) * d && projected.size(-1) == (hq + 2 * hkv) * d,
              "hspec::rope_and_write takes the bf16 CPU projections of ", b * t, " tokens, (B T, (", hq, " + 2 x ",
              hkv, ") ", d, "), got ", projected.scalar_type(), " ", projected.sizes());
  TORCH_CHECK(d % 2 == 0, "hspec::rope_and_write: the head dim must be even, got ", d);
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == at::kBFloat16 && table->device().is_cpu() &&
                    table->sizes() == at::IntArrayRef({b, t, 1, d}),
                "hspec::rope_and_write: cos and sin must be bf16 (", b, ", ", t, ", 1, ", d, "), got ",
                table->scalar_type(), " ", table->sizes());
  }
  for (const at::Tensor* pool : {&pool_k, &pool_v}) {
    TORCH_CHECK((pool->scalar_type() == at::kFloat || pool->scalar_type() == at::kBFloat16) &&
                    pool->scalar_type() == pool_k.scalar_type() && pool->device().is_cpu() && pool->dim() == 3 &&
                    pool->size(0) == pool_k.size(0) && pool->size(1) == hkv && pool->size(2) == d,
                "hspec::rope_and_write: the pool's layers must be both float32 or both bfloat16 CPU (",
                pool_k.size(0), " slots, ", hkv, ", ", d, "), got ", pool->scalar_type(), " ", pool->sizes());
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.device().is_cpu() && slots.numel() == b * t,
              "hspec::rope_and_write: ", b * t, " long CPU write slots needed, got ", slots.scalar_type(), " ",
              slots.sizes());
  const at::Tensor x = projected.contiguous(), c = cos.contiguous(), sn = sin.contiguous(), write_at = slots.contiguous();
  const int64_t* slot = write_at.data_ptr<int64_t>();
  for (int64_t i = 0; i < b * t; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_k.size(0), "hspec::rope_and_write: slot ", slot[i],
                " outside the pool's ", pool_k.size(0));
  }
  at::Tensor queries = at::empty({b, t, hq, d}, projected.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* cp = c.data_ptr<c10::BFloat16>();
  const c10::BFloat16* sp = sn.data_ptr<c10::BFloat16>();
  c10::BFloat16* qp = queries.data_ptr<c10::BFloat16>();
  const int64_t half = d / 2, width = (hq + 2 * hkv) * d;
#ifdef HSPEC_X86
  // `rotate_head`'s steps of 8 within each half; else one value at a time
  const bool vectors = d % 16 == 0 && cpu_kernels_available();
#else
  constexpr bool vectors = false;
#endif
  std::vector<c10::BFloat16> key(static_cast<size_t>(d));  // a rotated key before it is written
  const int64_t key_stride[3] = {pool_k.stride(0), pool_k.stride(1), pool_k.stride(2)};
  const auto write = [&](auto* kp, auto* vp) {  // float or c10::BFloat16, the pool's dtype
    using KV = std::remove_pointer_t<decltype(kp)>;
    for (int64_t i = 0; i < b * t; ++i) {  // token i: its heads q (Hq), k (Hkv), v (Hkv)
      const c10::BFloat16* row = xp + i * width;
      const c10::BFloat16* ci = cp + i * d;
      const c10::BFloat16* si = sp + i * d;
      for (int64_t h = 0; h < hq + hkv; ++h) {
        const c10::BFloat16* head = row + h * d;
        // a query straight into the output, a key through `key` into the pool's strides (K^T: one value a line)
        c10::BFloat16* rotated = h < hq ? qp + (i * hq + h) * d : key.data();
        if (vectors) {
#ifdef HSPEC_X86
          rotate_head(head, ci, si, d, rotated);
#endif
        } else {
          for (int64_t e = 0; e < d; ++e) {
            const c10::BFloat16 turned(static_cast<float>(head[e]) * static_cast<float>(ci[e]));
            const c10::BFloat16 swapped(static_cast<float>(head[e < half ? e + half : e - half]) *
                                        static_cast<float>(si[e]));
            rotated[e] = c10::BFloat16(static_cast<float>(turned) + static_cast<float>(swapped));
          }
        }
        if (h >= hq) {
          KV* to = kp + slot[i] * key_stride[0] + (h - hq) * key_stride[1];
          for (int64_t e = 0; e < d; ++e) to[e * key_stride[2]] = static_cast<KV>(key[e]);
        }
      }
      for (int64_t h = 0; h < hkv; ++h) {
        const c10::BFloat16* head = row + (hq + hkv + h) * d;
        for (int64_t e = 0; e < d; ++e) {
          vp[slot[i] * pool_v.stride(0) + h * pool_v.stride(1) + e * pool_v.stride(2)] = static_cast<KV>(head[e]);
        }
      }
    }
  };
  if (pool_k.scalar_type() == at::kBFloat16) {
    write(pool_k.data_ptr<c10::BFloat16>(), pool_v.data_ptr<c10::BFloat16>());
  } else {
    write(pool_k.data_ptr<float>(), pool_v.data_ptr<float>());
  }
  return queries;
}

}  // namespace hspec

TORCH_LIBRARY(hspec, library) {
  library.def("available() -> bool", &hspec::cpu_kernels_available);
  library.def("integer_capability() -> str", &hspec::integer_capability);
  library.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  library.def("greedy_tokens(Tensor logits) -> Tensor");
  library.def("outlook_survival(Tensor hidden, Tensor weight, Tensor bias) -> Tensor");
  library.def("int8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  library.def("int4_linear(Tensor x, Tensor levels, Tensor step_offset) -> Tensor");
  library.def("w4a8_linear(Tensor x, Tensor weight) -> Tensor");
  library.def("w8a8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  library.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, int s) -> Tensor");
  library.def("block_attention(Tensor q, Tensor k, Tensor v, Tensor? context_mask, int s, Tensor block_k, "
              "Tensor block_v, bool causal) -> Tensor");
  library.def("rope_and_write(Tensor projected, Tensor cos, Tensor sin, Tensor(a!) pool_k, Tensor(b!) pool_v, "
              "Tensor slots, int hq, int hkv) -> Tensor");
}

TORCH_LIBRARY_IMPL(hspec, CPU, library) {
  library.impl("rms_norm", &hspec::rms_norm);
  library.impl("greedy_tokens", &hspec::greedy_tokens);
  library.impl("outlook_survival", &hspec::outlook_survival);
  library.impl("int8_linear", &hspec::int8_linear);
  library.impl("int4_linear", &hspec::int4_linear);
  library.impl("w4a8_linear", &hspec::w4a8_linear);
  library.impl("w8a8_linear", &hspec::w8a8_linear);
  library.impl("attention", &hspec::attention);
  library.impl("block_attention", &hspec::block_attention);
  library.impl("rope_and_write", &hspec::rope_and_write);
}
