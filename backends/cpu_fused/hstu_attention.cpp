// The fused CPU ops as a torch extension (backends/cpu_fused/__init__.py): tensors in and out, the
// work in kernels.h (shared with the XLA FFI front, xla_ffi.cpp), on torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <string>
#include <vector>

#define GRF_CHECK TORCH_CHECK

inline int64_t grf_num_threads() { return at::get_num_threads(); }

template <typename F>
void grf_parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}

#include "kernels.h"

using namespace grf;

namespace {

Plan read_plan(const torch::Tensor& chunk_rows, const torch::Tensor& pair_q, const torch::Tensor& pair_k,
               const torch::Tensor& pos, int64_t t_cap) {
  auto rows = chunk_rows.contiguous().to(torch::kInt64);
  auto pqs = pair_q.contiguous().to(torch::kInt64), pks = pair_k.contiguous().to(torch::kInt64);
  auto ps = pos.contiguous().to(torch::kInt64);
  return grf::read_plan<int64_t>(rows.data_ptr<int64_t>(), rows.size(0), rows.size(1), pqs.data_ptr<int64_t>(),
                                 pks.data_ptr<int64_t>(), pqs.size(0), ps.data_ptr<int64_t>(), t_cap);
}

template <typename T>
Inputs<T> inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& pos_w,
                 const torch::Tensor& ts_w, const torch::Tensor& bucket, int64_t norm_len) {
  Inputs<T> in;
  in.q = q.data_ptr<T>();
  in.k = k.data_ptr<T>();
  in.v = v.data_ptr<T>();
  in.sq = q.stride(0);
  in.sk = k.stride(0);
  in.sv = v.stride(0);
  in.H = q.size(1);
  in.dqk = q.size(2);
  in.dv = v.size(2);
  if (pos_w.numel() > 0) {
    in.pos_w = pos_w.data_ptr<T>();
    in.pos_size = pos_w.numel();
  }
  if (ts_w.numel() > 0) {
    in.ts_w = ts_w.data_ptr<T>();
    in.ts_size = ts_w.numel();
    in.bucket = bucket.data_ptr<int32_t>();
  }
  in.norm_len = norm_len;
  return in;
}

void check(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), "cpu_fused attention: ", name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "cpu_fused attention: ", name, " must be [T, H, d] with rows of H*d contiguous values");
}

template <typename T>
std::vector<torch::Tensor> backward(const Plan& plan, const Inputs<T>& in, const torch::Tensor& g, torch::Tensor dq,
                                    torch::Tensor dk, torch::Tensor dv) {
  torch::Tensor dz = torch::empty({static_cast<int64_t>(plan.pq.size()), in.H, plan.C, plan.C}, g.options());
  torch::Tensor dpos = torch::empty({in.pos_size}, g.options()), dts = torch::empty({in.ts_size}, g.options());
  backward_impl<T>(plan, in, g.data_ptr<T>(), g.stride(0), dq.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>(),
                   dz.data_ptr<T>(), dpos.data_ptr<T>(), dts.data_ptr<T>());
  return {dq, dk, dv, dpos, dts};
}

torch::Tensor checked_ids(const torch::Tensor& ids, int64_t n_items) {
  auto id = ids.contiguous().to(torch::kInt64);
  if (id.numel() > 0) {
    const auto lo = id.min().item<int64_t>(), hi = id.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < n_items, "cpu_fused sampled logits: ids must be in [0, ", n_items, "), got [", lo,
                ", ", hi, "]");
  }
  return id;
}

}  // namespace

// q[T, H, dqk], k[T, H, dqk], v[T, H, dv] (rows of H*d contiguous values, any row stride);
// chunk_rows[nc+1, C], pair_q[P], pair_k[P] (a TilePlan), pos[T] int (position in the sequence);
// pos_w[2n-1] or empty, ts_w[K+1] or empty, bucket[P, C, C] int32 (time buckets of each pair's cells)
// -> out[T, H, dv] (zeros on rows outside every chunk).
torch::Tensor hstu_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor chunk_rows,
                           torch::Tensor pair_q, torch::Tensor pair_k, torch::Tensor pos, torch::Tensor pos_w,
                           torch::Tensor ts_w, torch::Tensor bucket, int64_t norm_len) {
  TORCH_CHECK(load_blas(), "cpu_fused attention: torch's BLAS is not bound (bind_blas)");
  const OneBlasThread one_blas_thread;
  check(q, "q");
  check(k, "k");
  check(v, "v");
  const int64_t T_ = q.size(0);
  const Plan plan = read_plan(chunk_rows, pair_q, pair_k, pos, T_);
  auto out = torch::zeros({T_, v.size(1), v.size(2)}, v.options());
  auto pw = pos_w.contiguous(), tw = ts_w.contiguous();
  auto bk = bucket.numel() ? bucket.contiguous().to(torch::kInt32) : bucket;
  if (q.scalar_type() == torch::kFloat) {
    forward_impl<float>(plan, inputs<float>(q, k, v, pw, tw, bk, norm_len), out.data_ptr<float>());
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kDouble, "cpu_fused attention: float32 or float64 only");
    forward_impl<double>(plan, inputs<double>(q, k, v, pw, tw, bk, norm_len), out.data_ptr<double>());
  }
  return out;
}

// Gradients of hstu_forward's out in q, k, v, pos_w, ts_w (empty when the table was): dout[T, H, dv].
std::vector<torch::Tensor> hstu_backward(torch::Tensor dout, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                         torch::Tensor chunk_rows, torch::Tensor pair_q, torch::Tensor pair_k,
                                         torch::Tensor pos, torch::Tensor pos_w, torch::Tensor ts_w,
                                         torch::Tensor bucket, int64_t norm_len) {
  TORCH_CHECK(load_blas(), "cpu_fused attention: torch's BLAS is not bound (bind_blas)");
  const OneBlasThread one_blas_thread;
  check(q, "q");
  check(k, "k");
  check(v, "v");
  auto g = dout.contiguous();
  const int64_t T_ = q.size(0);
  const Plan plan = read_plan(chunk_rows, pair_q, pair_k, pos, T_);
  // rows outside every chunk get no gradient: zero them once, the tasks write chunk rows only
  auto dq = torch::zeros({T_, q.size(1), q.size(2)}, q.options());
  auto dk = torch::zeros({T_, k.size(1), k.size(2)}, k.options());
  auto dv = torch::zeros({T_, v.size(1), v.size(2)}, v.options());
  auto pw = pos_w.contiguous(), tw = ts_w.contiguous();
  auto bk = bucket.numel() ? bucket.contiguous().to(torch::kInt32) : bucket;
  if (q.scalar_type() == torch::kFloat) {
    return backward<float>(plan, inputs<float>(q, k, v, pw, tw, bk, norm_len), g, dq, dk, dv);
  }
  TORCH_CHECK(q.scalar_type() == torch::kDouble, "cpu_fused attention: float32 or float64 only");
  return backward<double>(plan, inputs<double>(q, k, v, pw, tw, bk, norm_len), g, dq, dk, dv);
}


// user[T, D], items[N, D] (float32 or float64, one dtype), ids[T, R] integer -> out[T, R].
torch::Tensor sampled_forward(torch::Tensor user, torch::Tensor items, torch::Tensor ids) {
  auto u = user.contiguous(), it = items.contiguous();
  TORCH_CHECK(u.dim() == 2 && it.dim() == 2 && ids.dim() == 2 && u.size(1) == it.size(1) && ids.size(0) == u.size(0),
              "cpu_fused sampled logits: user[T, D], items[N, D], ids[T, R]");
  TORCH_CHECK(u.scalar_type() == it.scalar_type(), "cpu_fused sampled logits: user and items differ in dtype");
  auto id = checked_ids(ids, it.size(0));
  auto out = torch::empty({id.size(0), id.size(1)}, u.options());
  if (u.scalar_type() == torch::kFloat) {
    sampled_forward_impl<float, int64_t>(u.data_ptr<float>(), it.data_ptr<float>(), id.data_ptr<int64_t>(),
                                out.data_ptr<float>(), id.size(0), id.size(1), u.size(1));
  } else {
    TORCH_CHECK(u.scalar_type() == torch::kDouble, "cpu_fused sampled logits: float32 or float64 only");
    sampled_forward_impl<double, int64_t>(u.data_ptr<double>(), it.data_ptr<double>(), id.data_ptr<int64_t>(),
                                 out.data_ptr<double>(), id.size(0), id.size(1), u.size(1));
  }
  return out;
}

// Gradients of sampled_forward's out in user and items: grad[T, R] -> (d_user[T, D], d_items[N, D]).
std::vector<torch::Tensor> sampled_backward(torch::Tensor grad, torch::Tensor user, torch::Tensor items,
                                            torch::Tensor ids) {
  auto u = user.contiguous(), it = items.contiguous(), g = grad.contiguous().to(u.scalar_type());
  auto id = checked_ids(ids, it.size(0));
  auto du = torch::empty_like(u), di = torch::empty_like(it);
  if (u.scalar_type() == torch::kFloat) {
    sampled_backward_impl<float, int64_t>(g.data_ptr<float>(), u.data_ptr<float>(), it.data_ptr<float>(),
                                 id.data_ptr<int64_t>(), du.data_ptr<float>(), di.data_ptr<float>(), id.size(0),
                                 id.size(1), u.size(1), it.size(0));
  } else {
    TORCH_CHECK(u.scalar_type() == torch::kDouble, "cpu_fused sampled logits: float32 or float64 only");
    sampled_backward_impl<double, int64_t>(g.data_ptr<double>(), u.data_ptr<double>(), it.data_ptr<double>(),
                                  id.data_ptr<int64_t>(), du.data_ptr<double>(), di.data_ptr<double>(), id.size(0),
                                  id.size(1), u.size(1), it.size(0));
  }
  return {du, di};
}


// sampled16_forward_impl (kernels.h) on tensors: user[T, D], items[N, D], scale[T] float32, ids[T, R] integer.
torch::Tensor sampled16_forward(torch::Tensor user, torch::Tensor items, torch::Tensor ids, torch::Tensor scale,
                                bool half) {
  auto u = user.contiguous(), it = items.contiguous(), sc = scale.contiguous();
  TORCH_CHECK(u.dim() == 2 && it.dim() == 2 && ids.dim() == 2 && u.size(1) == it.size(1) && ids.size(0) == u.size(0) &&
                  sc.dim() == 1 && sc.size(0) == u.size(0),
              "cpu_fused 16-bit sampled logits: user[T, D], items[N, D], ids[T, R], scale[T]");
  TORCH_CHECK(u.scalar_type() == torch::kFloat && it.scalar_type() == torch::kFloat && sc.scalar_type() == torch::kFloat,
              "cpu_fused 16-bit sampled logits: float32 only");
  auto id = checked_ids(ids, it.size(0));
  auto out = torch::empty({id.size(0), id.size(1)}, u.options());
  sampled16_forward_impl<int64_t>(u.data_ptr<float>(), it.data_ptr<float>(), id.data_ptr<int64_t>(),
                                  sc.data_ptr<float>(), half, out.data_ptr<float>(), id.size(0), id.size(1), u.size(1));
  return out;
}

// sampled16_backward_impl on tensors: grad[T, R] -> (d_user[T, D], d_items[N, D]).
std::vector<torch::Tensor> sampled16_backward(torch::Tensor grad, torch::Tensor user, torch::Tensor items,
                                              torch::Tensor ids, torch::Tensor scale, bool half) {
  auto u = user.contiguous(), it = items.contiguous(), sc = scale.contiguous(), g = grad.contiguous().to(torch::kFloat);
  TORCH_CHECK(u.scalar_type() == torch::kFloat && it.scalar_type() == torch::kFloat && sc.scalar_type() == torch::kFloat,
              "cpu_fused 16-bit sampled logits: float32 only");
  auto id = checked_ids(ids, it.size(0));
  auto du = torch::zeros_like(u), di = torch::empty_like(it);
  sampled16_backward_impl<int64_t>(g.data_ptr<float>(), u.data_ptr<float>(), it.data_ptr<float>(),
                                   id.data_ptr<int64_t>(), sc.data_ptr<float>(), half, du.data_ptr<float>(),
                                   di.data_ptr<float>(), id.size(0), id.size(1), u.size(1), it.size(0));
  return {du, di};
}

// Backend.shared_logsumexp (module docstring of backends/cpu_fused): user[T, D], neg[R, D], ids[R],
// targets[T] integer, pos[T], bias[R] (one float dtype) -> lse[T].
torch::Tensor pool_lse_forward(torch::Tensor user, torch::Tensor neg, torch::Tensor ids, torch::Tensor targets,
                               torch::Tensor pos, torch::Tensor bias, double scale, double masked) {
  TORCH_CHECK(load_blas(), "cpu_fused shared logsumexp: torch's BLAS is not bound (bind_blas)");
  const OneBlasThread one_blas_thread;
  auto u = user.contiguous(), w = neg.contiguous(), p = pos.contiguous(), b = bias.contiguous();
  auto id = ids.contiguous().to(torch::kInt64), tg = targets.contiguous().to(torch::kInt64);
  TORCH_CHECK(u.dim() == 2 && w.dim() == 2 && u.size(1) == w.size(1) && id.numel() == w.size(0) &&
                  tg.numel() == u.size(0) && p.numel() == u.size(0) && b.numel() == w.size(0),
              "cpu_fused shared logsumexp: user[T, D], neg_items[R, D], neg_ids[R], targets[T], pos[T], neg_bias[R]");
  TORCH_CHECK(w.scalar_type() == u.scalar_type() && p.scalar_type() == u.scalar_type() &&
                  b.scalar_type() == u.scalar_type(),
              "cpu_fused shared logsumexp: user, neg_items, pos and neg_bias differ in dtype");
  auto lse = torch::empty({u.size(0)}, u.options());
  if (u.scalar_type() == torch::kFloat) {
    pool_lse_impl<float>(u.data_ptr<float>(), w.data_ptr<float>(), id.data_ptr<int64_t>(), tg.data_ptr<int64_t>(),
                         p.data_ptr<float>(), b.data_ptr<float>(), static_cast<float>(scale),
                         static_cast<float>(masked), u.size(0), w.size(0), u.size(1), lse.data_ptr<float>());
  } else {
    TORCH_CHECK(u.scalar_type() == torch::kDouble, "cpu_fused shared logsumexp: float32 or float64 only");
    pool_lse_impl<double>(u.data_ptr<double>(), w.data_ptr<double>(), id.data_ptr<int64_t>(), tg.data_ptr<int64_t>(),
                          p.data_ptr<double>(), b.data_ptr<double>(), scale, masked, u.size(0), w.size(0), u.size(1),
                          lse.data_ptr<double>());
  }
  return lse;
}

// Its gradients from grad[T] and the forward's lse[T]: (d_user[T, D], d_neg[R, D], d_pos[T], d_bias[R]).
std::vector<torch::Tensor> pool_lse_backward(torch::Tensor grad, torch::Tensor user, torch::Tensor neg,
                                             torch::Tensor ids, torch::Tensor targets, torch::Tensor pos,
                                             torch::Tensor bias, torch::Tensor lse, double scale, double masked) {
  TORCH_CHECK(load_blas(), "cpu_fused shared logsumexp: torch's BLAS is not bound (bind_blas)");
  const OneBlasThread one_blas_thread;
  auto u = user.contiguous(), w = neg.contiguous(), p = pos.contiguous(), b = bias.contiguous();
  auto l = lse.contiguous(), g = grad.contiguous().to(u.scalar_type());
  auto id = ids.contiguous().to(torch::kInt64), tg = targets.contiguous().to(torch::kInt64);
  auto du = torch::empty_like(u), dw = torch::empty_like(w), dp = torch::empty_like(p), db = torch::empty_like(b);
  if (u.scalar_type() == torch::kFloat) {
    pool_lse_backward_impl<float>(g.data_ptr<float>(), u.data_ptr<float>(), w.data_ptr<float>(),
                                  id.data_ptr<int64_t>(), tg.data_ptr<int64_t>(), p.data_ptr<float>(),
                                  b.data_ptr<float>(), l.data_ptr<float>(), static_cast<float>(scale),
                                  static_cast<float>(masked), u.size(0), w.size(0), u.size(1), du.data_ptr<float>(),
                                  dw.data_ptr<float>(), dp.data_ptr<float>(), db.data_ptr<float>());
  } else {
    TORCH_CHECK(u.scalar_type() == torch::kDouble, "cpu_fused shared logsumexp: float32 or float64 only");
    pool_lse_backward_impl<double>(g.data_ptr<double>(), u.data_ptr<double>(), w.data_ptr<double>(),
                                   id.data_ptr<int64_t>(), tg.data_ptr<int64_t>(), p.data_ptr<double>(),
                                   b.data_ptr<double>(), l.data_ptr<double>(), scale, masked, u.size(0), w.size(0),
                                   u.size(1), du.data_ptr<double>(), dw.data_ptr<double>(), dp.data_ptr<double>(),
                                   db.data_ptr<double>());
  }
  return {du, dw, dp, db};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released: no Python object is touched, and the prefetch / sparse workers
  // (gr_functional/data/prefetch.py) overlap the step only while it is free
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("forward", &hstu_forward, "fused HSTU tile attention, forward", nogil);
  m.def("backward", &hstu_backward, "fused HSTU tile attention, backward", nogil);
  m.def("sampled_forward", &sampled_forward, "sampled logits, forward", nogil);
  m.def("sampled_backward", &sampled_backward, "sampled logits, backward", nogil);
  m.def("sampled16_forward", &sampled16_forward, "sampled logits with 16-bit negatives, forward", nogil);
  m.def("sampled16_backward", &sampled16_backward, "sampled logits with 16-bit negatives, backward", nogil);
  m.def("pool_lse_forward", &pool_lse_forward, "shared-pool logsumexp, forward", nogil);
  m.def("pool_lse_backward", &pool_lse_backward, "shared-pool logsumexp, backward", nogil);
  m.def("blas_threads_pinned", [] { return mkl_local_ptr != nullptr; },
        "whether BLAS runs single-threaded inside the ops (MKL's per-thread setting was found)");
  m.def("bind_blas", [](const std::string& torch_library) { return bind_blas(torch_library); },
        "bind torch's sgemm_/dgemm_ from the given library; '' or why not");
}
