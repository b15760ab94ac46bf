// The pointer-level core of the fused CPU ops: HSTU tile attention, sampled logits, 16-bit sampled
// logits, shared-pool logsumexp. Two front ends include it: hstu_attention.cpp (torch extension,
// tensors) and xla_ffi.cpp (XLA FFI handlers, JAX buffers); the results are the same bits in both.
//
// The including file defines, before the include:
//   GRF_CHECK(cond, message parts...)            throws with the parts concatenated;
//   int64_t grf_num_threads()                    threads the ops may split their work over;
//   void grf_parallel_for(begin, end, grain, f)  f(b, e) over a partition of [begin, end) (grain: a
//                                                hint, results never depend on the partition).
// HSTU attention over a TilePlan's chunk pairs:
//
// out_i = sum_{j <= i, same sequence} SiLU(q_i . k_j + rab[i, j]) / n * v_j, computed one (pair, head)
// tile at a time: the tile's two products run on BLAS (sgemm_/dgemm_ of torch's own MKL, looked up
// at load time), its bias, SiLU, mask and scale in one pass while the tile is in cache. Nothing of
// size [H, P, C, C] is kept for backward: backward recomputes each tile (flash-attention style);
// it holds one [P, H, C, C] buffer of score gradients while it runs (pass A writes, pass B reads).
//
// Work split, no locks and no atomics:
//   forward     one task per query chunk c (its pairs are contiguous: the plan sorts them by q chunk);
//   backward A  one task per key chunk kc: dV_kc, dK_kc, the bias gradient, and dZ tiles to a buffer;
//   backward B  one task per query chunk c: dQ_c from the dZ tiles.
// Tasks are taken from a shared counter (largest first); every output element is written by one
// task in a fixed order, so results do not depend on the thread count or the schedule.
#pragma once

#include <immintrin.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

// hidden: each front's shared library keeps its own copy (no symbol of one can interpose the
// other's when both are loaded into one process)
#pragma GCC visibility push(hidden)
namespace grf {

using gemm_f = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                        const int*, const float*, const int*, const float*, float*, const int*);
using gemm_d = void (*)(const char*, const char*, const int*, const int*, const int*, const double*,
                        const double*, const int*, const double*, const int*, const double*, double*, const int*);
gemm_f sgemm_ptr = nullptr;
gemm_d dgemm_ptr = nullptr;
// MKL's per-thread thread count (MKL_Set_Num_Threads_Local, exported by torch's library): the ops
// split their work themselves, so BLAS runs single-threaded in them, also where a parallel_for
// runs inline outside an OpenMP region (MKL would otherwise split a product as it sees fit).
using mkl_local_f = int (*)(int);
mkl_local_f mkl_local_ptr = nullptr;

struct OneBlasThread {
  int previous = 0;
  OneBlasThread() {
    if (mkl_local_ptr != nullptr) previous = mkl_local_ptr(1);
  }
  ~OneBlasThread() {
    if (mkl_local_ptr != nullptr) mkl_local_ptr(previous);
  }
};

bool load_blas() { return sgemm_ptr != nullptr && dgemm_ptr != nullptr; }

// Row-major C[M, N] = alpha op(A) op(B) + beta C, through column-major BLAS (C^T = op(B)^T op(A)^T).
template <typename T>
void mm(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta, T* C,
        int ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: BLAS refuses the zero leading dimensions that come with it
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  const char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
  if constexpr (std::is_same_v<T, float>) {
    sgemm_ptr(&b, &a, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
  } else {
    dgemm_ptr(&b, &a, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
  }
}

// Bind sgemm_/dgemm_ from torch's own library (its handle is searched first, so another BLAS
// loaded earlier into the process, e.g. an ILP64 one exporting the same names, is not picked up;
// RTLD_DEFAULT where that library is not found; load: open it if the process has not yet) and check
// them on a small product both ways.
// Returns "" or why not.
std::string bind_blas(const std::string& torch_library, bool load = false) {
  const int mode = RTLD_LAZY | (load ? RTLD_LOCAL : RTLD_NOLOAD);
  void* handle = torch_library.empty() ? nullptr : dlopen(torch_library.c_str(), mode);
  void* scope = handle != nullptr ? handle : RTLD_DEFAULT;
  sgemm_ptr = reinterpret_cast<gemm_f>(dlsym(scope, "sgemm_"));
  dgemm_ptr = reinterpret_cast<gemm_d>(dlsym(scope, "dgemm_"));
  // the C entry (int by value); the lower-case names are the Fortran one, which takes int*
  mkl_local_ptr = reinterpret_cast<mkl_local_f>(dlsym(scope, "MKL_Set_Num_Threads_Local"));
  if (!load_blas()) return "torch's BLAS symbols sgemm_/dgemm_ are not exported by this torch build";
  const float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {7, 8, 9, 10, 11, 12};  // [2, 3] x [3, 2]
  const double ad[6] = {1, 2, 3, 4, 5, 6}, bd[6] = {7, 8, 9, 10, 11, 12};
  float c[4] = {0, 0, 0, 0}, ct[4] = {0, 0, 0, 0};
  double cd[4] = {0, 0, 0, 0};
  mm<float>(false, false, 2, 2, 3, 1.f, a, 3, b, 2, 0.f, c, 2);
  mm<float>(false, true, 2, 2, 3, 1.f, a, 3, a, 3, 0.f, ct, 2);  // a a^T
  mm<double>(false, false, 2, 2, 3, 1., ad, 3, bd, 2, 0., cd, 2);
  const bool ok = c[0] == 58 && c[1] == 64 && c[2] == 139 && c[3] == 154 && ct[0] == 14 && ct[1] == 32 &&
                  ct[2] == 32 && ct[3] == 77 && cd[0] == 58 && cd[1] == 64 && cd[2] == 139 && cd[3] == 154;
  if (!ok) {
    sgemm_ptr = nullptr;
    dgemm_ptr = nullptr;
    return "the sgemm_/dgemm_ found give wrong products (an ILP64 or otherwise incompatible BLAS?)";
  }
  return "";
}

// exp for the tile loops: Cephes' expf polynomial with the exponent set by bit arithmetic, written
// so that the compiler vectorises it (std::exp stays scalar without -ffast-math; the clamps need
// -fno-trapping-math, else GCC counts them as control flow and keeps every exp loop scalar); 1-2 ulp.
inline float exp_fast(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
inline double exp_fast(double x) { return std::exp(x); }

template <typename T>
inline T sigmoid(T z) {
  return T(1) / (T(1) + exp_fast(-z));
}

// The chunk pairs of one batch, read from the plan's index arrays.
struct Plan {
  int64_t C = 0;                    // tile (chunk length)
  std::vector<int64_t> start, len;  // per chunk: first token row, real rows
  std::vector<int64_t> pos0;        // per chunk: position (in its sequence) of its first token
  std::vector<int64_t> pq, pk;      // per real pair: query chunk, key chunk; pair index = plan index
  std::vector<int64_t> pair_id;     // per real pair: its row in the plan's pair arrays (dZ buffer row)
  std::vector<int64_t> q_first;     // CSR of pairs by query chunk (pairs sorted by q chunk)
  std::vector<int64_t> k_first, k_pairs;  // CSR of pairs by key chunk
};

// chunk_rows[nc, C], pair_q[P], pair_k[P], pos[t_cap]: a TilePlan's index arrays (any integer type).
template <typename I>
Plan read_plan(const I* r, int64_t nc, int64_t C, const I* q, const I* k, int64_t P, const I* pp, int64_t t_cap) {
  Plan plan;
  plan.C = C;
  plan.start.assign(nc, t_cap);
  plan.len.assign(nc, 0);
  plan.pos0.assign(nc, 0);
  for (int64_t c = 0; c < nc; ++c) {
    int64_t n = 0;
    while (n < C && r[c * C + n] < t_cap) ++n;
    plan.len[c] = n;
    if (n > 0) {
      plan.start[c] = r[c * C];
      plan.pos0[c] = pp[r[c * C]];
      GRF_CHECK(r[c * C + n - 1] == r[c * C] + n - 1, "cpu_fused attention: chunk ", c,
                " is not a run of consecutive token rows");
    }
  }
  plan.q_first.assign(nc + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    GRF_CHECK(q[p] >= 0 && k[p] >= 0, "cpu_fused attention: pair ", p, " names a negative chunk");
    if (q[p] >= nc || k[p] >= nc || plan.len[q[p]] == 0 || plan.len[k[p]] == 0) continue;  // padding pairs
    GRF_CHECK(plan.pq.empty() || q[p] >= plan.pq.back(), "cpu_fused attention: pairs not sorted by query chunk");
    plan.pq.push_back(q[p]);
    plan.pk.push_back(k[p]);
    plan.pair_id.push_back(p);
    plan.q_first[q[p] + 1] += 1;
  }
  std::partial_sum(plan.q_first.begin(), plan.q_first.end(), plan.q_first.begin());
  plan.k_first.assign(nc + 1, 0);
  for (int64_t kc : plan.pk) plan.k_first[kc + 1] += 1;
  std::partial_sum(plan.k_first.begin(), plan.k_first.end(), plan.k_first.begin());
  plan.k_pairs.resize(plan.pk.size());
  std::vector<int64_t> fill(plan.k_first.begin(), plan.k_first.end() - 1);
  for (size_t i = 0; i < plan.pk.size(); ++i) plan.k_pairs[fill[plan.pk[i]]++] = static_cast<int64_t>(i);
  return plan;
}

// Runs task(t) for t in [0, n) on the front's threads (grf_parallel_for), costliest first (cost[t]).
template <typename F>
void run_tasks(const std::vector<int64_t>& cost, F task) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(grf_num_threads(), order.size()));
  grf_parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next++; i < static_cast<int64_t>(order.size()); i = next++) task(order[i]);
    }
  });
}

// The bias of tile (query chunk cq, key chunk ck) in rab[Mq, C]: pos_w[(n-1) + k_pos - q_pos] and
// ts_w[bucket], on allowed cells only (the rest are never read).
template <typename T>
void bias_tile(const Plan& plan, int64_t p, int64_t cq, int64_t ck, const T* pos_w, int64_t pos_size, const T* ts_w,
               const int32_t* bucket, int64_t norm_len, T* rab) {
  const int64_t C = plan.C, Mq = plan.len[cq], Mk = plan.len[ck];
  const bool diag = cq == ck;
  for (int64_t i = 0; i < Mq; ++i) {
    const int64_t jn = diag ? i + 1 : Mk;
    T* row = rab + i * C;
    for (int64_t j = 0; j < jn; ++j) row[j] = T(0);
    if (pos_w != nullptr) {
      const int64_t base = (norm_len - 1) + plan.pos0[ck] - plan.pos0[cq] - i;
      GRF_CHECK(base >= 0 && base + jn - 1 < pos_size, "cpu_fused attention: position gap outside pos_w "
                  "(norm_len smaller than the sequence?)");
      for (int64_t j = 0; j < jn; ++j) row[j] += pos_w[base + j];
    }
    if (ts_w != nullptr) {
      const int32_t* b = bucket + (plan.pair_id[p] * C + i) * C;
      for (int64_t j = 0; j < jn; ++j) row[j] += ts_w[b[j]];
    }
  }
}

template <typename T>
struct Inputs {
  const T *q, *k, *v;
  int64_t sq, sk, sv;  // row strides (elements) of q, k, v: H * d when contiguous
  int64_t H, dqk, dv;
  const T *pos_w = nullptr, *ts_w = nullptr;
  int64_t pos_size = 0, ts_size = 0;
  const int32_t* bucket = nullptr;
  int64_t norm_len;
};

// out[T, H, dv]: zeros on entry (rows outside every chunk stay zero).
template <typename T>
void forward_impl(const Plan& plan, const Inputs<T>& in, T* o) {
  const int64_t C = plan.C, H = in.H, dqk = in.dqk, dv = in.dv, nc = plan.len.size();
  const T inv_n = T(1) / T(in.norm_len);
  std::vector<int64_t> cost(nc);
  for (int64_t c = 0; c < nc; ++c) cost[c] = plan.q_first[c + 1] - plan.q_first[c];
  run_tasks(cost, [&](int64_t c) {
    const int64_t Mq = plan.len[c];
    if (Mq == 0) return;
    std::vector<T> rab(C * C), s(C * C);
    for (int64_t p = plan.q_first[c]; p < plan.q_first[c + 1]; ++p) {
      const int64_t kc = plan.pk[p], Mk = plan.len[kc];
      const bool diag = kc == c;
      bias_tile<T>(plan, p, c, kc, in.pos_w, in.pos_size, in.ts_w, in.bucket, in.norm_len, rab.data());
      for (int64_t h = 0; h < H; ++h) {
        const T* qc = in.q + plan.start[c] * in.sq + h * dqk;
        const T* kk = in.k + plan.start[kc] * in.sk + h * dqk;
        const T* vk = in.v + plan.start[kc] * in.sv + h * dv;
        mm<T>(false, true, Mq, Mk, dqk, T(1), qc, in.sq, kk, in.sk, T(0), s.data(), C);
        for (int64_t i = 0; i < Mq; ++i) {
          T* row = s.data() + i * C;
          const T* b = rab.data() + i * C;
          const int64_t jn = diag ? i + 1 : Mk;
#pragma omp simd
          for (int64_t j = 0; j < jn; ++j) {
            const T z = row[j] + b[j];
            row[j] = z * sigmoid(z) * inv_n;
          }
          for (int64_t j = jn; j < Mk; ++j) row[j] = T(0);
        }
        T* oc = o + plan.start[c] * (H * dv) + h * dv;
        mm<T>(false, false, Mq, dv, Mk, T(1), s.data(), C, vk, in.sv, p == plan.q_first[c] ? T(0) : T(1), oc, H * dv);
      }
    }
  });
}

// g[T, H, dv] (row stride sg) -> dq, dk, dv (zeros on entry: rows outside every chunk stay zero),
// dpos_out[pos_size], dts_out[ts_size]; dz_all: room for [plan.pq.size(), H, C, C] score gradients,
// written by pass A and read by pass B (the backward's one such buffer, alive during the call only).
template <typename T>
void backward_impl(const Plan& plan, const Inputs<T>& in, const T* g, int64_t sg, T* dqp, T* dkp, T* dvp, T* dz_all,
                   T* dpos_out, T* dts_out) {
  const int64_t C = plan.C, H = in.H, dqk = in.dqk, dv = in.dv, nc = plan.len.size();
  const T inv_n = T(1) / T(in.norm_len);
  // the bias gradient of each key chunk's task, summed over chunks in chunk order afterwards:
  // the result does not depend on which thread ran which task (runs are bitwise reproducible)
  std::vector<T> dpos(nc * in.pos_size, T(0)), dts(nc * in.ts_size, T(0));

  std::vector<int64_t> cost(nc);
  for (int64_t c = 0; c < nc; ++c) cost[c] = plan.k_first[c + 1] - plan.k_first[c];
  run_tasks(cost, [&](int64_t kc) {
    const int64_t Mk = plan.len[kc];
    if (Mk == 0) return;
    std::vector<T> rab(C * C), s(C * C), dp(C * C), drab(C * C);
    for (int64_t e = plan.k_first[kc]; e < plan.k_first[kc + 1]; ++e) {
      const int64_t p = plan.k_pairs[e], c = plan.pq[p], Mq = plan.len[c];
      const bool diag = kc == c;
      const bool first = e == plan.k_first[kc];
      bias_tile<T>(plan, p, c, kc, in.pos_w, in.pos_size, in.ts_w, in.bucket, in.norm_len, rab.data());
      std::fill(drab.begin(), drab.end(), T(0));
      for (int64_t h = 0; h < H; ++h) {
        const T* qc = in.q + plan.start[c] * in.sq + h * dqk;
        const T* kk = in.k + plan.start[kc] * in.sk + h * dqk;
        const T* vk = in.v + plan.start[kc] * in.sv + h * dv;
        const T* gc = g + plan.start[c] * sg + h * dv;
        T* dz = dz_all + (p * H + h) * C * C;
        mm<T>(false, true, Mq, Mk, dqk, T(1), qc, in.sq, kk, in.sk, T(0), s.data(), C);   // scores
        mm<T>(false, true, Mq, Mk, dv, T(1), gc, sg, vk, in.sv, T(0), dp.data(), C);     // dP = dO V^T
        for (int64_t i = 0; i < Mq; ++i) {
          T* srow = s.data() + i * C;
          T* dprow = dp.data() + i * C;
          T* dzrow = dz + i * C;
          T* drow = drab.data() + i * C;
          const T* b = rab.data() + i * C;
          const int64_t jn = diag ? i + 1 : Mk;
#pragma omp simd
          for (int64_t j = 0; j < jn; ++j) {
            const T z = srow[j] + b[j];
            const T sg_z = sigmoid(z);
            const T dzv = dprow[j] * inv_n * sg_z * (T(1) + z * (T(1) - sg_z));
            srow[j] = z * sg_z * inv_n;  // the probabilities, for dV
            dzrow[j] = dzv;
            drow[j] += dzv;
          }
          for (int64_t j = jn; j < Mk; ++j) {
            srow[j] = T(0);
            dzrow[j] = T(0);
          }
        }
        T* dvk = dvp + plan.start[kc] * (H * dv) + h * dv;
        T* dkk = dkp + plan.start[kc] * (H * dqk) + h * dqk;
        const T beta = first ? T(0) : T(1);
        mm<T>(true, false, Mk, dv, Mq, T(1), s.data(), C, gc, sg, beta, dvk, H * dv);    // dV += P^T dO
        mm<T>(true, false, Mk, dqk, Mq, T(1), dz, C, qc, in.sq, beta, dkk, H * dqk);     // dK += dZ^T Q
      }
      // bias gradient: the head-summed dZ, scattered to the tables' entries
      T* dpw = in.pos_size ? dpos.data() + kc * in.pos_size : nullptr;
      T* dtw = in.ts_size ? dts.data() + kc * in.ts_size : nullptr;
      for (int64_t i = 0; i < Mq; ++i) {
        const int64_t jn = diag ? i + 1 : Mk;
        const T* drow = drab.data() + i * C;
        if (dpw != nullptr) {
          const int64_t base = (in.norm_len - 1) + plan.pos0[kc] - plan.pos0[c] - i;
          for (int64_t j = 0; j < jn; ++j) dpw[base + j] += drow[j];
        }
        if (dtw != nullptr) {
          const int32_t* b = in.bucket + (plan.pair_id[p] * C + i) * C;
          for (int64_t j = 0; j < jn; ++j) dtw[b[j]] += drow[j];
        }
      }
    }
  });

  for (int64_t c = 0; c < nc; ++c) cost[c] = plan.q_first[c + 1] - plan.q_first[c];
  run_tasks(cost, [&](int64_t c) {
    const int64_t Mq = plan.len[c];
    if (Mq == 0) return;
    for (int64_t p = plan.q_first[c]; p < plan.q_first[c + 1]; ++p) {
      const int64_t kc = plan.pk[p], Mk = plan.len[kc];
      for (int64_t h = 0; h < H; ++h) {
        const T* kk = in.k + plan.start[kc] * in.sk + h * dqk;
        const T* dz = dz_all + (p * H + h) * C * C;
        T* dqc = dqp + plan.start[c] * (H * dqk) + h * dqk;
        mm<T>(false, false, Mq, dqk, Mk, T(1), dz, C, kk, in.sk, p == plan.q_first[c] ? T(0) : T(1), dqc, H * dqk);
      }
    }
  });

  std::fill(dpos_out, dpos_out + in.pos_size, T(0));
  std::fill(dts_out, dts_out + in.ts_size, T(0));
  for (int64_t c = 0; c < nc; ++c) {
    for (int64_t i = 0; i < in.pos_size; ++i) dpos_out[i] += dpos[c * in.pos_size + i];
    for (int64_t i = 0; i < in.ts_size; ++i) dts_out[i] += dts[c * in.ts_size + i];
  }
}


// ----------------------------------------------------------------------------- sampled logits
// out[t, r] = <user[t], items[ids[t, r]]> (Backend.sampled_logits): one dot per (position, id)
// read straight from the item rows. The chunked torch op computes a [chunk, N] score block or
// copies [chunk, R, D] rows per chunk; here nothing but the [T, R] output is written. Backward:
// d user[t] = sum_r g[t, r] items[ids[t, r]] (one task per position) and d items[i] = sum over
// the (t, r) with ids[t, r] = i of g[t, r] user[t], the entries grouped by id with a counting
// sort (stable in t * R + r) and one task per id: no scatter conflicts, no per-thread copies of
// the table, and a summation order that does not depend on the threads.

// One logit: user . row, the same vectorised sum for fp32 and 16-bit rows.
template <typename T>
inline T dot(const T* a, const T* b, int64_t D) {
  T acc = T(0);
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
  return acc;
}

template <typename T, typename I>
void sampled_forward_impl(const T* u, const T* items, const I* ids, T* out, int64_t n_pos, int64_t R,
                          int64_t D) {
  grf_parallel_for(0, n_pos, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < R; ++r) out[t * R + r] = dot(u + t * D, items + ids[t * R + r] * D, D);
  });
}

// d_items[i] = sum over the (t, r) with ids[t, r] = i of g[t, r] user[t], each id's terms added in
// (t, r) order. One task per range of ids (ranges cut from a histogram so each holds about E / threads
// entries, whatever the sampler's skew), each scanning all entries in order and taking its ids:
// no two tasks write one row, and a row's sum is the same whatever the thread count. The scan reads
// ids, g and user sequentially and writes rows of d_items; a counting sort by id that this replaced
// read g and user in id order instead, a cache miss per entry (4x the forward's time on ML-1M).
template <typename T, typename I>
void items_grad_by_id(const T* g, const T* u, const I* ids, T* di, int64_t n_pos, int64_t R, int64_t D,
                      int64_t N) {
  const int64_t E = n_pos * R;
  std::vector<int64_t> bounds{0};
  const int64_t tasks = std::min<int64_t>(grf_num_threads(), N);
  if (tasks > 1) {
    std::vector<int64_t> count(N, 0);
    for (int64_t e = 0; e < E; ++e) count[ids[e]] += 1;
    int64_t seen = 0;
    for (int64_t i = 0; i < N && static_cast<int64_t>(bounds.size()) < tasks; ++i) {
      seen += count[i];
      if (seen * tasks >= E * static_cast<int64_t>(bounds.size())) bounds.push_back(i + 1);
    }
  }
  if (bounds.back() != N) bounds.push_back(N);
  grf_parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = bounds[b], hi = bounds[b + 1];
      std::fill(di + lo * D, di + hi * D, T(0));
      for (int64_t t = 0; t < n_pos; ++t) {
        const T* ut = u + t * D;
        for (int64_t r = 0; r < R; ++r) {
          const int64_t i = ids[t * R + r];
          if (i < lo || i >= hi) continue;
          T* dii = di + i * D;
          const T gv = g[t * R + r];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dii[d] += gv * ut[d];
        }
      }
    }
  });
}

template <typename T, typename I>
void sampled_backward_impl(const T* g, const T* u, const T* items, const I* ids, T* du, T* di, int64_t n_pos,
                           int64_t R, int64_t D, int64_t N) {
  grf_parallel_for(0, n_pos, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* dut = du + t * D;
      std::fill(dut, dut + D, T(0));
      for (int64_t r = 0; r < R; ++r) {
        const T* row = items + ids[t * R + r] * D;
        const T gv = g[t * R + r];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dut[d] += gv * row[d];
      }
    }
  });
  items_grad_by_id(g, u, ids, di, n_pos, R, D, N);
}

// ----------------------------------------------------------------------------- 16-bit negatives
// out[D] = cast(cast(row / s, 16-bit), float) * s, rounded to nearest even (Backend.quantize_16bit):
// fp16 with F16C's conversions (IEEE, subnormals included), bf16 by keeping the upper 16 bits.
void round_row_16(const float* row, float s, bool half, int64_t D, float* out) {
  int64_t d = 0;
  if (half) {
    const __m256 vs = _mm256_set1_ps(s);
    for (; d + 8 <= D; d += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_div_ps(_mm256_loadu_ps(row + d), vs), _MM_FROUND_TO_NEAREST_INT);
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtph_ps(h), vs));
    }
    for (; d < D; ++d) out[d] = _cvtsh_ss(_cvtss_sh(row[d] / s, _MM_FROUND_TO_NEAREST_INT)) * s;
    return;
  }
  const __m256 vs = _mm256_set1_ps(s);
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), upper = _mm256_set1_epi32(0xFFFF0000);
  for (; d + 8 <= D; d += 8) {
    const __m256i bits = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(row + d), vs));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    const __m256i kept = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(bits, bias), odd), upper);
    _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_castsi256_ps(kept), vs));
  }
  for (; d < D; ++d) {
    uint32_t bits;
    const float x = row[d] / s;
    std::memcpy(&bits, &x, 4);
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;  // finite inputs: no NaN case
    float y;
    std::memcpy(&y, &bits, 4);
    out[d] = y * s;
  }
}

// One pass of the 16-bit logits over positions: for each (t, r) the rounded row (scale[t]) is
// handed to visit(t, r, rounded_row), fwd taking dots and bwd summing d_user.
template <typename I, typename Visit>
void for_rounded_rows(const float* items, const I* ids, const float* scale, bool half, int64_t n_pos,
                      int64_t R, int64_t D, Visit visit) {
  grf_parallel_for(0, n_pos, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(D);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < R; ++r) {
        round_row_16(items + ids[t * R + r] * D, scale[t], half, D, buf.data());
        visit(t, r, buf.data());
      }
  });
}

// The sampled logits with 16-bit negatives (Backend.sampled_logits_16bit): user[T, D], items[N, D],
// scale[T] float32, ids[T, R], half (fp16) or bf16 -> out[T, R]; the rows rounded in cache.
template <typename I>
void sampled16_forward_impl(const float* u, const float* items, const I* ids, const float* scale, bool half, float* out,
                            int64_t n_pos, int64_t R, int64_t D) {
  for_rounded_rows(items, ids, scale, half, n_pos, R, D,
                   [&](int64_t t, int64_t r, const float* row) { out[t * R + r] = dot(u + t * D, row, D); });
}

// Its gradients: d_user through the rounded rows, d_items straight through the rounding (the
// fp32 master rows learn): grad[T, R] -> du[T, D] (zeros on entry), di[N, D].
template <typename I>
void sampled16_backward_impl(const float* g, const float* u, const float* items, const I* ids, const float* scale,
                             bool half, float* du, float* di, int64_t n_pos, int64_t R, int64_t D, int64_t N) {
  for_rounded_rows(items, ids, scale, half, n_pos, R, D, [&](int64_t t, int64_t r, const float* row) {
    float* dut = du + t * D;
    const float gv = g[t * R + r];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dut[d] += gv * row[d];
  });
  items_grad_by_id<float, I>(g, u, ids, di, n_pos, R, D, N);
}

// ----------------------------------------------------------------------------- shared pool
// Backend.shared_logsumexp: lse[t] = logsumexp([pos[t], S[t, r] for r < R]) with
// S[t, r] = scale <user[t], neg[r]> - bias[r], or masked_logit where ids[r] = targets[t] or ids[r] = 0.
// Rows are processed in blocks of kPoolRows (the [rows, R] logits stay in cache, their product on
// BLAS); backward splits the rows into at most kPoolGroups ranges fixed by the shapes, each summing its d_neg /
// d_bias into its own buffer, the buffers then added in group order: the same bits for any thread count.
constexpr int64_t kPoolRows = 128;
constexpr int64_t kPoolGroups = 16;
constexpr int64_t kPoolMinGroups = 4;
constexpr int64_t kPoolPartsBytes = int64_t(64) << 20;

// The pool's masked cells: padding ids (every row) and, per row, the pool slots holding its target
// (accidental hits, rare): listed once per call so the per-row passes stay branch-free and vectorised.
struct PoolMask {
  std::vector<std::pair<int64_t, int64_t>> by_id;  // (id, slot), sorted
  std::vector<int64_t> padding;                    // slots with id 0
  PoolMask(const int64_t* ids, int64_t R) {
    for (int64_t r = 0; r < R; ++r) {
      by_id.emplace_back(ids[r], r);
      if (ids[r] == 0) padding.push_back(r);
    }
    std::sort(by_id.begin(), by_id.end());
  }
  template <typename T>
  void apply(int64_t target, T value, T* row) const {
    for (const int64_t r : padding) row[r] = value;
    auto it = std::lower_bound(by_id.begin(), by_id.end(), std::make_pair(target, int64_t(-1)));
    for (; it != by_id.end() && it->first == target; ++it) row[it->second] = value;
  }
};

inline float row_max(const float* x, int64_t n, float m) {
  int64_t r = 0;
  if (n >= 8) {
    __m256 v = _mm256_set1_ps(m);
    for (; r + 8 <= n; r += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + r));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (const float l : lanes) m = std::max(m, l);
  }
  for (; r < n; ++r) m = std::max(m, x[r]);
  return m;
}
inline double row_max(const double* x, int64_t n, double m) {
  for (int64_t r = 0; r < n; ++r) m = std::max(m, x[r]);
  return m;
}

template <typename T>
void pool_logits(const T* u, const T* w, const PoolMask& mask, const int64_t* tgt, const T* bias, T scale, T masked,
                 int64_t rows, int64_t R, int64_t D, T* S) {
  mm<T>(false, true, static_cast<int>(rows), static_cast<int>(R), static_cast<int>(D), scale, u, static_cast<int>(D),
        w, static_cast<int>(D), T(0), S, static_cast<int>(R));
  for (int64_t t = 0; t < rows; ++t) {
    T* st = S + t * R;
#pragma omp simd
    for (int64_t r = 0; r < R; ++r) st[r] -= bias[r];
    mask.apply(tgt[t], masked, st);
  }
}

template <typename T>
void pool_lse_impl(const T* u, const T* w, const int64_t* ids, const int64_t* tgt, const T* pos, const T* bias,
                   T scale, T masked, int64_t n_pos, int64_t R, int64_t D, T* lse) {
  const PoolMask mask(ids, R);
  const int64_t blocks = (n_pos + kPoolRows - 1) / kPoolRows;
  grf_parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> S(kPoolRows * R);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t t0 = b * kPoolRows, rows = std::min(kPoolRows, n_pos - t0);
      pool_logits(u + t0 * D, w, mask, tgt + t0, bias, scale, masked, rows, R, D, S.data());
      for (int64_t t = 0; t < rows; ++t) {
        const T* st = S.data() + t * R;
        const T m = row_max(st, R, pos[t0 + t]);
        T total = T(0);
#pragma omp simd reduction(+ : total)
        for (int64_t r = 0; r < R; ++r) total += exp_fast(st[r] - m);
        lse[t0 + t] = m + std::log(total + exp_fast(pos[t0 + t] - m));
      }
    }
  });
}

template <typename T>
void pool_lse_backward_impl(const T* g, const T* u, const T* w, const int64_t* ids, const int64_t* tgt, const T* pos,
                            const T* bias, const T* lse, T scale, T masked, int64_t n_pos, int64_t R, int64_t D,
                            T* du, T* dw, T* dpos, T* dbias) {
  const PoolMask mask(ids, R);
  // the transient partial sums are groups x R x D: fewer groups than kPoolGroups for short inputs
  // and for large pools (kPoolPartsBytes, down to kPoolMinGroups), a function of the shapes only,
  // never of the threads
  const int64_t by_bytes = kPoolPartsBytes / std::max<int64_t>(1, R * D * static_cast<int64_t>(sizeof(T)));
  const int64_t groups = std::max<int64_t>(1, std::min({kPoolGroups, (n_pos + kPoolRows - 1) / kPoolRows,
                                                        std::max(kPoolMinGroups, by_bytes)}));
  const int64_t per_group = (n_pos + groups - 1) / groups;
  std::vector<T> dw_parts(groups * R * D, T(0)), db_parts(groups * R, T(0));
  grf_parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> S(kPoolRows * R);
    for (int64_t grp = begin; grp < end; ++grp) {
      T* dwg = dw_parts.data() + grp * R * D;
      T* dbg = db_parts.data() + grp * R;
      const int64_t g_end = std::min(n_pos, (grp + 1) * per_group);
      for (int64_t t0 = grp * per_group; t0 < g_end; t0 += kPoolRows) {
        const int64_t rows = std::min(kPoolRows, g_end - t0);
        pool_logits(u + t0 * D, w, mask, tgt + t0, bias, scale, masked, rows, R, D, S.data());
        for (int64_t t = 0; t < rows; ++t) {  // S -> g p (0 on masked cells)
          T* st = S.data() + t * R;
          const T gt = g[t0 + t], l = lse[t0 + t];
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) st[r] = gt * exp_fast(st[r] - l);
          mask.apply(tgt[t0 + t], T(0), st);
          dpos[t0 + t] = gt * exp_fast(pos[t0 + t] - l);
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) dbg[r] -= st[r];
        }
        // d user = scale (g p) neg; d neg += scale (g p)^T user
        mm<T>(false, false, static_cast<int>(rows), static_cast<int>(D), static_cast<int>(R), scale, S.data(),
              static_cast<int>(R), w, static_cast<int>(D), T(0), du + t0 * D, static_cast<int>(D));
        mm<T>(true, false, static_cast<int>(R), static_cast<int>(D), static_cast<int>(rows), scale, S.data(),
              static_cast<int>(R), u + t0 * D, static_cast<int>(D), T(1), dwg, static_cast<int>(D));
      }
    }
  });
  std::fill(dw, dw + R * D, T(0));
  std::fill(dbias, dbias + R, T(0));
  for (int64_t grp = 0; grp < groups; ++grp) {
    const T* dwg = dw_parts.data() + grp * R * D;
    const T* dbg = db_parts.data() + grp * R;
    for (int64_t i = 0; i < R * D; ++i) dw[i] += dwg[i];
    for (int64_t r = 0; r < R; ++r) dbias[r] += dbg[r];
  }
}


}  // namespace grf
#pragma GCC visibility pop
