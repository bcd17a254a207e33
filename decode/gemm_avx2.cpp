// Small-M fp32 GEMM for decoding on x86 CPUs with AVX2 + FMA (decode/gemm.py builds it on first use).
//
// A decode pass multiplies 1-64 rows by each weight. BLAS sgemm packs the weight on every call and runs its
// micro-kernel for large M, so at 2-16 rows it reads the weight several times over (measured on a 2-core AMD EPYC,
// fp32, 1 thread, 30 weights of 3072 x 576: 8 rows cost 2.4x one row through F.linear, 1.8x here, and 20 ms
// against 37 ms in all; scripts/bench_gemm.py). Here the weight is packed once into
// column panels [N/16, K, 16]; each panel streams from memory once, in 256-row slices that stay in L1 while every
// group of up to 6 input rows (12 accumulators: 6 rows x 16 columns) reads them.
// Each output row sums over k in the same order whatever M is: a row's result does not depend on its neighbours.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// y[M, NB*16] (+)= x[M, k0:k1] @ panel rows k0:k1; W packed as [NB, K, 16] (N padded with zero columns).
template <int MR>
static inline void tile(const float* x, int64_t ldx, int64_t kn, const float* w, float* y, int64_t ldy, bool add) {
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = add ? _mm256_loadu_ps(y + r * ldy) : _mm256_setzero_ps();
    acc[r][1] = add ? _mm256_loadu_ps(y + r * ldy + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kn; ++k) {
    __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8);
    for (int r = 0; r < MR; ++r) {
      __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
  }
}

static void tile_rows(int64_t mr, const float* x, int64_t ldx, int64_t kn, const float* w, float* y, int64_t ldy, bool add) {
  switch (mr) {
    case 1: tile<1>(x, ldx, kn, w, y, ldy, add); break;
    case 2: tile<2>(x, ldx, kn, w, y, ldy, add); break;
    case 3: tile<3>(x, ldx, kn, w, y, ldy, add); break;
    case 4: tile<4>(x, ldx, kn, w, y, ldy, add); break;
    case 5: tile<5>(x, ldx, kn, w, y, ldy, add); break;
    default: tile<6>(x, ldx, kn, w, y, ldy, add); break;
  }
}

// w [N, K] -> panels [NB, K, 16], N padded to NB * 16 with zero columns.
torch::Tensor pack(torch::Tensor w) {
  int64_t N = w.size(0), K = w.size(1), NB = (N + 15) / 16;
  auto wp = torch::constant_pad_nd(w.contiguous(), {0, 0, 0, NB * 16 - N});  // [NB*16, K]
  return wp.view({NB, 16, K}).transpose(1, 2).contiguous();
}

// x [M, K] contiguous fp32, p from pack -> x @ w.T [M, N] (a narrowed view when N is not a multiple of 16).
torch::Tensor gemm(torch::Tensor x, torch::Tensor p, int64_t N) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == p.size(1), "gemm: x [M, K] fp32 contiguous");
  int64_t M = x.size(0), K = x.size(1), NB = p.size(0), ldy = NB * 16;
  const int64_t KB = 256;  // a 16 KB slice of a panel stays in L1 while every row group reads it
  auto y = torch::empty({M, ldy}, x.options());
  const float* xp = x.data_ptr<float>(); const float* pp = p.data_ptr<float>(); float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t k0 = 0; k0 < K; k0 += KB) {
        int64_t kn = std::min(KB, K - k0);
        for (int64_t m = 0; m < M; m += 6)
          tile_rows(std::min<int64_t>(6, M - m), xp + m * K + k0, K, kn, pp + (b * K + k0) * 16, yp + m * ldy + b * 16, ldy, k0 > 0);
      }
  });
  return ldy == N ? y : y.narrow(1, 0, N);
}

// The small ops around the products, one call each instead of five to twelve aten ops (each op costs a few
// microseconds of dispatch on a 576-wide row, about as much as its arithmetic).

// x [M, D] contiguous -> x * rsqrt(mean(x^2) + eps) * w, as HF's RMSNorm computes it in fp32.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  x = x.contiguous(); w = w.contiguous();
  int64_t M = x.size(0), D = x.size(1);
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * D;
    float ss = 0.f;
    for (int64_t d = 0; d < D; ++d) ss += r[d] * r[d];
    float inv = 1.f / std::sqrt(ss / D + (float)eps);
    for (int64_t d = 0; d < D; ++d) yp[m * D + d] = wp[d] * (r[d] * inv);
  }
  return y;
}

// gu [M, 2I] (gate | up) -> silu(gate) * up [M, I].
torch::Tensor silu_mul(torch::Tensor gu) {
  gu = gu.contiguous();
  int64_t M = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({M, I}, gu.options());
  const float* g = gu.data_ptr<float>(); float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) {
      float a = g[m * 2 * I + i];
      yp[m * I + i] = a / (1.f + std::exp(-a)) * g[m * 2 * I + I + i];
    }
  return y;
}

// In place on the first `heads` head slices of each row of qkv [M, N]: HF's rotary embedding,
// x * cos + rotate_half(x) * sin, with cos/sin [M, hd] (both halves equal, as HF builds them).
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t hd) {
  TORCH_CHECK(qkv.is_contiguous(), "rope_ works in place on a contiguous [M, N] tensor");
  cos = cos.contiguous(); sin = sin.contiguous();
  int64_t M = qkv.size(0), N = qkv.size(1), half = hd / 2;
  float* q = qkv.data_ptr<float>(); const float* c = cos.data_ptr<float>(); const float* s = sin.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < heads; ++h) {
      float* x = q + m * N + h * hd; const float* cm = c + m * hd; const float* sm = s + m * hd;
      for (int64_t i = 0; i < half; ++i) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cm[i] + (-x2) * sm[i];
        x[i + half] = x2 * cm[i + half] + x1 * sm[i + half];
      }
    }
}
