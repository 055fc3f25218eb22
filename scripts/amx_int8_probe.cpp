// A probe of AMX-INT8 against the AVX512-VNNI tiles for the integer products of a few rows (docs/fast-path.md,
// "A second AMX host"): not part of hspec, one-off evidence for what to build next. Build and run on a CPU with
// AMX-INT8 (Linux 5.16 or newer, which grants the tile state on request):
//
//   g++ -O3 -o /tmp/amx_int8_probe scripts/amx_int8_probe.cpp && /tmp/amx_int8_probe
//
// Three products of M int8 rows by a (1536, 576) int8 weight, one thread, the best of 7 x 50 calls:
// - `vnni_product`: the wide w8a8 tile of models/cpu_kernels.cpp (rows in int8 blocks of 32, each block's
//   integer sum scaled by the row's step for that block);
// - `amx_product`: the same numbers with `tdpbssd`, one 8-output tile of the weight layout as the B tile and
//   each block's int32 sums stored and scaled on their own (it must equal `vnni_product` bit for bit);
// - `amx_rowscale`: rows with one scale for the whole row, so the C tiles accumulate all of K in int32 and
//   are stored once per 16 outputs (the weights laid out for AMX, [N/16][K/4][64 bytes]).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include <random>

constexpr int kBlock = 32;

struct TileConfig { uint8_t palette; uint8_t start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

__attribute__((target("amx-tile,amx-int8,avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma")))
void amx_product(int M, int K, int N, const int8_t* x, const float* xstep, const int8_t* w, float* out) {
  // x: [K/32][M][32]; w tiles: [N/8][K/32][8 vectors x 32 bytes]; out (M, N)
  const int blocks = K / kBlock;
  TileConfig cfg{};
  cfg.palette = 1;
  cfg.colsb[0] = 32; cfg.rows[0] = M;   // C0 (M x 8 int32)
  cfg.colsb[1] = 32; cfg.rows[1] = M;   // C1
  cfg.colsb[2] = 32; cfg.rows[2] = M;   // A (M x 32 int8)
  cfg.colsb[3] = 32; cfg.rows[3] = 8;   // B0 (8 x 32)
  cfg.colsb[4] = 32; cfg.rows[4] = 8;   // B1
  _tile_loadconfig(&cfg);
  alignas(64) int32_t c0[16 * 8], c1[16 * 8];
  for (int t = 0; t < N / 8; t += 2) {
    __m256 acc0[16], acc1[16];
    for (int m = 0; m < M; ++m) acc0[m] = _mm256_setzero_ps(), acc1[m] = _mm256_setzero_ps();
    const int8_t* wa = w + (size_t)t * K * 8;
    const int8_t* wb = wa + (size_t)K * 8;
    for (int g = 0; g < blocks; ++g) {
      _tile_zero(0); _tile_zero(1);
      _tile_loadd(2, x + (size_t)g * M * kBlock, kBlock);
      _tile_loadd(3, wa + (size_t)g * 256, 32);
      _tile_loadd(4, wb + (size_t)g * 256, 32);
      _tile_dpbssd(0, 2, 3);
      _tile_dpbssd(1, 2, 4);
      _tile_stored(0, c0, 32);
      _tile_stored(1, c1, 32);
      for (int m = 0; m < M; ++m) {
        const __m256 s = _mm256_set1_ps(xstep[g * M + m]);
        acc0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(c0 + 8 * m))), s, acc0[m]);
        acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(c1 + 8 * m))), s, acc1[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      _mm256_storeu_ps(out + (size_t)m * N + 8 * t, acc0[m]);
      _mm256_storeu_ps(out + (size_t)m * N + 8 * t + 8, acc1[m]);
    }
  }
  _tile_release();
}

__attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma")))
void vnni_product(int M, int K, int N, const int8_t* x, const float* xstep, const int8_t* w, float* out) {
  const int blocks = K / kBlock;
  const __m512i shift = _mm512_set1_epi8((char)0x80);
  for (int t = 0; t < N / 8; t += 2) {
    __m512 acc[16];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const int8_t* wa = w + (size_t)t * K * 8;
    const int8_t* wb = wa + (size_t)K * 8;
    for (int g = 0; g < blocks; ++g) {
      __m512i wv[8]; __m512i corr = _mm512_setzero_si512();
      for (int q = 0; q < 8; ++q) {
        wv[q] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(wa + g * 256 + 32 * q))),
                                   _mm256_loadu_si256((const __m256i*)(wb + g * 256 + 32 * q)), 1);
        corr = _mm512_dpbusd_epi32(corr, shift, wv[q]);
      }
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const int8_t* xm = x + ((size_t)g * M + m) * kBlock;
        __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
          int32_t four; std::memcpy(&four, xm + 4 * q, 4);
          s = _mm512_dpbusd_epi32(s, _mm512_xor_si512(_mm512_set1_epi32(four), shift), wv[q]);
        }
        s = _mm512_sub_epi32(s, corr);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xstep[g * M + m]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + (size_t)m * N + 8 * t, acc[m]);
  }
}


// Per-row activation scale: the whole K accumulates in int32 in the C tile, one store per 16 outputs.
// Weights laid out for AMX: [N/16][K/4][64 bytes] (row k4: inputs 4k4..4k4+3 of 16 outputs).
__attribute__((target("amx-tile,amx-int8,avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma")))
void amx_rowscale(int M, int K, int N, const int8_t* x, const int8_t* wt, int32_t* out) {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 4; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = M; }  // C0..C3: M x 16 int32
  cfg.colsb[4] = 64; cfg.rows[4] = M;    // A: M x 64 int8
  for (int i = 5; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }  // B: 16 x 64
  _tile_loadconfig(&cfg);
  const size_t per16 = (size_t)K / 4 * 64;
  for (int t = 0; t < N / 16; t += 2) {
    _tile_zero(0); _tile_zero(1);
    for (int k = 0; k < K; k += 64) {
      _tile_loadd(4, x + k, K);
      _tile_loadd(5, wt + t * per16 + (size_t)k / 4 * 64, 64);
      _tile_loadd(6, wt + (t + 1) * per16 + (size_t)k / 4 * 64, 64);
      _tile_dpbssd(0, 4, 5);
      _tile_dpbssd(1, 4, 6);
    }
    _tile_stored(0, out + 16 * t, N * 4);
    _tile_stored(1, out + 16 * t + 16, N * 4);
  }
  _tile_release();
}
// Microseconds per call of f: the best of 7 runs of 50 calls.
template <typename F>
double best_microseconds(const F& f) {
  double best = 1e9;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 50; ++i) f();
    best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 50);
  }
  return best;
}

int probe_row_scale() {
  const int K = 576, N = 1536;
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> d(-127, 127);
  std::vector<int8_t> wt((size_t)N * K);
  for (auto& v : wt) v = d(rng);
  for (int M : {1, 4, 7, 8, 16}) {
    std::vector<int8_t> x((size_t)M * K); for (auto& v : x) v = d(rng);
    std::vector<int32_t> o((size_t)M * N);
    const double best = best_microseconds([&] { amx_rowscale(M, K, N, x.data(), wt.data(), o.data()); });
    std::printf("M=%2d (1536x576, 1 thread): AMX, one activation scale per row: %.1f us\n", M, best);
  }
  return 0;
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { std::printf("this CPU or kernel grants no AMX tile state\n"); return 1; }
  probe_row_scale();
  const int K = 576, N = 1536;
  std::mt19937 rng(0);
  std::uniform_int_distribution<int> d(-127, 127);
  std::vector<int8_t> w((size_t)N * K);
  for (auto& v : w) v = d(rng);
  for (int M : {1, 4, 7, 8, 16}) {
    std::vector<int8_t> x((size_t)M * K); for (auto& v : x) v = d(rng);
    std::vector<float> st((size_t)M * K / 32, 0.01f);
    std::vector<float> a((size_t)M * N), b((size_t)M * N);
    amx_product(M, K, N, x.data(), st.data(), w.data(), a.data());
    vnni_product(M, K, N, x.data(), st.data(), w.data(), b.data());
    const bool same = std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
    const double ta = best_microseconds([&] { amx_product(M, K, N, x.data(), st.data(), w.data(), a.data()); });
    const double tb = best_microseconds([&] { vnni_product(M, K, N, x.data(), st.data(), w.data(), b.data()); });
    std::printf("M=%2d (1536x576, 1 thread): AMX %.1f us, VNNI wide %.1f us, equal=%d\n", M, ta, tb, same);
  }
}
