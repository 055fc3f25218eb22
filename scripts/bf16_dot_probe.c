// What vdpbf16ps (AVX512-BF16) computes and how fast, against the fp32 FMAs hspec's attention runs
// (scripts/bench_bf16_dot.py builds and runs this; results/attention_scaling/bf16_dot/).
//
// 1. Semantics: the instruction on random operands (all bit patterns, denormal and near-underflow ones among
//    them) against scalar models: acc + a1 b1, then + a0 b0 (the odd pair first, Intel's pseudo-code), each
//    step one rounding to nearest even with the exact product, denormal inputs read as 0 and denormal
//    results written as 0; the even pair first; and the AVX2 replay (two vfmadd231ps under MXCSR DAZ|FTZ).
// 2. Throughput: 16 (and 24) independent accumulators, vdpbf16ps against vfmadd231ps, zmm and ymm, rounds
//    interleaved, thread CPU time.
// 3. A verify's scores for one (layer, KV head): 24 query rows (8 tokens x 3 query heads) against S = 2,048
//    bf16 keys of K^T (64, S), in tiles of 6 rows x 64 keys as the kernel runs them: the FMA form
//    (keys widened to fp32, one FMA per row, key and dim) against the dot form (dims paired, vpermt2w
//    interleaving two rows of K^T, one vdpbf16ps per row, 16 keys and 2 dims), and the AVX2 replay of the
//    dot form, whose bits it must equal.
// 4. AMX (where the CPU and the kernel allow it): tdpbf16ps (a 16 x 16 fp32 tile += 16 x 32 bf16 times 32 x 16
//    bf16) on random tiles against the step-by-step model of 1. and against fp32 sums of the 32 products in
//    order then added to the accumulator; and its rate, 4 independent accumulator tiles.
//
// Prints "name value" lines.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")))
#define AVX2 __attribute__((target("avx2,fma")))
#define AMX __attribute__((target("amx-tile,amx-bf16")))

static double thread_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static uint64_t state = 88172645463325252ull;
static uint64_t next(void) {  // xorshift64
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}

static float from_bits(uint32_t b) { float x; memcpy(&x, &b, 4); return x; }
static uint32_t to_bits(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }
static int is_nan(uint32_t b) { return ((b >> 23) & 0xFF) == 0xFF && (b & 0x7FFFFF); }
static float zero_denormal(float x) {
  uint32_t b = to_bits(x);
  return ((b >> 23) & 0xFF) == 0 ? from_bits(b & 0x80000000u) : x;
}
static float widen(uint16_t h) { return zero_denormal(from_bits((uint32_t)h << 16)); }

// One lane of the instruction in the model: odd pair first when odd_first, else the even pair first.
static float model(float acc, const uint16_t* a, const uint16_t* b, int odd_first) {
  int first = odd_first ? 1 : 0;
  acc = zero_denormal(acc);
  acc = zero_denormal(fmaf(widen(a[first]), widen(b[first]), acc));
  return zero_denormal(fmaf(widen(a[1 - first]), widen(b[1 - first]), acc));
}

// A bf16 operand: mode 0 any bits; 1 exponents 0-7 (denormals and the smallest normals); 2 moderate; 3
// exponents whose products fall near fp32's underflow.
static uint16_t operand(int mode) {
  uint16_t h = (uint16_t)next();
  if (mode == 1) h = (uint16_t)((h & 0x807F) | ((next() % 8) << 7));
  if (mode == 2) h = (uint16_t)((h & 0x807F) | ((100 + next() % 56) << 7));
  if (mode == 3) h = (uint16_t)((h & 0x807F) | ((55 + next() % 20) << 7));
  return h;
}

AVX2 static void replay8(const float* acc, const uint16_t* a, const uint16_t* b, float* out) {
  const __m256i pa = _mm256_loadu_si256((const __m256i*)a), pb = _mm256_loadu_si256((const __m256i*)b);
  const __m256i high = _mm256_set1_epi32((int)0xFFFF0000);
  __m256 sum = _mm256_loadu_ps(acc);
  sum = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(pa, high)), _mm256_castsi256_ps(_mm256_and_si256(pb, high)), sum);
  sum = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(pa, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(pb, 16)), sum);
  _mm256_storeu_ps(out, sum);
}

AVX512 static void semantics(long vectors) {
  long lanes = 0, nan = 0, odd_first = 0, even_first = 0, replay = 0, denormal_inputs = 0;
  const unsigned csr = _mm_getcsr();
  for (long it = 0; it < vectors; ++it) {
    const int mode = (int)(it % 4);
    uint16_t a[32], b[32];
    float acc[16], hw[16], avx2[16];
    for (int i = 0; i < 32; ++i) {
      a[i] = operand(mode);
      b[i] = operand(mode);
      denormal_inputs += ((a[i] >> 7) & 0xFF) == 0 && (a[i] & 0x7F);
    }
    for (int i = 0; i < 16; ++i) {
      uint32_t bits = (uint32_t)next();
      if (mode == 3) bits = (bits & 0x807FFFFFu) | ((uint32_t)(next() % 40) << 23);
      if (mode == 1 && i % 2) bits &= 0x807FFFFFu;  // a denormal accumulator
      acc[i] = from_bits(bits);
    }
    const __m512 out = _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
    _mm512_storeu_ps(hw, out);
    _mm_setcsr(csr | 0x8040);  // FTZ (bit 15) and DAZ (bit 6)
    replay8(acc, a, b, avx2);
    replay8(acc + 8, a + 16, b + 16, avx2 + 8);
    _mm_setcsr(csr);
    for (int i = 0; i < 16; ++i) {
      const uint32_t h = to_bits(hw[i]);
      const uint32_t m1 = to_bits(model(acc[i], a + 2 * i, b + 2 * i, 1)), m0 = to_bits(model(acc[i], a + 2 * i, b + 2 * i, 0));
      const uint32_t r = to_bits(avx2[i]);
      ++lanes;
      if (is_nan(h)) ++nan;
      odd_first += h != m1 && !(is_nan(h) && is_nan(m1));
      even_first += h != m0 && !(is_nan(h) && is_nan(m0));
      replay += h != r && !(is_nan(h) && is_nan(r));
    }
  }
  printf("semantics_lanes %ld\nsemantics_nan_lanes %ld\nsemantics_denormal_inputs %ld\n", lanes, nan, denormal_inputs);
  printf("mismatch_odd_first_model %ld\nmismatch_even_first_model %ld\nmismatch_avx2_replay %ld\n", odd_first, even_first, replay);
}

#define STEPS 2000000L
#define CHAINS(body, n)                                              \
  _Pragma("GCC unroll 32") for (int c = 0; c < (n); ++c) body;

AVX512 __attribute__((noinline)) static float dot_zmm(const volatile float* seed, int chains) {
  __m512 acc[24];
  for (int c = 0; c < 24; ++c) acc[c] = _mm512_set1_ps(seed[c]);
  __m512bh x = (__m512bh)_mm512_set1_epi32(0x3c003c00), y = (__m512bh)_mm512_set1_epi32(0x3c003c00);
  if (chains == 16) {
    for (long i = 0; i < STEPS; ++i) { CHAINS(acc[c] = _mm512_dpbf16_ps(acc[c], x, y), 16) __asm__ volatile("" : "+v"(x)); }
  } else {
    for (long i = 0; i < STEPS; ++i) { CHAINS(acc[c] = _mm512_dpbf16_ps(acc[c], x, y), 24) __asm__ volatile("" : "+v"(x)); }
  }
  __m512 t = acc[0];
  for (int c = 1; c < 24; ++c) t = _mm512_add_ps(t, acc[c]);
  return _mm512_reduce_add_ps(t);
}

AVX512 __attribute__((noinline)) static float fma_zmm(const volatile float* seed, int chains) {
  __m512 acc[24];
  for (int c = 0; c < 24; ++c) acc[c] = _mm512_set1_ps(seed[c]);
  __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-30f);
  if (chains == 16) {
    for (long i = 0; i < STEPS; ++i) { CHAINS(acc[c] = _mm512_fmadd_ps(x, y, acc[c]), 16) __asm__ volatile("" : "+v"(x)); }
  } else {
    for (long i = 0; i < STEPS; ++i) { CHAINS(acc[c] = _mm512_fmadd_ps(x, y, acc[c]), 24) __asm__ volatile("" : "+v"(x)); }
  }
  __m512 t = acc[0];
  for (int c = 1; c < 24; ++c) t = _mm512_add_ps(t, acc[c]);
  return _mm512_reduce_add_ps(t);
}

AVX512 __attribute__((noinline)) static float dot_ymm(const volatile float* seed) {
  __m256 acc[16];
  for (int c = 0; c < 16; ++c) acc[c] = _mm256_set1_ps(seed[c]);
  __m256bh x = (__m256bh)_mm256_set1_epi32(0x3c003c00), y = (__m256bh)_mm256_set1_epi32(0x3c003c00);
  for (long i = 0; i < STEPS; ++i) { CHAINS(acc[c] = _mm256_dpbf16_ps(acc[c], x, y), 16) __asm__ volatile("" : "+v"(x)); }
  __m256 t = acc[0];
  for (int c = 1; c < 16; ++c) t = _mm256_add_ps(t, acc[c]);
  return t[0];
}

AVX2 __attribute__((noinline)) static float fma_ymm(const volatile float* seed) {
  __m256 acc[12];
  for (int c = 0; c < 12; ++c) acc[c] = _mm256_set1_ps(seed[c]);
  __m256 x = _mm256_set1_ps(1.0f), y = _mm256_set1_ps(1e-30f);
  for (long i = 0; i < STEPS; ++i) { CHAINS(acc[c] = _mm256_fmadd_ps(x, y, acc[c]), 12) __asm__ volatile("" : "+x"(x)); }
  __m256 t = acc[0];
  for (int c = 1; c < 12; ++c) t = _mm256_add_ps(t, acc[c]);
  return t[0];
}

static int compare_doubles(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}
static double median(double* v, int n) {
  qsort(v, (size_t)n, sizeof(double), compare_doubles);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void throughput(int rounds) {
  enum { kForms = 6 };
  const char* names[kForms] = {"dpbf16_zmm_16", "dpbf16_zmm_24", "fma_zmm_16", "fma_zmm_24", "dpbf16_ymm_16", "fma_ymm_12"};
  const double instructions[kForms] = {16.0 * STEPS, 24.0 * STEPS, 16.0 * STEPS, 24.0 * STEPS, 16.0 * STEPS, 12.0 * STEPS};
  const double products[kForms] = {32, 32, 16, 16, 16, 8};  // multiplications an instruction
  double* times[kForms];
  volatile float seed[24];
  for (int c = 0; c < 24; ++c) seed[c] = (float)c;
  for (int f = 0; f < kForms; ++f) times[f] = malloc(sizeof(double) * (size_t)rounds);
  float sink = 0;
  for (int r = 0; r < rounds; ++r) {
    for (int f = 0; f < kForms; ++f) {
      const double start = thread_seconds();
      switch (f) {
        case 0: sink += dot_zmm(seed, 16); break;
        case 1: sink += dot_zmm(seed, 24); break;
        case 2: sink += fma_zmm(seed, 16); break;
        case 3: sink += fma_zmm(seed, 24); break;
        case 4: sink += dot_ymm(seed); break;
        default: sink += fma_ymm(seed); break;
      }
      times[f][r] = thread_seconds() - start;
    }
  }
  for (int f = 0; f < kForms; ++f) {
    const double ns = 1e9 * median(times[f], rounds) / instructions[f];
    printf("ns_per_instruction_%s %.4f\nproducts_per_ns_%s %.2f\n", names[f], ns, names[f], products[f] / ns);
    free(times[f]);
  }
  printf("throughput_sink %g\n", (double)sink);
}

enum { kDim = 64, kKeys = 2048, kRows = 24, kTile = 6, kBlockKeys = 64 };

// The FMA form: rows [r0, r0 + 6) against keys j0 .. j0 + 63, keys widened, one FMA chain per (row, key) in dim order.
AVX512 static void fma_tile(const float* q, const uint16_t* kt, int r0, int j0, float* scores) {
  __m512 acc[kTile][4];
  for (int r = 0; r < kTile; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int i = 0; i < kDim; ++i) {
    const uint16_t* row = kt + (size_t)i * kKeys + j0;
    _mm_prefetch((const char*)(row + 2 * kBlockKeys), _MM_HINT_T0);
    _mm_prefetch((const char*)(row + 2 * kBlockKeys + 32), _MM_HINT_T0);
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {
      const __m512 keys = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + 16 * c))), 16));
      _Pragma("GCC unroll 6") for (int r = 0; r < kTile; ++r) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[(r0 + r) * kDim + i]), keys, acc[r][c]);
    }
  }
  for (int r = 0; r < kTile; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(scores + (size_t)(r0 + r) * kKeys + j0 + 16 * c, acc[r][c]);
}

// The dot form: dims paired; vpermt2w puts key j's dims (i, i + 1) side by side in one 32-bit lane, keys in order.
AVX512 static void dot_tile(const uint32_t* q_pairs, const uint16_t* kt, int r0, int j0, float* scores) {
  __m512i low_keys, high_keys;  // word 2k: row i's key k, word 2k + 1: row i + 1's (k < 16; 16 <= k < 32)
  {
    uint16_t index[32];
    for (int k = 0; k < 16; ++k) { index[2 * k] = (uint16_t)k; index[2 * k + 1] = (uint16_t)(32 + k); }
    low_keys = _mm512_loadu_si512(index);
    for (int k = 0; k < 16; ++k) { index[2 * k] = (uint16_t)(16 + k); index[2 * k + 1] = (uint16_t)(48 + k); }
    high_keys = _mm512_loadu_si512(index);
  }
  __m512 acc[kTile][4];
  for (int r = 0; r < kTile; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int i = 0; i < kDim; i += 2) {
    const uint16_t* even = kt + (size_t)i * kKeys + j0;
    const uint16_t* odd = even + kKeys;
    _mm_prefetch((const char*)(even + 2 * kBlockKeys), _MM_HINT_T0);
    _mm_prefetch((const char*)(even + 2 * kBlockKeys + 32), _MM_HINT_T0);
    _mm_prefetch((const char*)(odd + 2 * kBlockKeys), _MM_HINT_T0);
    _mm_prefetch((const char*)(odd + 2 * kBlockKeys + 32), _MM_HINT_T0);
    __m512i pairs[4];
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
      const __m512i e = _mm512_loadu_si512(even + 32 * h), o = _mm512_loadu_si512(odd + 32 * h);
      pairs[2 * h] = _mm512_permutex2var_epi16(e, low_keys, o);
      pairs[2 * h + 1] = _mm512_permutex2var_epi16(e, high_keys, o);
    }
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {
      _Pragma("GCC unroll 6") for (int r = 0; r < kTile; ++r) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)q_pairs[(r0 + r) * (kDim / 2) + i / 2]);
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qp, (__m512bh)pairs[c]);
      }
    }
  }
  for (int r = 0; r < kTile; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(scores + (size_t)(r0 + r) * kKeys + j0 + 16 * c, acc[r][c]);
}

// The AVX2 replay of the dot form (MXCSR DAZ|FTZ set by the caller): per dim pair the odd dim's FMA, then the even's.
AVX2 static void replay_tile(const float* q, const uint16_t* kt, int r0, int j0, float* scores) {
  for (int r = r0; r < r0 + kTile; ++r) {
    for (int c = 0; c < kBlockKeys / 8; ++c) {
      __m256 acc = _mm256_setzero_ps();
      for (int i = 0; i < kDim; i += 2) {
        for (int dim = i + 1; dim >= i; --dim) {
          const __m128i bits = _mm_loadu_si128((const __m128i*)(kt + (size_t)dim * kKeys + j0 + 8 * c));
          const __m256 keys = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
          acc = _mm256_fmadd_ps(_mm256_set1_ps(q[r * kDim + dim]), keys, acc);
        }
      }
      _mm256_storeu_ps(scores + (size_t)r * kKeys + j0 + 8 * c, acc);
    }
  }
}

static uint16_t round_bf16(float x) {  // to nearest even (finite x)
  const uint32_t b = to_bits(x);
  return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

AVX512 static void verify_scores(int rounds) {
  uint16_t* kt = aligned_alloc(64, sizeof(uint16_t) * kDim * kKeys);
  float q[kRows * kDim];
  uint32_t q_pairs[kRows * kDim / 2];
  float* scores[3];
  for (int f = 0; f < 3; ++f) scores[f] = aligned_alloc(64, sizeof(float) * kRows * kKeys);
  for (int i = 0; i < kDim * kKeys; ++i) kt[i] = round_bf16((float)((double)(next() % 2000001) / 1e6 - 1.0) * 2.0f);
  for (int i = 0; i < kRows * kDim; ++i) q[i] = from_bits((uint32_t)round_bf16((float)((double)(next() % 2000001) / 1e6 - 1.0) * 3.0f) << 16);
  for (int i = 0; i < kRows * kDim / 2; ++i) q_pairs[i] = (to_bits(q[2 * i + 1]) & 0xFFFF0000u) | (to_bits(q[2 * i]) >> 16);
  double* times[2] = {malloc(sizeof(double) * (size_t)rounds), malloc(sizeof(double) * (size_t)rounds)};
  for (int round = 0; round < rounds; ++round) {
    for (int f = 0; f < 2; ++f) {
      const double start = thread_seconds();
      for (int j0 = 0; j0 < kKeys; j0 += kBlockKeys)
        for (int r0 = 0; r0 < kRows; r0 += kTile) {
          if (f == 0) fma_tile(q, kt, r0, j0, scores[0]);
          else dot_tile(q_pairs, kt, r0, j0, scores[1]);
        }
      times[f][round] = thread_seconds() - start;
    }
  }
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);
  for (int j0 = 0; j0 < kKeys; j0 += kBlockKeys)
    for (int r0 = 0; r0 < kRows; r0 += kTile) replay_tile(q, kt, r0, j0, scores[2]);
  _mm_setcsr(csr);
  long replay_mismatch = 0;
  double largest_change = 0, largest_score = 0;
  for (int i = 0; i < kRows * kKeys; ++i) {
    replay_mismatch += to_bits(scores[1][i]) != to_bits(scores[2][i]);
    largest_change = fmax(largest_change, fabs((double)scores[1][i] - (double)scores[0][i]));
    largest_score = fmax(largest_score, fabs((double)scores[0][i]));
  }
  const double fma_us = 1e6 * median(times[0], rounds), dot_us = 1e6 * median(times[1], rounds);
  const double products = (double)kRows * kKeys * kDim;
  printf("verify_scores_fma_us %.2f\nverify_scores_dot_us %.2f\n", fma_us, dot_us);
  printf("verify_scores_fma_products_per_ns %.2f\nverify_scores_dot_products_per_ns %.2f\n", products / (1e3 * fma_us), products / (1e3 * dot_us));
  printf("verify_scores_replay_mismatches %ld\nverify_scores_max_abs_change %.3g\nverify_scores_max_abs %.3g\n", replay_mismatch, largest_change, largest_score);
  free(kt);
  for (int f = 0; f < 3; ++f) free(scores[f]);
  free(times[0]);
  free(times[1]);
}

// The tile configuration of palette 1: 8 tiles of 16 rows x 64 bytes.
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} __attribute__((packed));

AMX __attribute__((noinline)) static void amx_rate(long steps) {
  float c[16][16] = {{0}};
  uint16_t a[16][32], b[16][32];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 32; ++j) a[i][j] = b[i][j] = 0x3c00;
  _tile_loadd(0, c, 64);
  _tile_loadd(1, c, 64);
  _tile_loadd(2, c, 64);
  _tile_loadd(3, c, 64);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  for (long i = 0; i < steps; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
}

AMX static void amx(long tiles, int rounds) {
  if (!__builtin_cpu_supports("amx-bf16") || syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    printf("amx 0\n");
    return;
  }
  printf("amx 1\n");
  struct TileConfig config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
  long lanes = 0, moderate_lanes = 0, stepwise = 0, stepwise_moderate = 0, sum_then_add_moderate = 0;
  uint16_t a[16][32], b[16][32];
  float c[16][16], out[16][16];
  for (long it = 0; it < tiles; ++it) {
    const int mode = (int)(it % 4);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 32; ++j) { a[i][j] = operand(mode); b[i][j] = operand(mode); }
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) c[i][j] = from_bits(mode == 2 ? (uint32_t)((next() & 0x807FFFFFu) | ((uint32_t)(100 + next() % 56) << 23)) : (uint32_t)next());
    _tile_loadd(0, c, 64);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, out, 64);
    for (int m = 0; m < 16; ++m) {
      for (int n = 0; n < 16; ++n) {
        float steps = c[m][n], sum = 0;
        for (int k = 0; k < 16; ++k) {
          const uint16_t pa[2] = {a[m][2 * k], a[m][2 * k + 1]}, pb[2] = {b[k][2 * n], b[k][2 * n + 1]};
          steps = model(steps, pa, pb, 1);
          sum += widen(pa[1]) * widen(pb[1]);
          sum += widen(pa[0]) * widen(pb[0]);
        }
        const float sum_then_add = zero_denormal(zero_denormal(c[m][n]) + sum);
        const uint32_t h = to_bits(out[m][n]);
        const int differs = h != to_bits(steps) && !(is_nan(h) && is_nan(to_bits(steps)));
        ++lanes;
        stepwise += differs;
        if (mode == 2) {
          ++moderate_lanes;
          stepwise_moderate += differs;
          sum_then_add_moderate += h != to_bits(sum_then_add);
        }
      }
    }
  }
  printf("amx_lanes %ld\namx_mismatch_stepwise_model %ld\namx_moderate_lanes %ld\n", lanes, stepwise, moderate_lanes);
  printf("amx_moderate_mismatch_stepwise_model %ld\namx_moderate_mismatch_sum_then_add %ld\n", stepwise_moderate, sum_then_add_moderate);
  double* times = malloc(sizeof(double) * (size_t)rounds);
  const long steps = STEPS / 8;
  for (int r = 0; r < rounds; ++r) {
    const double start = thread_seconds();
    amx_rate(steps);
    times[r] = thread_seconds() - start;
  }
  const double ns = 1e9 * median(times, rounds) / (4.0 * steps);
  printf("ns_per_instruction_tdpbf16ps %.4f\nproducts_per_ns_tdpbf16ps %.1f\n", ns, 16.0 * 16 * 32 / ns);
  free(times);
  _tile_release();
}

int main(int argc, char** argv) {
  const long vectors = argc > 1 ? atol(argv[1]) : 2000000;
  const int rounds = argc > 2 ? atoi(argv[2]) : 40;
  if (!__builtin_cpu_supports("avx512bf16")) {
    printf("avx512bf16 0\n");
    return 1;
  }
  printf("avx512bf16 1\n");
  semantics(vectors);
  throughput(rounds);
  verify_scores(rounds);
  amx(vectors / 100, rounds);
  return 0;
}
