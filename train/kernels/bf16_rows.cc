// y = x . w^T in bfloat16 for a few rows of bfloat16 x (rows, k) and a bfloat16 kernel w (n, k)
// held outputs first: a decoding step's products, on the CPU's AVX-512 BF16 dot products
// (vdpbf16ps), each weight read once. An XLA FFI handler (`zoo.engine.bf16_rows` compiles,
// loads and registers it). Sums are float32, rounded once to bfloat16 (to nearest, ties to
// even), as XLA's bfloat16 dot computes; each (row, output) sum runs in one order that depends
// on k alone, so a row's result is the same bits whatever other rows are in the batch.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

__m512bh Load(const uint16_t* p, int64_t left) {
  if (left >= 32) return (__m512bh)_mm512_loadu_si512(p);
  __mmask32 mask = (__mmask32)((1ull << left) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// `f` rounded to the nearest bfloat16, ties to even (a NaN stays a NaN), as XLA converts.
uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Outputs [n0, n1) of rows [r, r + M): each (row, output) sum is taken in the same order
// whatever M and NB are, so a row's result does not depend on the other rows.
template <int M, int NB>
void Tile(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t r, int64_t n_total, int64_t k,
          int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    __m512 acc[M][NB];
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
      __m512bh wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = Load(w + (n + b) * k + i, k - i);
      for (int m = 0; m < M; ++m) {
        __m512bh xv = Load(x + (r + m) * k + i, k - i);
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b) y[(r + m) * n_total + n + b] = ToBf16(_mm512_reduce_add_ps(acc[m][b]));
  }
  for (; n < n1; ++n) Tile<M, 1>(x, w, y, r, n_total, k, n, n + 1);
}

void Outputs(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows, int64_t n_total,
             int64_t k, int64_t n0, int64_t n1) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) Tile<8, 2>(x, w, y, r, n_total, k, n0, n1);
  for (; r + 4 <= rows; r += 4) Tile<4, 2>(x, w, y, r, n_total, k, n0, n1);
  for (; r + 2 <= rows; r += 2) Tile<2, 4>(x, w, y, r, n_total, k, n0, n1);
  for (; r < rows; ++r) Tile<1, 4>(x, w, y, r, n_total, k, n0, n1);
}

// Blocks of outputs taken in turn by the calling thread and the intra-op threads, whichever is
// free.
constexpr int64_t kBlock = 256;

struct Job {
  const uint16_t* x;
  const uint16_t* w;
  uint16_t* y;
  int64_t rows, k, n, blocks;
  std::atomic<int64_t> next{0}, completed{0};
  std::mutex mu;
  std::condition_variable finished;

  void Work() {
    for (int64_t b = next++; b < blocks; b = next++) {
      Outputs(x, w, y, rows, n, k, b * kBlock, std::min(n, (b + 1) * kBlock));
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
  job->x = reinterpret_cast<const uint16_t*>(x.typed_data());
  job->w = reinterpret_cast<const uint16_t*>(w.typed_data());
  job->y = reinterpret_cast<uint16_t*>(y->typed_data());
  job->rows = xd[0], job->k = xd[1], job->n = wd[0];
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

extern "C" int ZooBf16Supported() { return __builtin_cpu_supports("avx512bf16") ? 1 : 0; }
