// loom's CPU decode kernels: packed_linear, decode_attention, decode_attention_paged. Built and loaded by
// kernels.py, whose docstring says what they compute and why.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t PREFETCH_AHEAD = 4;

// Rows a[0..MR) (row stride lda) times one packed panel b [K, 16] -> c[0..MR) x [0..ncols) (row stride ldc),
// plus bias (16 values, or null). pf: a later panel, prefetched one cache line (16 floats) per k, or null.
template <int MR>
inline void tile(const float* a, int64_t lda, const float* b, int64_t K, float* c, int64_t ldc, int ncols,
                 const float* bias, const float* pf) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps(), c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * 16), b1 = _mm256_loadu_ps(b + k * 16 + 8);
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + k * 16), _MM_HINT_T0);
    // Named accumulators, not an array: GCC keeps an array of __m256 on the stack through the loop.
#define LOOM_ROW(m, x0, x1) if constexpr (MR > m) { const __m256 x = _mm256_broadcast_ss(a + m * lda + k); \
      x0 = _mm256_fmadd_ps(x, b0, x0); x1 = _mm256_fmadd_ps(x, b1, x1); }
    LOOM_ROW(0, c00, c01) LOOM_ROW(1, c10, c11) LOOM_ROW(2, c20, c21)
    LOOM_ROW(3, c30, c31) LOOM_ROW(4, c40, c41) LOOM_ROW(5, c50, c51)
#undef LOOM_ROW
  }
  alignas(32) float out[6][16];
  _mm256_store_ps(out[0], c00); _mm256_store_ps(out[0] + 8, c01);
  if constexpr (MR > 1) { _mm256_store_ps(out[1], c10); _mm256_store_ps(out[1] + 8, c11); }
  if constexpr (MR > 2) { _mm256_store_ps(out[2], c20); _mm256_store_ps(out[2] + 8, c21); }
  if constexpr (MR > 3) { _mm256_store_ps(out[3], c30); _mm256_store_ps(out[3] + 8, c31); }
  if constexpr (MR > 4) { _mm256_store_ps(out[4], c40); _mm256_store_ps(out[4] + 8, c41); }
  if constexpr (MR > 5) { _mm256_store_ps(out[5], c50); _mm256_store_ps(out[5] + 8, c51); }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < ncols; ++j) c[m * ldc + j] = bias ? out[m][j] + bias[j] : out[m][j];
}

// The AVX-512 path, compiled for AVX-512F at function level (the library still builds and loads on an AVX2-only
// machine, which never calls it). A tile is MR rows times NP (1 or 2) adjacent panels: one zmm register per
// row and panel (a panel's row k is 16 floats, one zmm), so 8 rows x 32 columns hold 16 accumulators and
// each k costs 2 panel loads, 8 broadcasts and 16 fused multiply-adds. The sum per output is the AVX2 tile's
// (k in order, one fma each, then the bias), so both paths give the same bits.
#define LOOM_AVX512 __attribute__((target("avx512f")))

LOOM_AVX512 inline void store_row512(float* c, __m512 v, __mmask16 mask, const float* bias) {
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(c, mask, v);
}

// Rows a[0..MR) (row stride lda) times panels b and b + K * 16 (the second when NP == 2) -> c (row stride ldc),
// ncols (<= 16 NP) columns; bias (ncols values, or null); pf: a later panel pair, two lines per k, or null.
template <int MR, int NP>
LOOM_AVX512 inline void tile512(const float* a, int64_t lda, const float* b, int64_t K, float* c, int64_t ldc,
                                int ncols, const float* bias, const float* pf) {
  const float* b1 = b + K * 16;
  __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps(), c3 = _mm512_setzero_ps();
  __m512 c4 = _mm512_setzero_ps(), c5 = _mm512_setzero_ps(), c6 = _mm512_setzero_ps(), c7 = _mm512_setzero_ps();
  __m512 d0 = _mm512_setzero_ps(), d1 = _mm512_setzero_ps(), d2 = _mm512_setzero_ps(), d3 = _mm512_setzero_ps();
  __m512 d4 = _mm512_setzero_ps(), d5 = _mm512_setzero_ps(), d6 = _mm512_setzero_ps(), d7 = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(b + k * 16);
    __m512 w1 = w0;
    if constexpr (NP > 1) w1 = _mm512_loadu_ps(b1 + k * 16);
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf + (K + k) * 16), _MM_HINT_T0);
    }
#define LOOM_ROW(m, x0, x1) if constexpr (MR > m) { const __m512 x = _mm512_set1_ps(a[m * lda + k]); \
      x0 = _mm512_fmadd_ps(x, w0, x0); if constexpr (NP > 1) x1 = _mm512_fmadd_ps(x, w1, x1); }
    LOOM_ROW(0, c0, d0) LOOM_ROW(1, c1, d1) LOOM_ROW(2, c2, d2) LOOM_ROW(3, c3, d3)
    LOOM_ROW(4, c4, d4) LOOM_ROW(5, c5, d5) LOOM_ROW(6, c6, d6) LOOM_ROW(7, c7, d7)
#undef LOOM_ROW
  }
  const __mmask16 m0 = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
  const float* bias1 = bias ? bias + 16 : nullptr;
#define LOOM_STORE(m, x0, x1) if constexpr (MR > m) { store_row512(c + m * ldc, x0, m0, bias); \
      if constexpr (NP > 1) store_row512(c + m * ldc + 16, x1, m1, bias1); }
  LOOM_STORE(0, c0, d0) LOOM_STORE(1, c1, d1) LOOM_STORE(2, c2, d2) LOOM_STORE(3, c3, d3)
  LOOM_STORE(4, c4, d4) LOOM_STORE(5, c5, d5) LOOM_STORE(6, c6, d6) LOOM_STORE(7, c7, d7)
#undef LOOM_STORE
}

template <int NP>
LOOM_AVX512 void rows512(const float* A, int64_t M, int64_t K, const float* panel, float* out, int64_t N, int ncols,
                         const float* bias, const float* pf) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) tile512<8, NP>(A + m * K, K, panel, K, out + m * N, N, ncols, bias, pf);
  const float* a = A + m * K;
  float* c = out + m * N;
  switch (M - m) {
    case 7: tile512<7, NP>(a, K, panel, K, c, N, ncols, bias, pf); break;
    case 6: tile512<6, NP>(a, K, panel, K, c, N, ncols, bias, pf); break;
    case 5: tile512<5, NP>(a, K, panel, K, c, N, ncols, bias, pf); break;
    case 4: tile512<4, NP>(a, K, panel, K, c, N, ncols, bias, pf); break;
    case 3: tile512<3, NP>(a, K, panel, K, c, N, ncols, bias, pf); break;
    case 2: tile512<2, NP>(a, K, panel, K, c, N, ncols, bias, pf); break;
    case 1: tile512<1, NP>(a, K, panel, K, c, N, ncols, bias, pf); break;
    default: break;
  }
}

// Panel pairs q0..q1 (pair q: panels 2q and 2q + 1, the last one alone when P is odd) of C = A B + bias.
LOOM_AVX512 void pairs512(const float* A, int64_t M, int64_t K, const float* B, int64_t P, int64_t N,
                          const float* bb, float* C, int64_t q0, int64_t q1) {
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t p = 2 * q;
    const int ncols = static_cast<int>(std::min<int64_t>(32, N - p * 16));
    const float* panel = B + p * K * 16;
    const float* bias_p = bb ? bb + p * 16 : nullptr;
    // Every row tile prefetches the pair PREFETCH_AHEAD panels on, where this task has it whole.
    const int64_t ahead = p + PREFETCH_AHEAD;
    const float* pf = ahead + 1 < std::min(P, 2 * q1) ? panel + PREFETCH_AHEAD * K * 16 : nullptr;
    if (p + 1 < P) rows512<2>(A, M, K, panel, C + p * 16, N, ncols, bias_p, pf);
    else rows512<1>(A, M, K, panel, C + p * 16, N, ncols, bias_p, nullptr);
  }
}

bool avx512_here() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// The vector width packed_linear uses: 512 where the CPU has AVX-512F, else 256 (the AVX2 tile).
std::atomic<int64_t>& product_width() {
  static std::atomic<int64_t> width{avx512_here() ? 512 : 256};
  return width;
}

// request 0: the width in use; 256: the AVX2 tile from now on; 512: the AVX-512 one where the CPU has it.
int64_t packed_linear_isa(int64_t request) {
  TORCH_CHECK(request == 0 || request == 256 || request == 512, "packed_linear_isa: request 0, 256 or 512");
  if (request != 0) product_width() = request == 512 && avx512_here() ? 512 : 256;
  return product_width();
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "packed_linear: fp32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.is_contiguous(),
              "packed_linear: packed weight must be a contiguous [panels, K, 16] tensor");
  const int64_t K = packed.size(1), P = packed.size(0), N = out_features;
  TORCH_CHECK(x.size(-1) == K, "packed_linear: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(P * 16 >= N && (P - 1) * 16 < N, "packed_linear: ", P, " panels cannot hold ", N, " outputs");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat, "packed_linear: bias must be fp32 [N]");
    b = bias->contiguous();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const float* A = xc.data_ptr<float>();
  const float* B = packed.data_ptr<float>();
  const float* bb = b.defined() ? b.data_ptr<float>() : nullptr;
  float* C = y.data_ptr<float>();
  if (M == 0) return y;
  if (product_width() == 512) {
    at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t q0, int64_t q1) { pairs512(A, M, K, B, P, N, bb, C, q0, q1); });
    return y;
  }
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int ncols = static_cast<int>(std::min<int64_t>(16, N - p * 16));
      const float* panel = B + p * K * 16;
      const float* bias_p = bb ? bb + p * 16 : nullptr;
      // Every row tile prefetches the panel PREFETCH_AHEAD panels on (measured on the bench model's 43
      // products in layer order, 16 rows: 6.3 ms against 6.9 ms for the next panel from the first tile only).
      const float* pf = p + PREFETCH_AHEAD < p1 ? panel + PREFETCH_AHEAD * K * 16 : nullptr;
      float* out = C + p * 16;
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) tile<6>(A + m * K, K, panel, K, out + m * N, N, ncols, bias_p, pf);
      switch (M - m) {
        case 5: tile<5>(A + m * K, K, panel, K, out + m * N, N, ncols, bias_p, pf); break;
        case 4: tile<4>(A + m * K, K, panel, K, out + m * N, N, ncols, bias_p, pf); break;
        case 3: tile<3>(A + m * K, K, panel, K, out + m * N, N, ncols, bias_p, pf); break;
        case 2: tile<2>(A + m * K, K, panel, K, out + m * N, N, ncols, bias_p, pf); break;
        case 1: tile<1>(A + m * K, K, panel, K, out + m * N, N, ncols, bias_p, pf); break;
        default: break;
      }
    }
  });
  return y;
}

inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

// Attention of a decode step: q [B, H, R, d] (R queries per key/value head: the query heads that share it,
// one token each), keys and values [B, H, L, d] (any strides but the last; a view of the slab), mask
// [B, 1, R, L] bool (True: may attend) -> [B, H, R, d] = softmax(q k^T / sqrt(d) masked) v, in fp32.
// One task per (row, head): each key and value row is read once for all R queries.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& mask) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "decode_attention: fp32 only");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes() && mask.dim() == 4,
              "decode_attention: q, keys, values, mask must be 4-D");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), L = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && keys.size(1) == H && keys.size(3) == D, "decode_attention: keys must be [B, H, L, d]");
  TORCH_CHECK(mask.size(0) == B && mask.size(1) == 1 && mask.size(2) == R && mask.size(3) == L,
              "decode_attention: mask must be [B, 1, R, L]");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "decode_attention: keys/values need a unit last stride");
  const at::Tensor qc = q.contiguous();
  const at::Tensor mc = mask.to(at::kBool).contiguous();
  at::Tensor out = at::empty_like(qc);
  const float* Q = qc.data_ptr<float>();
  const bool* M = mc.data_ptr<bool>();
  const float* K = keys.data_ptr<float>();
  const float* V = values.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(R * L);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H;
      const float* q = Q + t * R * D;
      const bool* m = M + b * R * L;
      const float* k = K + b * ks0 + h * ks1;
      const float* v = V + b * vs0 + h * vs1;
      float* o = O + t * R * D;
      for (int64_t j = 0; j < L; ++j)
        for (int64_t r = 0; r < R; ++r)
          p[r * L + j] = m[r * L + j] ? dot(q + r * D, k + j * ks2, D) * scale : -INFINITY;
      for (int64_t r = 0; r < R; ++r) {
        float* pr = p.data() + r * L;
        float top = -INFINITY;
        for (int64_t j = 0; j < L; ++j) top = std::max(top, pr[j]);
        float total = 0.f;
        for (int64_t j = 0; j < L; ++j) { pr[j] = top == -INFINITY ? 0.f : std::exp(pr[j] - top); total += pr[j]; }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t j = 0; j < L; ++j) pr[j] *= inv;
        std::fill(o + r * D, o + (r + 1) * D, 0.f);
      }
      for (int64_t j = 0; j < L; ++j) {
        const float* vj = v + j * vs2;
        for (int64_t r = 0; r < R; ++r) {
          const float w = p[r * L + j];
          if (w == 0.f) continue;
          float* orow = o + r * D;
          for (int64_t i = 0; i < D; ++i) orow[i] += w * vj[i];
        }
      }
    }
  });
  return out;
}

// Decode attention over paged keys and values: q [B, H, R, d] as above; the pool's keys and values [N, H, S, d]
// (contiguous; N blocks of S positions), table [B, W] (int64 block ids of each row), positions [B] (int64: row b
// sees its keys 0..positions[b]) -> [B, H, R, d]. Reads only those key and value rows, from the row's blocks.
at::Tensor decode_attention_paged(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  const at::Tensor& table, const at::Tensor& positions) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "decode_attention_paged: fp32 only");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes() && table.dim() == 2,
              "decode_attention_paged: q [B, H, R, d], keys/values [N, H, S, d], table [B, W]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "decode_attention_paged: the pool must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = keys.size(2), W = table.size(1);
  TORCH_CHECK(keys.size(1) == H && keys.size(3) == D && table.size(0) == B && positions.numel() == B,
              "decode_attention_paged: shapes disagree");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tc = table.to(at::kLong).contiguous();
  const at::Tensor pc = positions.to(at::kLong).contiguous();
  at::Tensor out = at::empty_like(qc);
  const float* Q = qc.data_ptr<float>();
  const int64_t* T = tc.data_ptr<int64_t>();
  const int64_t* P = pc.data_ptr<int64_t>();
  const float* K = keys.data_ptr<float>();
  const float* V = values.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H;
      const int64_t L = std::min(P[b] + 1, W * S);
      const float* q = Q + t * R * D;
      float* o = O + t * R * D;
      p.assign(R * std::max<int64_t>(L, 1), 0.f);
      for (int64_t j = 0; j < L; ++j) {
        const float* kj = K + ((T[b * W + j / S] * H + h) * S + j % S) * D;
        for (int64_t r = 0; r < R; ++r) p[r * L + j] = dot(q + r * D, kj, D) * scale;
      }
      for (int64_t r = 0; r < R; ++r) {
        float* pr = p.data() + r * L;
        float top = -INFINITY;
        for (int64_t j = 0; j < L; ++j) top = std::max(top, pr[j]);
        float total = 0.f;
        for (int64_t j = 0; j < L; ++j) { pr[j] = std::exp(pr[j] - top); total += pr[j]; }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t j = 0; j < L; ++j) pr[j] *= inv;
        std::fill(o + r * D, o + (r + 1) * D, 0.f);
      }
      for (int64_t j = 0; j < L; ++j) {
        const float* vj = V + ((T[b * W + j / S] * H + h) * S + j % S) * D;
        for (int64_t r = 0; r < R; ++r) {
          const float w = p[r * L + j];
          float* orow = o + r * D;
          for (int64_t i = 0; i < D; ++i) orow[i] += w * vj[i];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(loom_cpu, m) {
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor mask) -> Tensor");
  m.def("decode_attention_paged(Tensor q, Tensor keys, Tensor values, Tensor table, Tensor positions) -> Tensor");
  m.def("packed_linear_isa(int request) -> int", &packed_linear_isa);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(loom_cpu, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_paged", &decode_attention_paged);
}
