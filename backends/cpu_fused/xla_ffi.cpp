// The fused CPU ops as XLA FFI handlers, for JAX on the CPU (backends/cpu_fused/xla.py): the same
// kernels.h as the torch extension, so a JAX step and a torch step compute the same bits. Buffers
// arrive contiguous (XLA's default layout), index arrays as int32 (JAX without x64). The work is
// split over XLA's intra-op thread pool (the handler's ThreadPool), the calling thread taking parts
// too, so nothing waits on a pool thread that never comes; each part runs BLAS single-threaded.
// Errors (a malformed plan, ids out of range) come back as FFI errors, raised in Python by JAX.
#include "xla/ffi/api/ffi.h"

#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ffi = xla::ffi;

// everything but the handlers' C entry points stays inside the library
#pragma GCC visibility push(hidden)

template <typename... Parts>
[[noreturn]] void grf_fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}
#define GRF_CHECK(cond, ...)         \
  do {                               \
    if (!(cond)) grf_fail(__VA_ARGS__); \
  } while (0)

namespace grf_xla {
// The pool of the handler running on this thread (set for the handler's duration).
thread_local ffi::ThreadPool* pool = nullptr;
int64_t threads();
void run_parts(int64_t parts, const std::function<void(int64_t)>& part);
}  // namespace grf_xla

inline int64_t grf_num_threads() { return grf_xla::threads(); }

template <typename F>
void grf_parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin, g = std::max<int64_t>(1, grain);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(grf_num_threads(), (n + g - 1) / g));
  const int64_t step = (n + parts - 1) / parts;
  grf_xla::run_parts(parts, [&](int64_t i) {
    const int64_t lo = begin + i * step, hi = std::min(end, lo + step);
    if (lo < hi) f(lo, hi);
  });
}

#include "kernels.h"

namespace grf_xla {

int64_t threads() { return pool == nullptr ? 1 : std::max<int64_t>(1, pool->num_threads()); }

// Parts [0, parts) run by the caller and by up to parts - 1 pool tasks, each claiming the next
// unclaimed part; the caller returns once every part has finished. A pool task that starts after
// all parts were claimed touches only the shared state (kept alive by its own reference).
struct Parts {
  std::atomic<int64_t> next{0};
  int64_t total = 0, finished = 0;
  const std::function<void(int64_t)>* part = nullptr;
  bool failed = false;
  std::string error;
  std::mutex mutex;
  std::condition_variable all_done;

  void work() {
    for (int64_t i = next++; i < total; i = next++) {
      bool ok = true;
      std::string what;
      try {
        const grf::OneBlasThread one_blas_thread;
        (*part)(i);
      } catch (const std::exception& exc) {
        ok = false;
        what = exc.what();
      } catch (...) {
        ok = false;
        what = "cpu_fused ops: a task failed (a non-standard exception)";
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (!ok && !failed) {
        failed = true;
        error = what;
      }
      if (++finished == total) all_done.notify_all();
    }
  }
};

void run_parts(int64_t parts, const std::function<void(int64_t)>& part) {
  if (parts <= 1 || pool == nullptr) {
    const grf::OneBlasThread one_blas_thread;
    for (int64_t i = 0; i < parts; ++i) part(i);
    return;
  }
  auto state = std::make_shared<Parts>();
  state->total = parts;
  state->part = &part;
  try {  // a task that cannot be scheduled leaves its parts to the threads that run
    for (int64_t w = 1; w < parts; ++w) pool->Schedule([state] { state->work(); });
  } catch (...) {
  }
  state->work();  // never throws: every part's failure is recorded in state
  std::unique_lock<std::mutex> lock(state->mutex);
  state->all_done.wait(lock, [&] { return state->finished == state->total; });
  if (state->failed) throw std::runtime_error(state->error);
}

struct UsePool {
  explicit UsePool(ffi::ThreadPool* p) { pool = p; }
  ~UsePool() { pool = nullptr; }
};

bool is_float(const ffi::AnyBuffer& x, ffi::DataType* dtype) {
  *dtype = x.element_type();
  return *dtype == ffi::DataType::F32 || *dtype == ffi::DataType::F64;
}

template <typename T>
grf::Inputs<T> inputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                      const ffi::AnyBuffer& pos_w, const ffi::AnyBuffer& ts_w, const ffi::Buffer<ffi::S32>& bucket,
                      int64_t norm_len) {
  const auto qd = q.dimensions(), vd = v.dimensions();
  grf::Inputs<T> in;
  in.q = q.typed_data<T>();
  in.k = k.typed_data<T>();
  in.v = v.typed_data<T>();
  in.H = qd[1];
  in.dqk = qd[2];
  in.dv = vd[2];
  in.sq = in.H * in.dqk;
  in.sk = in.H * in.dqk;
  in.sv = in.H * in.dv;
  if (pos_w.element_count() > 0) {
    in.pos_w = pos_w.typed_data<T>();
    in.pos_size = pos_w.element_count();
  }
  if (ts_w.element_count() > 0) {
    in.ts_w = ts_w.typed_data<T>();
    in.ts_size = ts_w.element_count();
    in.bucket = bucket.typed_data();
  }
  in.norm_len = norm_len;
  return in;
}

grf::Plan plan_of(const ffi::Buffer<ffi::S32>& chunk_rows, const ffi::Buffer<ffi::S32>& pair_q,
                  const ffi::Buffer<ffi::S32>& pair_k, const ffi::Buffer<ffi::S32>& pos, int64_t t_cap) {
  const auto rd = chunk_rows.dimensions();
  GRF_CHECK(rd.size() == 2 && pair_q.element_count() == pair_k.element_count() &&
                static_cast<int64_t>(pos.element_count()) == t_cap,
            "cpu_fused attention: chunk_rows[nc, C], pair_q[P], pair_k[P], pos[T]");
  return grf::read_plan<int32_t>(chunk_rows.typed_data(), rd[0], rd[1], pair_q.typed_data(), pair_k.typed_data(),
                                 pair_q.element_count(), pos.typed_data(), t_cap);
}

void check_qkv(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  GRF_CHECK(qd.size() == 3 && kd.size() == 3 && vd.size() == 3 && kd[0] == qd[0] && kd[1] == qd[1] &&
                kd[2] == qd[2] && vd[0] == qd[0] && vd[1] == qd[1],
            "cpu_fused attention: q[T, H, dqk], k[T, H, dqk], v[T, H, dv]");
  GRF_CHECK(k.element_type() == q.element_type() && v.element_type() == q.element_type(),
            "cpu_fused attention: q, k and v differ in dtype");
}

// The smallest and largest of n int32 values (0, -1 when n = 0): one vectorised pass.
std::pair<int32_t, int32_t> min_max(const int32_t* x, int64_t n) {
  int32_t lo = n > 0 ? x[0] : 0, hi = n > 0 ? x[0] : -1;
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  return {lo, hi};
}

// What the kernels read besides q, k, v: the bias tables in q's dtype, and with a time table
// bucket[P, C, C] naming its entries (the kernels index ts_w and its gradient by them).
void check_bias(const ffi::AnyBuffer& q, const ffi::AnyBuffer& pos_w, const ffi::AnyBuffer& ts_w,
                const ffi::Buffer<ffi::S32>& bucket, const ffi::Buffer<ffi::S32>& chunk_rows,
                const ffi::Buffer<ffi::S32>& pair_q) {
  for (const ffi::AnyBuffer* table : {&pos_w, &ts_w})
    GRF_CHECK(table->element_count() == 0 || (table->dimensions().size() == 1 &&
                                              table->element_type() == q.element_type()),
              "cpu_fused attention: pos_w and ts_w are 1-d tables in q's dtype (or empty)");
  const int64_t ts_size = ts_w.element_count();
  if (ts_size == 0) return;
  const int64_t C = chunk_rows.dimensions()[1], P = pair_q.element_count();
  GRF_CHECK(static_cast<int64_t>(bucket.element_count()) == P * C * C, "cpu_fused attention: bucket must be [P, C, C] = [",
            P, ", ", C, ", ", C, "], got ", bucket.element_count(), " values");
  const auto [lo, hi] = min_max(bucket.typed_data(), bucket.element_count());
  GRF_CHECK(lo >= 0 && hi < ts_size, "cpu_fused attention: time buckets must be in [0, ", ts_size, "), got [", lo,
            ", ", hi, "]");
}

// The handlers' bodies run under one catch: a kernel's check becomes the call's error.
template <typename Body>
ffi::Error guarded(ffi::ThreadPool* thread_pool, Body body) {
  if (!grf::load_blas()) return ffi::Error::Internal("cpu_fused ops: torch's BLAS is not bound (grf_bind_blas)");
  try {
    const UsePool use(thread_pool);
    body();
  } catch (const std::exception& exc) {
    return ffi::Error::InvalidArgument(exc.what());
  }
  return ffi::Error::Success();
}

ffi::Error hstu_forward(ffi::ThreadPool thread_pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::S32> chunk_rows, ffi::Buffer<ffi::S32> pair_q, ffi::Buffer<ffi::S32> pair_k,
                        ffi::Buffer<ffi::S32> pos, ffi::AnyBuffer pos_w, ffi::AnyBuffer ts_w,
                        ffi::Buffer<ffi::S32> bucket, int64_t norm_len, ffi::Result<ffi::AnyBuffer> out) {
  return guarded(&thread_pool, [&] {
    check_qkv(q, k, v);
    check_bias(q, pos_w, ts_w, bucket, chunk_rows, pair_q);
    ffi::DataType dtype;
    GRF_CHECK(is_float(q, &dtype), "cpu_fused attention: float32 or float64 only");
    const int64_t t_cap = q.dimensions()[0];
    const grf::Plan plan = plan_of(chunk_rows, pair_q, pair_k, pos, t_cap);
    std::memset(out->untyped_data(), 0, out->size_bytes());
    if (dtype == ffi::DataType::F32) {
      grf::forward_impl<float>(plan, inputs<float>(q, k, v, pos_w, ts_w, bucket, norm_len), out->typed_data<float>());
    } else {
      grf::forward_impl<double>(plan, inputs<double>(q, k, v, pos_w, ts_w, bucket, norm_len),
                                out->typed_data<double>());
    }
  });
}

template <typename T>
void hstu_backward_typed(const grf::Plan& plan, const grf::Inputs<T>& in, const ffi::AnyBuffer& dout,
                         ffi::Result<ffi::AnyBuffer>& dq, ffi::Result<ffi::AnyBuffer>& dk,
                         ffi::Result<ffi::AnyBuffer>& dv, ffi::Result<ffi::AnyBuffer>& dpos,
                         ffi::Result<ffi::AnyBuffer>& dts) {
  std::unique_ptr<T[]> dz(new T[plan.pq.size() * in.H * plan.C * plan.C]);
  for (auto* r : {&dq, &dk, &dv}) std::memset((*r)->untyped_data(), 0, (*r)->size_bytes());
  grf::backward_impl<T>(plan, in, dout.typed_data<T>(), in.H * in.dv, dq->typed_data<T>(), dk->typed_data<T>(),
                        dv->typed_data<T>(), dz.get(), dpos->typed_data<T>(), dts->typed_data<T>());
}

ffi::Error hstu_backward(ffi::ThreadPool thread_pool, ffi::AnyBuffer dout, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::Buffer<ffi::S32> chunk_rows, ffi::Buffer<ffi::S32> pair_q,
                         ffi::Buffer<ffi::S32> pair_k, ffi::Buffer<ffi::S32> pos, ffi::AnyBuffer pos_w,
                         ffi::AnyBuffer ts_w, ffi::Buffer<ffi::S32> bucket, int64_t norm_len,
                         ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                         ffi::Result<ffi::AnyBuffer> dpos, ffi::Result<ffi::AnyBuffer> dts) {
  return guarded(&thread_pool, [&] {
    check_qkv(q, k, v);
    check_bias(q, pos_w, ts_w, bucket, chunk_rows, pair_q);
    ffi::DataType dtype;
    GRF_CHECK(is_float(q, &dtype) && dout.element_type() == dtype, "cpu_fused attention: float32 or float64 only");
    const auto gd = dout.dimensions(), qd = q.dimensions(), vd = v.dimensions();
    GRF_CHECK(gd.size() == 3 && gd[0] == qd[0] && gd[1] == vd[1] && gd[2] == vd[2],
              "cpu_fused attention: dout must be [T, H, dv] like the output");
    const int64_t t_cap = q.dimensions()[0];
    const grf::Plan plan = plan_of(chunk_rows, pair_q, pair_k, pos, t_cap);
    if (dtype == ffi::DataType::F32) {
      hstu_backward_typed<float>(plan, inputs<float>(q, k, v, pos_w, ts_w, bucket, norm_len), dout, dq, dk, dv,
                                 dpos, dts);
    } else {
      hstu_backward_typed<double>(plan, inputs<double>(q, k, v, pos_w, ts_w, bucket, norm_len), dout, dq, dk, dv,
                                  dpos, dts);
    }
  });
}

void check_sampled(const ffi::AnyBuffer& user, const ffi::AnyBuffer& items, const ffi::Buffer<ffi::S32>& ids,
                   ffi::DataType* dtype) {
  const auto ud = user.dimensions(), id = items.dimensions(), sd = ids.dimensions();
  GRF_CHECK(ud.size() == 2 && id.size() == 2 && sd.size() == 2 && ud[1] == id[1] && sd[0] == ud[0],
            "cpu_fused sampled logits: user[T, D], items[N, D], ids[T, R]");
  GRF_CHECK(is_float(user, dtype) && items.element_type() == *dtype,
            "cpu_fused sampled logits: user and items float32 or float64, one dtype");
  const int64_t n_items = id[0];
  const auto [lo, hi] = min_max(ids.typed_data(), ids.element_count());
  GRF_CHECK(lo >= 0 && hi < n_items, "cpu_fused sampled logits: ids must be in [0, ", n_items, "), got [", lo, ", ",
            hi, "]");
}

ffi::Error sampled_forward(ffi::ThreadPool thread_pool, ffi::AnyBuffer user, ffi::AnyBuffer items,
                           ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out) {
  return guarded(&thread_pool, [&] {
    ffi::DataType dtype;
    check_sampled(user, items, ids, &dtype);
    const auto sd = ids.dimensions();
    const int64_t D = user.dimensions()[1];
    if (dtype == ffi::DataType::F32) {
      grf::sampled_forward_impl<float, int32_t>(user.typed_data<float>(), items.typed_data<float>(),
                                                ids.typed_data(), out->typed_data<float>(), sd[0], sd[1], D);
    } else {
      grf::sampled_forward_impl<double, int32_t>(user.typed_data<double>(), items.typed_data<double>(),
                                                 ids.typed_data(), out->typed_data<double>(), sd[0], sd[1], D);
    }
  });
}

ffi::Error sampled_backward(ffi::ThreadPool thread_pool, ffi::AnyBuffer grad, ffi::AnyBuffer user,
                            ffi::AnyBuffer items, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> d_user,
                            ffi::Result<ffi::AnyBuffer> d_items) {
  return guarded(&thread_pool, [&] {
    ffi::DataType dtype;
    check_sampled(user, items, ids, &dtype);
    GRF_CHECK(grad.element_type() == dtype && grad.element_count() == ids.element_count(),
              "cpu_fused sampled logits: grad[T, R] like the logits");
    const auto sd = ids.dimensions();
    const int64_t D = user.dimensions()[1], N = items.dimensions()[0];
    if (dtype == ffi::DataType::F32) {
      grf::sampled_backward_impl<float, int32_t>(grad.typed_data<float>(), user.typed_data<float>(),
                                                 items.typed_data<float>(), ids.typed_data(),
                                                 d_user->typed_data<float>(), d_items->typed_data<float>(), sd[0],
                                                 sd[1], D, N);
    } else {
      grf::sampled_backward_impl<double, int32_t>(grad.typed_data<double>(), user.typed_data<double>(),
                                                  items.typed_data<double>(), ids.typed_data(),
                                                  d_user->typed_data<double>(), d_items->typed_data<double>(), sd[0],
                                                  sd[1], D, N);
    }
  });
}

void check_sampled16(const ffi::AnyBuffer& user, const ffi::AnyBuffer& items, const ffi::Buffer<ffi::S32>& ids,
                     const ffi::Buffer<ffi::F32>& scale) {
  ffi::DataType dtype;
  check_sampled(user, items, ids, &dtype);
  GRF_CHECK(dtype == ffi::DataType::F32, "cpu_fused 16-bit sampled logits: float32 only");
  GRF_CHECK(scale.dimensions().size() == 1 && scale.dimensions()[0] == user.dimensions()[0],
            "cpu_fused 16-bit sampled logits: user[T, D], items[N, D], ids[T, R], scale[T]");
}

ffi::Error sampled16_forward(ffi::ThreadPool thread_pool, ffi::AnyBuffer user, ffi::AnyBuffer items,
                             ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> scale, bool half,
                             ffi::Result<ffi::AnyBuffer> out) {
  return guarded(&thread_pool, [&] {
    check_sampled16(user, items, ids, scale);
    const auto sd = ids.dimensions();
    grf::sampled16_forward_impl<int32_t>(user.typed_data<float>(), items.typed_data<float>(), ids.typed_data(),
                                         scale.typed_data(), half, out->typed_data<float>(), sd[0], sd[1],
                                         user.dimensions()[1]);
  });
}

ffi::Error sampled16_backward(ffi::ThreadPool thread_pool, ffi::AnyBuffer grad, ffi::AnyBuffer user,
                              ffi::AnyBuffer items, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> scale, bool half,
                              ffi::Result<ffi::AnyBuffer> d_user, ffi::Result<ffi::AnyBuffer> d_items) {
  return guarded(&thread_pool, [&] {
    check_sampled16(user, items, ids, scale);
    GRF_CHECK(grad.element_type() == ffi::DataType::F32 && grad.element_count() == ids.element_count(),
              "cpu_fused 16-bit sampled logits: grad[T, R] float32, like the logits");
    const auto sd = ids.dimensions();
    std::memset(d_user->untyped_data(), 0, d_user->size_bytes());
    grf::sampled16_backward_impl<int32_t>(grad.typed_data<float>(), user.typed_data<float>(),
                                          items.typed_data<float>(), ids.typed_data(), scale.typed_data(), half,
                                          d_user->typed_data<float>(), d_items->typed_data<float>(), sd[0], sd[1],
                                          user.dimensions()[1], items.dimensions()[0]);
  });
}

}  // namespace grf_xla

namespace grf_xla {
// The handlers' argument lists after their first (dout / grad, in the backward handlers).
// Bindings cannot be copied or moved by their users: passed on by reference, returned as built.
template <typename Binding>
auto attention_args(Binding&& binding) {  // q, k, v, chunk_rows, pair_q, pair_k, pos, pos_w, ts_w, bucket; norm_len
  using I32 = ffi::Buffer<ffi::S32>;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<I32>()
      .template Arg<I32>()
      .template Arg<I32>()
      .template Arg<I32>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<I32>()
      .template Attr<int64_t>("norm_len");
}

template <typename Binding>
auto sampled_args(Binding&& binding) {  // user, items, ids
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>();
}

template <typename Binding>
auto sampled16_args(Binding&& binding) {  // user, items, ids, scale; half
  return sampled_args(std::move(binding)).template Arg<ffi::Buffer<ffi::F32>>().template Attr<bool>("half");
}

inline auto bind() { return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>(); }
}  // namespace grf_xla

#pragma GCC visibility pop

using grf_xla::bind;
using Out = ffi::AnyBuffer;

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrfHstuForward, grf_xla::hstu_forward, grf_xla::attention_args(bind()).Ret<Out>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GrfHstuBackward, grf_xla::hstu_backward,  // dq, dk, dv, dpos, dts
                              grf_xla::attention_args(bind().Arg<ffi::AnyBuffer>())
                                  .Ret<Out>().Ret<Out>().Ret<Out>().Ret<Out>().Ret<Out>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GrfSampledForward, grf_xla::sampled_forward, grf_xla::sampled_args(bind()).Ret<Out>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GrfSampledBackward, grf_xla::sampled_backward,  // d_user, d_items
                              grf_xla::sampled_args(bind().Arg<ffi::AnyBuffer>()).Ret<Out>().Ret<Out>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GrfSampled16Forward, grf_xla::sampled16_forward,
                              grf_xla::sampled16_args(bind()).Ret<Out>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GrfSampled16Backward, grf_xla::sampled16_backward,  // d_user, d_items
                              grf_xla::sampled16_args(bind().Arg<ffi::AnyBuffer>()).Ret<Out>().Ret<Out>());

// Binds torch's sgemm_/dgemm_ (libtorch_cpu, opened here if the process has not imported torch):
// "" or why not. The returned text lives until the next call.
extern "C" const char* GrfBindBlas(const char* torch_library) {
  static std::string reason;
  reason = grf::bind_blas(torch_library, /*load=*/true);
  return reason.c_str();
}
