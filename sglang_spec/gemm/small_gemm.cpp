// out[M, N] = x[M, K] @ weight[N, K]^T (+ residual[M, N]) for the few rows of a decode step or a tree verify,
// float32, AVX-512, over a weight packed once into column panels (small_gemm.py: pack_weight).
//
// Why not MKL: at 4-32 rows MKL's sgemm (packed or not) reaches a fraction of this machine's throughput while the
// weights stream from memory; here each 32-column panel [K, 32] is read once from memory and reused from L1/L2
// by every row tile. The arithmetic and the memory stream overlap: while a thread computes on one panel, the
// next one is fetched into L2 (spread over the row tiles, so a 16-row product that passes over a panel twice
// keeps the memory busy in both passes), and the rows just ahead in the current panel into L1.
//
// Layout: panels [ceil(N / 32), K, 32], zero padded past N, float32 or bfloat16. A bfloat16 panel is widened to
// float32 in registers (a bfloat16 is a float32's upper half) and multiplied in float32: the product of the
// bfloat16-rounded weight, at half the memory stream (a drafter's weights, whose rounding moves only proposals).
// Rows are split into tiles of at most 12 (two accumulators per row: 24 of the 32 zmm registers); panels are
// shared among threads (at::parallel_for).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 32;       // output columns per panel: two zmm registers
constexpr int kMaxTileRows = 12;     // 2 * 12 accumulators + 2 weight registers <= 32 zmm
constexpr int64_t kPrefetchRows = 32;  // panel rows ahead into L1 (best of 8 / 16 / 32 on the 2-core machine)

// 16 weights of a panel row as float32: loaded, or (bfloat16) widened by a 16-bit shift
inline __m512 load16(const float* weights) { return _mm512_load_ps(weights); }
inline __m512 load16(const at::BFloat16* weights) {
  const __m256i half = _mm256_load_si256(reinterpret_cast<const __m256i*>(weights));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

template <typename Weight, int Rows>
void tile(const float* x, int64_t K, const Weight* panel, float* out, int64_t N, const float* residual,
          int64_t columns, const Weight* next_panel, int64_t part, int64_t parts) {
  __m512 low[Rows], high[Rows];
  for (int m = 0; m < Rows; ++m) {
    low[m] = _mm512_setzero_ps();
    high[m] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 weight_low = load16(panel + k * kPanel);
    const __m512 weight_high = load16(panel + k * kPanel + 16);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRows) * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRows) * kPanel + 16), _MM_HINT_T0);
    if (next_panel != nullptr) {  // tile `part` of `parts` fetches its share of the next panel's rows
      const int64_t ahead = (part * K + k) / parts;
      _mm_prefetch(reinterpret_cast<const char*>(next_panel + ahead * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next_panel + ahead * kPanel + 16), _MM_HINT_T1);
    }
#pragma GCC unroll 12
    for (int m = 0; m < Rows; ++m) {
      const __m512 value = _mm512_set1_ps(x[m * K + k]);
      low[m] = _mm512_fmadd_ps(value, weight_low, low[m]);
      high[m] = _mm512_fmadd_ps(value, weight_high, high[m]);
    }
  }
  const __mmask16 low_mask = columns >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << columns) - 1);
  const __mmask16 high_mask = columns >= 32 ? 0xFFFF
                              : columns <= 16 ? 0
                                              : static_cast<__mmask16>((1u << (columns - 16)) - 1);
  for (int m = 0; m < Rows; ++m) {
    __m512 result_low = low[m], result_high = high[m];
    if (residual != nullptr) {
      result_low = _mm512_add_ps(result_low, _mm512_maskz_loadu_ps(low_mask, residual + m * N));
      result_high = _mm512_add_ps(result_high, _mm512_maskz_loadu_ps(high_mask, residual + m * N + 16));
    }
    _mm512_mask_storeu_ps(out + m * N, low_mask, result_low);
    _mm512_mask_storeu_ps(out + m * N + 16, high_mask, result_high);
  }
}

template <typename Weight>
using TileFunction = void (*)(const float*, int64_t, const Weight*, float*, int64_t, const float*, int64_t,
                              const Weight*, int64_t, int64_t);
template <typename Weight>
constexpr TileFunction<Weight> kTiles[kMaxTileRows + 1] = {
    nullptr,           tile<Weight, 1>,  tile<Weight, 2>,  tile<Weight, 3>, tile<Weight, 4>,
    tile<Weight, 5>,   tile<Weight, 6>,  tile<Weight, 7>,  tile<Weight, 8>, tile<Weight, 9>,
    tile<Weight, 10>,  tile<Weight, 11>, tile<Weight, 12>};

template <typename Weight>
void run_panels(const float* x_data, const Weight* panel_data, float* out_data, const float* residual_data,
                int64_t M, int64_t K, int64_t N, int64_t blocks) {
  const int64_t tiles = (M + kMaxTileRows - 1) / kMaxTileRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const Weight* panel = panel_data + block * K * kPanel;
      const int64_t column = block * kPanel;
      const int64_t columns = std::min<int64_t>(kPanel, N - column);
      int64_t row = 0;
      for (int64_t t = 0; t < tiles; ++t) {  // tiles of near-equal size: 17 rows run as 9 + 8, not 12 + 5
        const int64_t rows = (M - row) / (tiles - t);
        kTiles<Weight>[rows](x_data + row * K, K, panel, out_data + row * N + column, N,
                             residual_data == nullptr ? nullptr : residual_data + row * N + column, columns,
                             block + 1 < end ? panel + K * kPanel : nullptr, t, tiles);
        row += rows;
      }
    }
  });
}

torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features,
                         const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "small_gemm: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  (panels.scalar_type() == torch::kFloat32 || panels.scalar_type() == torch::kBFloat16),
              "small_gemm: panels must come from pack_weight (contiguous float32 or bfloat16 [blocks, K, 32])");
  TORCH_CHECK(panels.size(1) == x.size(1), "small_gemm: x has ", x.size(1), " columns, the weight ", panels.size(1));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0, "small_gemm: panels must be 64-byte aligned");
  const int64_t blocks = panels.size(0);
  TORCH_CHECK(out_features > (blocks - 1) * kPanel && out_features <= blocks * kPanel,
              "small_gemm: out_features does not match the panels");
  const torch::Tensor input = x.contiguous();
  const int64_t M = input.size(0), K = input.size(1), N = out_features;
  torch::Tensor added;
  const float* residual_data = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == torch::IntArrayRef({M, N}) && residual->scalar_type() == torch::kFloat32,
                "small_gemm: residual must be float32 [rows, out_features]");
    added = residual->contiguous();
    residual_data = added.data_ptr<float>();
  }
  torch::Tensor out = torch::empty({M, N}, input.options());
  if (M == 0) return out;
  const float* x_data = input.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  if (panels.scalar_type() == torch::kBFloat16) {
    run_panels(x_data, panels.data_ptr<at::BFloat16>(), out_data, residual_data, M, K, N, blocks);
  } else {
    run_panels(x_data, panels.data_ptr<float>(), out_data, residual_data, M, K, N, blocks);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("small_gemm", &small_gemm, "x @ weight.T (+ residual) over a packed weight");
}
