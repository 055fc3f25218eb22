// A probe of AMX-INT8 against the AVX512-VNNI wide tiles for hspec's w4a8 and w8a8 products of a few rows
// (docs/fast-path.md, "AVX512-VNNI tiles"): not part of hspec, the evidence for whether to build it (issue 50,
// item 4). scripts/amx_int8_probe.cpp took one block a tdpbssd with the layout's 8-output tiles as B tiles;
// this one takes two blocks a tdp, 16 outputs, and overlaps its stages. Built and
// run by scripts/amx_tiles_probe.py (which writes the results with their provenance); by hand, on a CPU with
// AMX-INT8 and Linux 5.16 or newer (which grants the tile state on request):
//
//   g++ -O3 -o /tmp/amx_tiles_probe scripts/amx_tiles_probe.cpp && /tmp/amx_tiles_probe [rounds]
//
// Per shape (N outputs x K inputs) and row count, one thread, the kernels' calls alternate round by round and
// each call's thread CPU time is taken (medians); every AMX output must equal the VNNI tile's bit for bit.
// - `w4a8_vnni`, `w8a8_vnni`: hspec's wide tiles (models/cpu_kernels.cpp, `w4a8_tile_wide`, `w8a8_tile_wide`)
//   over every 16 outputs, fp32 out.
// - `w4a8_amx`, `w8a8_amx`: the same numbers with tdpbsud / tdpbssd. Each block of 32 inputs has its own row
//   step and weight steps, so a block's int32 sums must leave the tile before its floating-point steps (the
//   VNNI tile's, in its order: conversion, scale, FMA in block order, offset term). To use the tile's 64-byte
//   K, one tdp takes two blocks: the A tile's 2 MT rows hold a row's block 2p in bytes 0..31 of row m and its
//   block 2p + 1 in bytes 32..63 of row MT + m, zeros elsewhere (`pair_blocks`, once per call), the B tile
//   the two blocks' 16 vectors of 16 outputs (the 4-bit levels unpacked to bytes, or the two 8-output halves
//   of the int8 weights joined, in a small buffer), so C's rows m and MT + m are the two blocks' sums of row
//   m. The three stages (unpack, tile, float steps) run one pair apart, so no stage waits on the memory the
//   one before has just written; one LDTILECFG per call (A and C tiles of 2 MT rows). 16 rows run as two
//   tiles of 8, as hspec's products do.
// - `w4a8_amx_p2`, `w8a8_amx_p2`: the same, the stages two pairs apart and two pairs a step.
// - `w4a8_amx_vector_only`: `w4a8_amx` without its tile instructions, and `w4a8_amx_tiles_apart` with them on
//   buffers of their own that no vector instruction touches (timing only, wrong outputs): whether the tile
//   unit's work and the vector work overlap when no data passes between them.
// - `w8a8_amx_direct`: w8a8 with the weights' own tiles of 8 outputs as B tiles, read in place (no copy),
//   two tdpbssd a pair; A and C tiles of 16 rows.
// - `tile_ops`: the tile instructions of the AMX products alone (zero, two 1 KB loads, the tdp, a 1 KB store
//   per pair of blocks; tiles of 16 rows), as many as one w4a8 call of the shape issues; `tdp_only` as many
//   tdpbsud alone, four independent sums: the tile unit's floor.
// Output: one JSON object a line.
#include <immintrin.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <type_traits>
#include <vector>

#define VNNI __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")))
#define AMX __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")))

constexpr int64_t kBlock = 32;
constexpr int kHalf = 8;            // outputs per tile of the weights' layout
constexpr int64_t kW4a8Tile = 160;  // bytes per 8 outputs and block of a w4a8 weight
constexpr int kSlots = 8;           // rows per block in a paired A tile of 16 rows
constexpr int kInFlight = 4;        // buffer slots of `tile_ops`

// hspec's `Int8Rows` for one tile of MT rows: levels [K/32][MT][32], per [K/32][MT] the step, step * sum(q) and
// 128 * sum(q).
struct Int8Rows {
  std::vector<int8_t> levels;
  std::vector<float> step, step_sum;
  std::vector<int32_t> shifted_sum;
};

Int8Rows random_rows(int rows, int64_t k, std::mt19937& rng) {
  const int64_t blocks = k / kBlock;
  Int8Rows x{std::vector<int8_t>(rows * k), std::vector<float>(blocks * rows), std::vector<float>(blocks * rows),
             std::vector<int32_t>(blocks * rows)};
  std::uniform_int_distribution<int> level(-127, 127);
  std::uniform_real_distribution<float> step(0.001f, 0.05f);
  for (int64_t g = 0; g < blocks; ++g)
    for (int r = 0; r < rows; ++r) {
      int sum = 0;
      for (int i = 0; i < kBlock; ++i) sum += x.levels[(g * rows + r) * kBlock + i] = static_cast<int8_t>(level(rng));
      const float d = step(rng);
      x.step[g * rows + r] = d, x.step_sum[g * rows + r] = d * sum, x.shifted_sum[g * rows + r] = 128 * sum;
    }
  return x;
}

VNNI inline __m512 bf16x16(const uint8_t* low, const uint8_t* high) {
  const __m256i bits = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)low)),
                                               _mm_loadu_si128((const __m128i*)high), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
VNNI inline __m512i join(const void* low, const void* high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)low)),
                            _mm256_loadu_si256((const __m256i*)high), 1);
}
VNNI inline __m512i dot_with_broadcast(__m512i sums, __m512i weights, const int8_t* inputs) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sums) : "v"(weights), "m"(*reinterpret_cast<const int32_t*>(inputs)));
  return sums;
}

template <int MT>
VNNI void w4a8_vnni(const Int8Rows& x, int64_t k, const uint8_t* weight, int64_t n0, float* out, int64_t ldo) {
  const int64_t blocks = k / kBlock;
  __m512 acc[MT], offsets[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps(), offsets[m] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0xF);
  const uint8_t* first = weight + (n0 / kHalf) * blocks * kW4a8Tile;
  const uint8_t* second = first + blocks * kW4a8Tile;
  for (int64_t g = 0; g < blocks; ++g) {
    const uint8_t* a = first + g * kW4a8Tile;
    const uint8_t* b = second + g * kW4a8Tile;
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
      __m512i sums = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) sums = dot_with_broadcast(sums, w[q], xg + m * kBlock + 4 * q);
      const __m512 scale = _mm512_mul_ps(step, _mm512_set1_ps(x.step[g * MT + m]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[m]);
      offsets[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.step_sum[g * MT + m]), offsets[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo + n0, _mm512_add_ps(acc[m], offsets[m]));
}

template <int MT>
VNNI void w8a8_vnni(const Int8Rows& x, int64_t k, const int8_t* weight, const float* scale, int64_t n0, float* out,
                    int64_t ldo) {
  const int64_t blocks = k / kBlock;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i shift = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* first = weight + n0 * k;
  const int8_t* second = first + kHalf * k;
  for (int64_t g = 0; g < blocks; ++g) {
    const int8_t* a = first + g * kBlock * kHalf;
    const int8_t* b = second + g * kBlock * kHalf;
    __m512i w[8];
    for (int q = 0; q < 8; ++q) w[q] = _mm512_xor_si512(join(a + 32 * q, b + 32 * q), shift);
    const int8_t* xg = x.levels.data() + g * MT * kBlock;
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      __m512i sums = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) sums = dot_with_broadcast(sums, w[q], xg + m * kBlock + 4 * q);
      sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(x.shifted_sum[g * MT + m]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(x.step[g * MT + m]), acc[m]);
    }
  }
  const __m512 weight_scale = _mm512_loadu_ps(scale + n0);
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo + n0, _mm512_mul_ps(acc[m], weight_scale));
}

struct alignas(64) TileConfig {
  uint8_t palette, start, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles of 64-byte rows: 0, 1 the paired rows (A) and 4-7 the sums (C), `rows` each; 2, 3 the weights (B), 16.
// Written in assembly with the whole struct as its operand: GCC 12 drops the stores of rows and colsb before
// _tile_loadconfig as dead (the tile unit then faults).
AMX void configure_tiles(int rows = 16) {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.rows[t] = t == 2 || t == 3 ? 16 : rows, config.colsb[t] = 64;
  asm volatile("ldtilecfg %0" : : "m"(config));
}

AMX void release_tiles() { _tile_release(); }

// A tile's MT rows paired for the A tiles: per pair of blocks 2 `slots` rows of 64 bytes, row m holding row m's
// block 2p in bytes 0..31 and row slots + m its block 2p + 1 in bytes 32..63, zeros elsewhere.
std::vector<int8_t> pair_blocks(const Int8Rows& x, int mt, int64_t blocks, int slots = kSlots) {
  std::vector<int8_t> paired((blocks + 1) / 2 * 16 * 64, 0);
  for (int64_t g = 0; g < blocks; ++g)
    for (int m = 0; m < mt; ++m)
      std::memcpy(paired.data() + ((g / 2) * 2 * slots + (g % 2) * slots + m) * 64 + (g % 2) * kBlock,
                  x.levels.data() + (g * mt + m) * kBlock, kBlock);
  return paired;
}

// One pair's tile instructions; the tile numbers are immediates, so pairs rotate over four sets by p % 4.
#define HSPEC_PAIR(A, B, C)                                                                          \
  do {                                                                                               \
    _tile_zero(C);                                                                                   \
    _tile_loadd(A, a, 64);                                                                           \
    _tile_loadd(B, b, 64);                                                                           \
    if (Signed) {                                                                                    \
      _tile_dpbssd(C, A, B);                                                                         \
    } else {                                                                                         \
      _tile_dpbsud(C, A, B);                                                                         \
    }                                                                                                \
    _tile_stored(C, c, 64);                                                                          \
  } while (0)
template <bool Signed>
AMX inline void tile_pair(int64_t p, const int8_t* a, const uint8_t* b, int32_t* c) {
  switch (p & 3) {
    case 0: HSPEC_PAIR(0, 2, 4); break;
    case 1: HSPEC_PAIR(1, 3, 5); break;
    case 2: HSPEC_PAIR(0, 2, 6); break;
    default: HSPEC_PAIR(1, 3, 7);
  }
}

// The 16 outputs from n0 of MT <= 8 rows, in steps of P pairs of blocks: the weights of step i's pairs are
// unpacked in step i, their tile instructions run in step i + 1 and their float steps (in block order, the VNNI
// tile's operations) in step i + 2, so no stage waits on the memory the one before it has just written.
enum class Tiles { kUsed, kNone, kApart };  // what `w4a8_amx` does with its tile instructions

template <int MT, int P, Tiles T = Tiles::kUsed>
AMX void w4a8_amx(const Int8Rows& x, const int8_t* paired, int64_t k, const uint8_t* weight, int64_t n0, float* out,
                  int64_t ldo) {
  constexpr int slots = 4 * P;
  const int64_t blocks = k / kBlock, pairs = (blocks + 1) / 2;
  __m512 acc[MT], offsets[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps(), offsets[m] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0xF);
  const uint8_t* first = weight + (n0 / kHalf) * blocks * kW4a8Tile;
  const uint8_t* second = first + blocks * kW4a8Tile;
  alignas(64) uint8_t unpacked[slots * 1024] = {};
  alignas(64) int32_t sums[slots * 256] = {};
  alignas(64) int8_t apart_a[T == Tiles::kApart ? slots * 1024 : 1] = {};
  alignas(64) uint8_t apart_b[T == Tiles::kApart ? slots * 1024 : 1] = {};
  alignas(64) int32_t apart_c[T == Tiles::kApart ? slots * 256 : 1];
  for (int64_t i = 0; i * P < pairs + 2 * P; ++i) {
    for (int64_t g = 2 * P * i; g < std::min(2 * P * (i + 1), blocks); ++g) {
      const uint8_t* a = first + g * kW4a8Tile;
      const uint8_t* b = second + g * kW4a8Tile;
      uint8_t* to = unpacked + ((g / 2) % slots) * 1024 + 512 * (g & 1);
      for (int c = 0; c < 4; ++c) {
        const __m512i chunk = join(a + 32 * c, b + 32 * c);
        _mm512_store_si512(to + 128 * c, _mm512_and_si512(chunk, nibble));
        _mm512_store_si512(to + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(chunk, 4), nibble));
      }
    }
    for (int64_t t = std::max<int64_t>(0, P * (i - 1)); t < std::min<int64_t>(P * i, pairs); ++t) {
      if (T == Tiles::kUsed) {
        tile_pair<false>(t, paired + t * 128 * MT, unpacked + (t % slots) * 1024, sums + (t % slots) * 256);
      } else if (T == Tiles::kApart) {  // the same instructions on buffers no vector instruction touches
        tile_pair<false>(t, apart_a + (t % slots) * 1024, apart_b + (t % slots) * 1024, apart_c + (t % slots) * 256);
      }
    }
    for (int64_t g = std::max<int64_t>(0, 2 * P * (i - 2)); g < std::min(2 * P * (i - 1), blocks); ++g) {
      const uint8_t* a = first + g * kW4a8Tile;
      const uint8_t* b = second + g * kW4a8Tile;
      const int32_t* c = sums + ((g / 2) % slots) * 256 + 16 * MT * (g & 1);
      const __m512 step = bf16x16(a + 128, b + 128);
      const __m512 offset = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), step, bf16x16(a + 144, b + 144));
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m512 scale = _mm512_mul_ps(step, _mm512_set1_ps(x.step[g * MT + m]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * m)), scale, acc[m]);
        offsets[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.step_sum[g * MT + m]), offsets[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo + n0, _mm512_add_ps(acc[m], offsets[m]));
}

template <int MT, int P>
AMX void w8a8_amx(const Int8Rows& x, const int8_t* paired, int64_t k, const int8_t* weight, const float* scale,
                  int64_t n0, float* out, int64_t ldo) {
  constexpr int slots = 4 * P;
  const int64_t blocks = k / kBlock, pairs = (blocks + 1) / 2;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const int8_t* first = weight + n0 * k;
  const int8_t* second = first + kHalf * k;
  alignas(64) uint8_t joined[slots * 1024] = {};
  alignas(64) int32_t sums[slots * 256];
  for (int64_t i = 0; i * P < pairs + 2 * P; ++i) {
    for (int64_t g = 2 * P * i; g < std::min(2 * P * (i + 1), blocks); ++g) {
      const int8_t* a = first + g * kBlock * kHalf;
      const int8_t* b = second + g * kBlock * kHalf;
      uint8_t* to = joined + ((g / 2) % slots) * 1024 + 512 * (g & 1);
      for (int q = 0; q < 8; ++q) _mm512_store_si512(to + 64 * q, join(a + 32 * q, b + 32 * q));
    }
    for (int64_t t = std::max<int64_t>(0, P * (i - 1)); t < std::min<int64_t>(P * i, pairs); ++t)
      tile_pair<true>(t, paired + t * 128 * MT, joined + (t % slots) * 1024, sums + (t % slots) * 256);
    for (int64_t g = std::max<int64_t>(0, 2 * P * (i - 2)); g < std::min(2 * P * (i - 1), blocks); ++g) {
      const int32_t* c = sums + ((g / 2) % slots) * 256 + 16 * MT * (g & 1);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * m)), _mm512_set1_ps(x.step[g * MT + m]),
                                 acc[m]);
    }
  }
  const __m512 weight_scale = _mm512_loadu_ps(scale + n0);
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo + n0, _mm512_mul_ps(acc[m], weight_scale));
}

// w8a8 with the weights' own tiles of 8 outputs as B tiles (16 rows of 32 bytes: blocks 2p and 2p + 1 are
// adjacent in the layout), read in place: no copy. Two tdpbssd a pair (outputs n0 .. n0 + 7 and n0 + 8 .. 15)
// share the A tile, and their C tiles are stored side by side into 64-byte rows. Even block counts only.
AMX void configure_direct_tiles() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = t < 2 ? 64 : 32;
  asm volatile("ldtilecfg %0" : : "m"(config));
}
#define HSPEC_DIRECT_PAIR(A, CL, CH)  \
  do {                                \
    _tile_zero(CL);                   \
    _tile_zero(CH);                   \
    _tile_loadd(A, a, 64);            \
    _tile_loadd(2, low, 32);          \
    _tile_loadd(3, high, 32);         \
    _tile_dpbssd(CL, A, 2);           \
    _tile_dpbssd(CH, A, 3);           \
    _tile_stored(CL, c, 64);          \
    _tile_stored(CH, c + 8, 64);      \
  } while (0)
template <int MT>
AMX void w8a8_amx_direct(const Int8Rows& x, const int8_t* paired, int64_t k, const int8_t* weight, const float* scale,
                         int64_t n0, float* out, int64_t ldo) {
  const int64_t blocks = k / kBlock, pairs = blocks / 2;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const int8_t* first = weight + n0 * k;
  const int8_t* second = first + kHalf * k;
  alignas(64) int32_t sums[kInFlight * 256];
  for (int64_t p = 0; p < pairs + 1; ++p) {
    if (p < pairs) {
      const int8_t* a = paired + p * 1024;
      const int8_t* low = first + 2 * p * kBlock * kHalf;
      const int8_t* high = second + 2 * p * kBlock * kHalf;
      int32_t* c = sums + (p % kInFlight) * 256;
      if (p & 1) {
        HSPEC_DIRECT_PAIR(1, 6, 7);
      } else {
        HSPEC_DIRECT_PAIR(0, 4, 5);
      }
    }
    const int64_t e = p - 1;
    for (int64_t g = 2 * e; e >= 0 && g < 2 * e + 2; ++g) {
      const int32_t* c = sums + (e % kInFlight) * 256 + 16 * kSlots * (g & 1);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * m)), _mm512_set1_ps(x.step[g * MT + m]),
                                 acc[m]);
    }
  }
  const __m512 weight_scale = _mm512_loadu_ps(scale + n0);
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo + n0, _mm512_mul_ps(acc[m], weight_scale));
}

// `pairs` pairs' tile instructions alone, over buffers that stay in L1.
AMX void tile_ops(int64_t pairs, const int8_t* a, const uint8_t* b, int32_t* c) {
  for (int64_t p = 0; p < pairs; ++p)
    tile_pair<false>(p, a + (p % kInFlight) * 1024, b + (p % kInFlight) * 1024, c + (p % kInFlight) * 256);
}

// `pairs` tdpbsud alone, four independent sums (the instruction's throughput).
AMX void tdp_only(int64_t pairs) {
  for (int64_t p = 0; p + 4 <= pairs; p += 4) {
    _tile_dpbsud(4, 0, 2);
    _tile_dpbsud(5, 1, 3);
    _tile_dpbsud(6, 0, 2);
    _tile_dpbsud(7, 1, 3);
  }
}

double thread_us() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

// One shape and row count (MT rows per tile, `tiles` tiles: 16 rows are two tiles of 8).
template <int MT>
void probe(int64_t n, int64_t k, int tiles, int rounds, std::mt19937& rng) {
  const int64_t blocks = k / kBlock, pairs = (blocks + 1) / 2;
  std::vector<uint8_t> w4(n / kHalf * blocks * kW4a8Tile);
  for (auto& byte : w4) byte = static_cast<uint8_t>(rng());
  for (size_t t = 0; t < w4.size(); t += kW4a8Tile)  // steps and zeros: bf16 of magnitude 0.5-1
    for (int j = 0; j < 16; ++j) {
      const uint16_t bits = 0x3F00 + (rng() & 0x7F);
      std::memcpy(&w4[t + 128 + 2 * j], &bits, 2);
    }
  std::vector<int8_t> w8(n * k);
  for (auto& v : w8) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  std::vector<float> scale(n);
  for (auto& s : scale) s = 0.01f + (rng() % 100) * 1e-4f;
  std::vector<Int8Rows> x;
  std::vector<std::vector<int8_t>> paired, tight;
  for (int i = 0; i < tiles; ++i) {
    x.push_back(random_rows(MT, k, rng));
    paired.push_back(pair_blocks(x[i], MT, blocks));  // 16-row A tiles (`w8a8_amx_direct`)
    tight.push_back(pair_blocks(x[i], MT, blocks, MT));
  }
  const int64_t rows = int64_t{MT} * tiles;
  alignas(64) static int8_t a[kInFlight * 1024];
  alignas(64) static uint8_t b[kInFlight * 1024];
  alignas(64) static int32_t c[kInFlight * 256];
  // Each product over every 16 outputs, the row tiles one after another on each (hspec's order).
  const auto each = [&](float* out, auto tile) {
    for (int64_t n0 = 0; n0 < n; n0 += 2 * kHalf)
      for (int i = 0; i < tiles; ++i) tile(i, n0, out + i * MT * n);
  };
  struct Kernel {
    const char* name;
    int reference;  // the kernel whose outputs it must equal, -1 for none
    std::function<void(float*)> call;
    std::vector<float> out;
    std::vector<double> us;
  };
  const auto w4a8_amx_in_steps_of = [&](auto steps) {
    return [&, steps](float* out) {
      configure_tiles(2 * MT);
      each(out, [&](int i, int64_t n0, float* o) {
        w4a8_amx<MT, decltype(steps)::value>(x[i], tight[i].data(), k, w4.data(), n0, o, n);
      });
      release_tiles();
    };
  };
  const auto w8a8_amx_in_steps_of = [&](auto steps) {
    return [&, steps](float* out) {
      configure_tiles(2 * MT);
      each(out, [&](int i, int64_t n0, float* o) {
        w8a8_amx<MT, decltype(steps)::value>(x[i], tight[i].data(), k, w8.data(), scale.data(), n0, o, n);
      });
      release_tiles();
    };
  };
  std::vector<Kernel> kernels = {
      {"w4a8_vnni", -1, [&](float* out) { each(out, [&](int i, int64_t n0, float* o) { w4a8_vnni<MT>(x[i], k, w4.data(), n0, o, n); }); }},
      {"w4a8_amx", 0, w4a8_amx_in_steps_of(std::integral_constant<int, 1>())},
      {"w4a8_amx_p2", 0, w4a8_amx_in_steps_of(std::integral_constant<int, 2>())},
      {"w4a8_amx_vector_only", -1, [&](float* out) {
         each(out, [&](int i, int64_t n0, float* o) {
           w4a8_amx<MT, 1, Tiles::kNone>(x[i], tight[i].data(), k, w4.data(), n0, o, n);
         });
       }},
      {"w4a8_amx_tiles_apart", -1, [&](float* out) {
         configure_tiles(2 * MT);
         each(out, [&](int i, int64_t n0, float* o) {
           w4a8_amx<MT, 1, Tiles::kApart>(x[i], tight[i].data(), k, w4.data(), n0, o, n);
         });
         release_tiles();
       }},
      {"w8a8_vnni", -1, [&](float* out) {
         each(out, [&](int i, int64_t n0, float* o) { w8a8_vnni<MT>(x[i], k, w8.data(), scale.data(), n0, o, n); });
       }},
      {"w8a8_amx", 5, w8a8_amx_in_steps_of(std::integral_constant<int, 1>())},
      {"w8a8_amx_p2", 5, w8a8_amx_in_steps_of(std::integral_constant<int, 2>())},
      {"w8a8_amx_direct", 5, [&](float* out) {
         configure_direct_tiles();
         each(out, [&](int i, int64_t n0, float* o) {
           w8a8_amx_direct<MT>(x[i], paired[i].data(), k, w8.data(), scale.data(), n0, o, n);
         });
         release_tiles();
       }},
      {"tile_ops", -1, [&](float*) {
         configure_tiles();
         for (int64_t u = 0; u < n / (2 * kHalf) * tiles; ++u) tile_ops(pairs, a, b, c);
         release_tiles();
       }},
      {"tdp_only", -1, [&](float*) {
         configure_tiles();
         tdp_only(n / (2 * kHalf) * tiles * pairs);
         release_tiles();
       }},
  };
  for (auto& kernel : kernels) kernel.out.assign(rows * n, 0.0f);
  for (int r = 0; r <= rounds; ++r)  // round 0 warms the caches, untimed
    for (auto& kernel : kernels) {
      const double start = thread_us();
      kernel.call(kernel.out.data());
      kernel.us.push_back(thread_us() - start);
    }
  std::printf("{\"N\": %ld, \"K\": %ld, \"rows\": %ld", n, k, rows);
  for (auto& kernel : kernels) {
    std::vector<double> us(kernel.us.begin() + 1, kernel.us.end());
    std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
    std::printf(", \"%s_us\": %.2f", kernel.name, us[us.size() / 2]);
    if (kernel.reference >= 0) {
      const auto& expected = kernels[kernel.reference].out;
      const bool same = std::memcmp(kernel.out.data(), expected.data(), expected.size() * sizeof(float)) == 0;
      std::printf(", \"%s_same_bits\": %s", kernel.name, same ? "true" : "false");
    }
  }
  std::printf("}\n");
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  // Linux grants a process the AMX tile state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::fprintf(stderr, "this CPU or kernel grants no AMX tile state\n");
    return 1;
  }
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 201;
  std::mt19937 rng(0);
  const int64_t shapes[][2] = {{1536, 576}, {576, 1536}, {8192, 576}};  // gate/up, down, pruned head (N, K)
  for (const auto& shape : shapes) {
    probe<1>(shape[0], shape[1], 1, rounds, rng);
    probe<2>(shape[0], shape[1], 1, rounds, rng);
    probe<4>(shape[0], shape[1], 1, rounds, rng);
    probe<8>(shape[0], shape[1], 1, rounds, rng);
    probe<8>(shape[0], shape[1], 2, rounds, rng);
  }
  return 0;
}
