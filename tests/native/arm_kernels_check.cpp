// Every weight type's row-layout dot product as this build runs it (NEON on ARM) against the scalar path, bit for
// bit, for the tiles the GEMM driver uses: random blocks (finite scales), random activations quantized as the
// kernels quantize them. Built from the kernels' first four parts (those that hold them; standalone) by
// tests/native/test_arm_kernels.py and run under qemu-user. `--corrupt`: the build's side reads one weight byte
// changed, which the check must report.
#include <cstdio>
#include <cstring>
#include <random>

#include "common.h"
#include "act_quant.h"
#include "dot.h"
#include "types.h"
}  // namespace: the one common.h opens (block.h closes it in kernels.cpp)

namespace {

std::mt19937 g_rng(1234);
bool g_corrupt = false;
int g_checks = 0, g_mismatches = 0;

// a finite float16 of modest size and random sign, little-endian at p
void put_f16(uint8_t* p) {
  const uint16_t h = static_cast<uint16_t>(0x2000 | (g_rng() & 0x1FFF) | ((g_rng() & 1) << 15));
  std::memcpy(p, &h, 2);
}

// Random blocks of type T: every byte random, then its float16 fields (offsets `f16_at`) finite.
template <class T>
std::vector<uint8_t> random_blocks(int64_t n, std::initializer_list<int> f16_at) {
  std::vector<uint8_t> bytes(n * T::SIZE);
  for (auto& b : bytes) b = static_cast<uint8_t>(g_rng());
  for (int64_t b = 0; b < n; ++b)
    for (int at : f16_at) put_f16(bytes.data() + b * T::SIZE + at);
  return bytes;
}

template <class T, int RW, int R>
void check_tile(const char* name, std::initializer_list<int> f16_at) {
  constexpr int64_t nb = T::QK == 32 ? 8 : 4;
  std::vector<std::vector<uint8_t>> rows;
  std::vector<std::vector<typename T::Act>> acts(R, std::vector<typename T::Act>(nb));
  const uint8_t* w[RW];
  const typename T::Act* a[R];
  for (int i = 0; i < RW; ++i) rows.push_back(random_blocks<T>(nb, f16_at));
  for (int i = 0; i < RW; ++i) w[i] = rows[i].data();
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int r = 0; r < R; ++r) {
    std::vector<float> x(nb * T::QK);
    for (auto& v : x) v = normal(g_rng);
    quantize_row(x.data(), acts[r].data(), nb);
    a[r] = acts[r].data();
  }
  float want[RW * R], got[RW * R];
  scalar_dot<T, RW, R>(w, a, nb, want);
  if (g_corrupt) rows[0][T::SIZE / 2] ^= 0x11;
  T::template dot<RW, R>(w, a, nb, got);
  ++g_checks;
  if (std::memcmp(want, got, sizeof(want)) != 0) {
    ++g_mismatches;
    std::printf("mismatch %s %dx%d: %.9g vs %.9g\n", name, RW, R, want[0], got[0]);
  }
}

template <class T>
void check_type(const char* name, std::initializer_list<int> f16_at) {
  for (int round = 0; round < 4; ++round) {
    check_tile<T, 1, 1>(name, f16_at);
    check_tile<T, 4, 1>(name, f16_at);
    check_tile<T, 2, 2>(name, f16_at);
    check_tile<T, 1, 3>(name, f16_at);
    check_tile<T, 1, 4>(name, f16_at);
  }
}

}  // namespace

int main(int argc, char** argv) {
  g_corrupt = argc > 1 && std::strcmp(argv[1], "--corrupt") == 0;
  check_type<Q4_0>("Q4_0", {0});
  check_type<Q4_1>("Q4_1", {0, 2});
  check_type<Q5_0>("Q5_0", {0});
  check_type<Q5_1>("Q5_1", {0, 2});
  check_type<Q8_0>("Q8_0", {0});
  check_type<Q2_K>("Q2_K", {80, 82});
  check_type<Q3_K>("Q3_K", {108});
  check_type<Q4_K>("Q4_K", {0, 2});
  check_type<Q5_K>("Q5_K", {0, 2});
  check_type<Q6_K>("Q6_K", {208});
  check_type<IQ4_NL>("IQ4_NL", {0});
  check_type<IQ4_XS>("IQ4_XS", {0});
  check_type<MXFP4>("MXFP4", {});
  std::printf("build: neon %d, dotprod %d\n", RUNLM_NEON,
#if defined(__ARM_FEATURE_DOTPROD)
              1
#else
              0
#endif
  );
  std::printf("%d checks, %d mismatches\n", g_checks, g_mismatches);
  return g_mismatches ? 1 : 0;
}
