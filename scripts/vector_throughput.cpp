// What bounds hspec's CPU kernels on this machine (scripts/vector_throughput.py builds and runs this):
// how many 256-bit vector instructions one core retires a second, per instruction kind (8 independent
// chains, so latency does not count), and how fast 1..T threads stream a buffer far larger than the caches.
// Prints one "name value" line per measurement. Needs AVX2 and FMA.

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// ns per instruction of op(a, b) over 8 chains; the empty asm keeps the 8 accumulators in registers.
template <typename Op>
double ns_per_instruction_once(Op op, int seed, long rounds) {
  __m256i a0 = _mm256_set1_epi8(seed), a1 = _mm256_set1_epi8(seed + 1), a2 = _mm256_set1_epi8(seed + 2),
          a3 = _mm256_set1_epi8(seed + 3), a4 = _mm256_set1_epi8(seed + 4), a5 = _mm256_set1_epi8(seed + 5),
          a6 = _mm256_set1_epi8(seed + 6), a7 = _mm256_set1_epi8(seed + 7);
  const __m256i b = _mm256_set1_epi8(seed);
  const Clock::time_point start = Clock::now();
  for (long i = 0; i < rounds; ++i) {
    a0 = op(a0, b), a1 = op(a1, b), a2 = op(a2, b), a3 = op(a3, b);
    a4 = op(a4, b), a5 = op(a5, b), a6 = op(a6, b), a7 = op(a7, b);
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7));
  }
  const double elapsed = seconds_since(start);
  const __m256i all = _mm256_xor_si256(_mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)),
                                       _mm256_xor_si256(_mm256_xor_si256(a4, a5), _mm256_xor_si256(a6, a7)));
  if (_mm256_extract_epi32(all, 0) == 0x5eed) std::printf("#\n");  // keeps the chains alive
  return elapsed * 1e9 / (8.0 * rounds);
}

// The best of 3 timings (a first one can catch the core at a lower clock or sharing it).
template <typename Op>
double ns_per_instruction(Op op, int seed, long rounds) {
  double best = ns_per_instruction_once(op, seed, rounds);
  for (int r = 1; r < 3; ++r) best = std::min(best, ns_per_instruction_once(op, seed, rounds));
  return best;
}

// GB/s of `threads` threads each summing its share of `bytes` with 256-bit loads, best of `repeats`.
double stream_gb_per_s(const std::vector<int64_t>& buffer, int threads, int repeats) {
  const size_t per_thread = buffer.size() / threads / 4 * 4;
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    std::vector<std::thread> workers;
    std::vector<int64_t> sums(threads);
    const Clock::time_point start = Clock::now();
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        const int64_t* p = buffer.data() + t * per_thread;
        __m256i acc = _mm256_setzero_si256();
        for (size_t i = 0; i < per_thread; i += 4) {
          acc = _mm256_add_epi64(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
        }
        sums[t] = _mm256_extract_epi64(acc, 0);
      });
    }
    for (std::thread& w : workers) w.join();
    const double elapsed = seconds_since(start);
    best = std::max(best, threads * per_thread * sizeof(int64_t) / elapsed / 1e9);
    if (sums[0] == 0x5eed) std::printf("#\n");
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const long rounds = argc > 2 ? std::atol(argv[2]) : 50000000;
  volatile int seed = 3;
  std::printf("vpaddw_ns %.4f\n", ns_per_instruction([](__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }, seed, rounds));
  std::printf("vpmaddubsw_ns %.4f\n", ns_per_instruction([](__m256i a, __m256i b) { return _mm256_maddubs_epi16(a, b); }, seed, rounds));
  std::printf("vpmaddwd_ns %.4f\n", ns_per_instruction([](__m256i a, __m256i b) { return _mm256_madd_epi16(a, b); }, seed, rounds));
  std::printf("vpshufb_ns %.4f\n", ns_per_instruction([](__m256i a, __m256i b) { return _mm256_shuffle_epi8(a, b); }, seed, rounds));
  std::printf("vfmadd_ns %.4f\n", ns_per_instruction([](__m256i a, __m256i b) {
    return _mm256_castps_si256(_mm256_fmadd_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), _mm256_castsi256_ps(a)));
  }, seed, rounds));
  std::vector<int64_t> buffer(size_t{1} << 25, 1);  // 256 MiB
  for (int t = 1; t <= max_threads; ++t) std::printf("stream_gb_s_%d %.2f\n", t, stream_gb_per_s(buffer, t, 5));
  return 0;
}
