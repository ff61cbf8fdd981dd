// y = x . w^T in bfloat16 for a few rows of bfloat16 x (rows, k) and a bfloat16 kernel w (n, k)
// held outputs first: a decoding step's products, each weight read once as bfloat16. An XLA FFI
// handler (`zoo.engine.kernels.bf16_rows` compiles, checks, loads and registers it), compiled for
// one instruction set, chosen by a macro:
// - ZOO_AVX512_BF16: the CPU's bfloat16 dot products (vdpbf16ps), 32 weights a step;
// - ZOO_AVX512F: AVX-512 F and BW, each bfloat16 widened to float32 by a shift (its 16 bits are
//   a float32's high half), then float32 FMAs, 32 weights a step;
// - ZOO_AVX2: AVX2 and FMA, the same widening and FMAs on 256-bit vectors, 16 weights a step.
// Sums are float32, rounded once to bfloat16 (to nearest, ties to even), as XLA's bfloat16 dot
// computes; each (row, output) sum runs in one order that depends on k alone, so a row's result
// is the same bits whatever other rows are in the batch.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(ZOO_AVX512_BF16)

// x stays bfloat16; a step multiplies 32 pairs of bfloat16 into 16 float32 sums.
struct Isa {
  static constexpr int kStep = 32;      // weights (bfloat16) a step reads
  static constexpr int kOutputs = 5;    // a 4-row tile's outputs: 20 sums, 5 weights, x
  using X = uint16_t;                   // x as the steps read it
  using W = __m512bh;
  using Acc = __m512;
  static bool Supported() { return __builtin_cpu_supports("avx512bf16"); }
  static void PrepareX(const uint16_t* x, int64_t k, X* out) {
    std::memcpy(out, x, k * sizeof(uint16_t));
  }
  static W LoadW(const uint16_t* p, int64_t left) {
    if (left >= kStep) return (W)_mm512_loadu_si512(p);
    return (W)_mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1), p);
  }
  static Acc Zero() { return _mm512_setzero_ps(); }
  static Acc Step(Acc acc, const X* x, W w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), w);
  }
  static float Sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};

#elif defined(ZOO_AVX512F) || defined(ZOO_AVX2)

// A bfloat16 is the high half of the float32 of the same value: a step takes the weights in
// pairs, the even one shifted up into its float32 and the odd one's high half masked out, and x
// is widened once, before the steps, each step's evens then its odds.
#if defined(ZOO_AVX512F)
struct Lanes {
  static constexpr int kLanes = 16;
  using V = __m512;
  using I = __m512i;
  static bool Supported() {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }
  static I Load(const uint16_t* p, int64_t left) {
    if (left >= 2 * kLanes) return _mm512_loadu_si512(p);
    return _mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1), p);
  }
  static V Even(I w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
  static V Odd(I w) {
    return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xffff0000u))));
  }
  static V LoadF(const float* p) { return _mm512_loadu_ps(p); }
  static V Zero() { return _mm512_setzero_ps(); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float Sum(V v) { return _mm512_reduce_add_ps(v); }
};
#else
struct Lanes {
  static constexpr int kLanes = 8;
  using V = __m256;
  using I = __m256i;
  static bool Supported() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  static I Load(const uint16_t* p, int64_t left) {
    if (left >= 2 * kLanes) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    alignas(32) uint16_t tail[2 * kLanes] = {};  // AVX2 has no 16-bit masked load
    std::memcpy(tail, p, left * sizeof(uint16_t));
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
  }
  static V Even(I w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
  static V Odd(I w) {
    return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int32_t(0xffff0000u))));
  }
  static V LoadF(const float* p) { return _mm256_loadu_ps(p); }
  static V Zero() { return _mm256_setzero_ps(); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float Sum(V v) {  // one fixed order: halves, then quarters, then pairs
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#endif

struct Isa {
  static constexpr int kStep = 2 * Lanes::kLanes;
  // A 4-row tile's outputs: 16 sums, 4 weights widened in two halves, x (AVX2's 16 registers
  // spill some of it, and still measured fastest).
  static constexpr int kOutputs = 4;
  using X = float;
  using W = Lanes::I;
  using Acc = Lanes::V;
  static bool Supported() { return Lanes::Supported(); }
  static void PrepareX(const uint16_t* x, int64_t k, X* out) {
    for (int64_t i = 0; i < k; ++i) {
      const uint32_t bits = uint32_t(x[i]) << 16;
      const int64_t step = i / kStep, j = i % kStep;
      std::memcpy(out + step * kStep + (j % 2) * Lanes::kLanes + j / 2, &bits, sizeof bits);
    }
  }
  static W LoadW(const uint16_t* p, int64_t left) { return Lanes::Load(p, left); }
  static Acc Zero() { return Lanes::Zero(); }
  static Acc Step(Acc acc, const X* x, W w) {
    acc = Lanes::Fma(Lanes::LoadF(x), Lanes::Even(w), acc);
    return Lanes::Fma(Lanes::LoadF(x + Lanes::kLanes), Lanes::Odd(w), acc);
  }
  static float Sum(Acc acc) { return Lanes::Sum(acc); }
};

#else
#error "compile with one of -DZOO_AVX512_BF16, -DZOO_AVX512F, -DZOO_AVX2"
#endif

// `f` rounded to the nearest bfloat16, ties to even (a NaN stays a NaN), as XLA converts.
uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The steps of rows [r, r + M) by outputs [n, n + NB) over the `left` weights from i: a whole
// step, or the last, shorter one. The loop over whole steps calls it apart from the last, so that
// no masked load sits in that loop and the compiler keeps every sum in a register. `ahead`: the
// next tile's weights, asked for at the same offsets (the hardware's prefetcher, following a
// tile's several rows of weights, kept a big layer's product waiting on memory a third longer).
template <int M, int NB>
__attribute__((always_inline)) inline void Steps(Isa::Acc (&acc)[M][NB], const Isa::X* x,
                                                 int64_t stride, const uint16_t* w, int64_t k,
                                                 int64_t r, int64_t n, int64_t i, int64_t left,
                                                 bool ahead) {
  if (ahead)
    for (int b = 0; b < NB; ++b)
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + NB + b) * k + i), _MM_HINT_T0);
  Isa::W wv[NB];
  for (int b = 0; b < NB; ++b) wv[b] = Isa::LoadW(w + (n + b) * k + i, left);
  for (int m = 0; m < M; ++m) {
    const Isa::X* xm = x + (r + m) * stride + i;
    for (int b = 0; b < NB; ++b) acc[m][b] = Isa::Step(acc[m][b], xm, wv[b]);
  }
}

// Outputs [n0, n1) of rows [r, r + M) of x prepared as `Isa::PrepareX` lays it (each row
// `stride` long, zeros past k): each (row, output) sum is taken in the same order whatever M
// and NB are, so a row's result does not depend on the other rows.
template <int M, int NB>
void Tile(const Isa::X* x, int64_t stride, const uint16_t* w, uint16_t* y, int64_t r,
          int64_t n_total, int64_t k, int64_t n0, int64_t n1) {
  const int64_t whole = k / Isa::kStep * Isa::kStep;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    Isa::Acc acc[M][NB];
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b) acc[m][b] = Isa::Zero();
    const bool ahead = n + 2 * NB <= n_total;
    for (int64_t i = 0; i < whole; i += Isa::kStep)
      Steps<M, NB>(acc, x, stride, w, k, r, n, i, Isa::kStep, ahead);
    if (whole < k) Steps<M, NB>(acc, x, stride, w, k, r, n, whole, k - whole, false);
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b) y[(r + m) * n_total + n + b] = ToBf16(Isa::Sum(acc[m][b]));
  }
  for (; n < n1; ++n) Tile<M, 1>(x, stride, w, y, r, n_total, k, n, n + 1);
}

// Tiles of 4 rows by 4 or 5 outputs (each weight read, and widened, once for 4 rows; a step's
// loads per multiply-add fewest within the registers), then of 2 rows, then 1 row by 8: the
// shapes that took least time among 1 to 8 rows by 1 to 8 outputs, on each variant.
void Outputs(const Isa::X* x, int64_t stride, const uint16_t* w, uint16_t* y, int64_t rows,
             int64_t n_total, int64_t k, int64_t n0, int64_t n1) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) Tile<4, Isa::kOutputs>(x, stride, w, y, r, n_total, k, n0, n1);
  for (; r + 2 <= rows; r += 2) Tile<2, 4>(x, stride, w, y, r, n_total, k, n0, n1);
  for (; r < rows; ++r) Tile<1, 8>(x, stride, w, y, r, n_total, k, n0, n1);
}

// Blocks of outputs taken in turn by the calling thread and the intra-op threads, whichever is
// free; small enough that a block's weights stay in a core's L2 cache while the row tiles after
// the first read them again.
constexpr int64_t kBlock = 256;

struct Job {
  std::vector<Isa::X> x;  // prepared, `stride` a row
  const uint16_t* w;
  uint16_t* y;
  int64_t rows, k, n, stride, blocks;
  std::atomic<int64_t> next{0}, completed{0};
  std::mutex mu;
  std::condition_variable finished;

  void Work() {
    for (int64_t b = next++; b < blocks; b = next++) {
      Outputs(x.data(), stride, w, y, rows, n, k, b * kBlock, std::min(n, (b + 1) * kBlock));
      if (++completed == blocks) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

ffi::Error Bf16Rows(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::BF16> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("zoo_bf16_rows takes x (rows, k) and w (n, k)");
  auto job = std::make_shared<Job>();
  job->w = reinterpret_cast<const uint16_t*>(w.typed_data());
  job->y = reinterpret_cast<uint16_t*>(y->typed_data());
  job->rows = xd[0], job->k = xd[1], job->n = wd[0];
  job->stride = (job->k + Isa::kStep - 1) / Isa::kStep * Isa::kStep;
  job->x.assign(job->rows * job->stride, Isa::X{});
  const auto* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  for (int64_t r = 0; r < job->rows; ++r)
    Isa::PrepareX(xs + r * job->k, job->k, job->x.data() + r * job->stride);
  job->blocks = (job->n + kBlock - 1) / kBlock;
  // Helpers are asked for, never waited for: one that starts after the blocks are gone does
  // nothing (the job outlives this call for it), so a pool busy with other calls, themselves
  // waiting, cannot stall this one.
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->blocks - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([job] { job->Work(); });
  job->Work();
  std::unique_lock<std::mutex> lock(job->mu);
  job->finished.wait(lock, [&] { return job->completed == job->blocks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooBf16Rows, Bf16Rows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

// Whether this CPU runs the instructions the library was compiled for (the caller's reading of
// /proc/cpuinfo, checked again where it counts).
extern "C" int ZooBf16Supported() { return Isa::Supported() ? 1 : 0; }
