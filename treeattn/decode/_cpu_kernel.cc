// The "cpu" backend of treeattn.decode.flash_attention: fused attention with (out, lse) for
// XLA:CPU, called through the XLA FFI. treeattn compiles this file with the host's C++
// compiler on first use (see _native.py).
//
// For each batch row and kv head, the query rows of that head (group * q_seq of them) walk the
// keys in blocks of kBlock with an online softmax: the logits of a block (each key row read
// once, while it is in L1, for all query rows), then the rescaled accumulation of p * v (each
// value row read once). K and V are therefore streamed from memory exactly once, which is what
// decoding costs at best; XLA's dot kernels for the matrix-vector shapes of decoding ran at
// about half that speed on the CPU where this was measured (see docs/decode.md).
//
// Work items (batch row, kv head) are shared between the calling thread and XLA's intra-op
// thread pool through an atomic counter; the caller never waits for an item nobody started,
// so a saturated pool cannot deadlock it.

#include <array>
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 512;  // keys per block (measured: 32 -> 1.5x the read, 512 -> 1.2x)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {  // bfloat16
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // bfloat16, round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof x);
  if (std::isnan(x)) {
    *p = 0x7FC0;
    return;
  }
  bits += 0x7FFF + ((bits >> 16) & 1);
  *p = static_cast<uint16_t>(bits >> 16);
}

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t d) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * load(k + i);
  return acc;
}

template <typename T>
inline void axpy(float a, const T* __restrict x, float* __restrict y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * load(x + i);
}

struct Dims {
  int64_t batch, q_seq, heads, qk, kv_heads, kv_seq, dv;
  bool bhsd, causal, has_pos;
  float scale;
  // A sliding window: a query at position i sees keys at i - left .. i + right (-1: no bound).
  int64_t left, right;
  int64_t group() const { return heads / kv_heads; }
  // Element offsets of (batch b, kv head h, slot s) in K (width w = qk or dv).
  int64_t kv_offset(int64_t b, int64_t h, int64_t s, int64_t w) const {
    return bhsd ? ((b * kv_heads + h) * kv_seq + s) * w : ((b * kv_seq + s) * kv_heads + h) * w;
  }
};

// One (batch row, kv head): rows r = j * q_seq + t for head h * group + j, query t.
template <typename T>
void attend(const Dims& d, int64_t b, int64_t h, const T* q, const T* k, const T* v,
            const int32_t* q_offset, const int32_t* kv_length, const int32_t* kv_pos, T* out,
            float* lse) {
  const int64_t g = d.group(), rows = g * d.q_seq;
  std::vector<float> qr(rows * d.qk), acc(rows * d.dv, 0.0f), m(rows, kNegInf), l(rows, 0.0f);
  std::vector<float> s(kBlock * rows);
  std::vector<int64_t> qpos(rows);
  std::vector<char> nan_row(rows, 0);
  const int64_t offset = q_offset[b], length = kv_length[b];
  for (int64_t j = 0; j < g; ++j) {
    for (int64_t t = 0; t < d.q_seq; ++t) {
      const int64_t r = j * d.q_seq + t;
      const T* src = q + ((b * d.q_seq + t) * d.heads + h * g + j) * d.qk;
      for (int64_t i = 0; i < d.qk; ++i) qr[r * d.qk + i] = load(src + i) * d.scale;
      qpos[r] = offset + t;
    }
  }
  // Keys in position order: slots past the filled length (or the last query, or the right edge
  // of the last query's window) are not read, nor those before the first query's window.
  int64_t slots = d.kv_seq, first = 0;
  if (!d.has_pos) {
    int64_t limit = length;
    if (d.causal) limit = std::min(limit, offset + d.q_seq);
    if (d.right >= 0) limit = std::min(limit, offset + d.q_seq + d.right);
    slots = std::clamp<int64_t>(limit, 0, d.kv_seq);
    if (d.left >= 0) first = std::clamp<int64_t>(offset - d.left, 0, slots);
  }
  const int32_t* pos_b = d.has_pos ? kv_pos + b * d.kv_seq : nullptr;
  for (int64_t start = first; start < slots; start += kBlock) {
    const int64_t n = std::min(kBlock, slots - start);
    bool any = false;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = start + i, pos = pos_b ? pos_b[slot] : slot;
      float* si = s.data() + i * rows;
      if (pos >= length) {
        std::fill(si, si + rows, kNegInf);
        continue;
      }
      const T* kp = k + d.kv_offset(b, h, slot, d.qk);
      for (int64_t r = 0; r < rows; ++r) {
        const bool visible = (!d.causal || pos <= qpos[r]) &&
                             (d.left < 0 || qpos[r] - pos <= d.left) &&
                             (d.right < 0 || pos - qpos[r] <= d.right);
        si[r] = visible ? dot(qr.data() + r * d.qk, kp, d.qk) : kNegInf;
        any |= visible;
      }
    }
    if (!any) continue;
    for (int64_t r = 0; r < rows; ++r) {
      float block_max = kNegInf;
      for (int64_t i = 0; i < n; ++i) {
        const float x = s[i * rows + r];
        // std::max ignores a NaN second argument: a NaN logit (a NaN query or key the row
        // sees) is recorded, so the row reads NaN rather than "saw no key".
        if (std::isnan(x)) nan_row[r] = 1;
        block_max = std::max(block_max, x);
      }
      const float m_new = std::max(m[r], block_max);
      if (m_new == kNegInf) {  // nothing visible to this row yet
        for (int64_t i = 0; i < n; ++i) s[i * rows + r] = 0.0f;
        continue;
      }
      if (m_new != m[r]) {
        const float alpha = std::exp(m[r] - m_new);  // 0 when m[r] was -inf
        float* a = acc.data() + r * d.dv;
        for (int64_t i = 0; i < d.dv; ++i) a[i] *= alpha;
        l[r] *= alpha;
        m[r] = m_new;
      }
      float total = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        const float p = std::exp(s[i * rows + r] - m_new);
        s[i * rows + r] = p;
        total += p;
      }
      l[r] += total;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* pi = s.data() + i * rows;
      const T* vp = nullptr;
      for (int64_t r = 0; r < rows; ++r) {
        if (pi[r] == 0.0f) continue;  // masked (or underflowed) keys: skip the value row
        if (vp == nullptr) vp = v + d.kv_offset(b, h, start + i, d.dv);
        axpy(pi[r], vp, acc.data() + r * d.dv, d.dv);
      }
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    for (int64_t t = 0; t < d.q_seq; ++t) {
      const int64_t r = j * d.q_seq + t, head = h * g + j;
      const bool empty = !(l[r] > 0.0f);
      const float inv = empty ? 0.0f : 1.0f / l[r];
      T* dst = out + ((b * d.q_seq + t) * d.heads + head) * d.dv;
      bool bad = nan_row[r] != 0;
      for (int64_t i = 0; i < d.dv; ++i) bad |= !std::isfinite(acc[r * d.dv + i]);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int64_t i = 0; i < d.dv; ++i) store(dst + i, bad ? nan : acc[r * d.dv + i] * inv);
      float row_lse = empty ? kNegInf : m[r] + std::log(l[r]);
      lse[(b * d.heads + head) * d.q_seq + t] = bad ? nan : row_lse;
    }
  }
}

// Runs fn(i) for i in [0, n) on the caller and up to (threads - 1) pool tasks. Items are
// claimed under the mutex; the caller, once no item is left to claim, waits only for items
// already running. A helper that starts after that claims nothing and returns without
// touching `fn` (which lives on the caller's stack); `state` is shared, so it outlives them.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F fn) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    int64_t next = 0;  // the next item to claim
    std::mutex mu;
    std::condition_variable cv;
    int64_t running = 0;  // items started and not yet finished
  };
  auto state = std::make_shared<State>();
  auto run = [state, n, &fn] {
    while (true) {
      int64_t i;
      {
        std::lock_guard<std::mutex> lock(state->mu);
        i = state->next++;
        if (i >= n) return;
        ++state->running;
      }
      fn(i);
      bool last;
      {
        std::lock_guard<std::mutex> lock(state->mu);
        last = --state->running == 0;
      }
      if (last) state->cv.notify_all();
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([run] { run(); });
  run();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->running == 0; });
}

template <typename T>
void run_all(const Dims& d, ffi::ThreadPool& pool, const void* q, const void* k, const void* v,
             const int32_t* q_offset, const int32_t* kv_length, const int32_t* kv_pos, void* out,
             float* lse) {
  parallel_for(pool, d.batch * d.kv_heads, [&](int64_t item) {
    attend<T>(d, item / d.kv_heads, item % d.kv_heads, static_cast<const T*>(q),
              static_cast<const T*>(k), static_cast<const T*>(v), q_offset, kv_length, kv_pos,
              static_cast<T*>(out), lse);
  });
}

ffi::Error Decode(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_length,
                  ffi::Buffer<ffi::S32> kv_pos, ffi::Result<ffi::AnyBuffer> out,
                  ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, bool causal,
                  int64_t window_left, int64_t window_right, std::string_view layout,
                  bool has_pos) {
  if (layout != "bshd" && layout != "bhsd") {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: layout must be bshd or bhsd, got " +
                                       std::string(layout));
  }
  const bool bhsd = layout == "bhsd";
  const auto qd = q.dimensions();
  // K and V of one batch row may come without their unit batch axis (rank 3): then the
  // operand is the cache buffer itself, not a reshape of it, which lets XLA update the cache
  // in place right before this call (a reshaped operand makes it copy the whole cache).
  auto with_batch = [](auto dims) {
    std::array<int64_t, 4> out{1, 0, 0, 0};
    const size_t skip = dims.size() == 3 ? 1 : 0;
    for (size_t i = 0; i < dims.size() && i + skip < 4; ++i) out[i + skip] = dims[i];
    return out;
  };
  const auto kd = with_batch(k.dimensions()), vd = with_batch(v.dimensions());
  const bool rank3 = k.dimensions().size() == 3 && v.dimensions().size() == 3 && qd.size() == 4 &&
                     qd[0] == 1;
  if (qd.size() != 4 || !(rank3 || (k.dimensions().size() == 4 && v.dimensions().size() == 4))) {
    return ffi::Error::InvalidArgument(
        "treeattn_cpu_decode: q must have rank 4, k and v rank 4 (or rank 3 for batch 1)");
  }
  Dims d{qd[0], qd[1], qd[2], qd[3], bhsd ? kd[1] : kd[2], bhsd ? kd[2] : kd[1], vd[3],
         bhsd,  causal, has_pos, scale,  window_left, window_right};
  if (d.kv_heads <= 0 || d.heads % d.kv_heads != 0 || kd[3] != d.qk) {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: inconsistent q/k shapes");
  }
  if (q_offset.element_count() != d.batch || kv_length.element_count() != d.batch) {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: q_offset, kv_length must be [batch]");
  }
  if (has_pos && kv_pos.element_count() != d.batch * d.kv_seq) {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: kv_pos must be [batch, kv_seq]");
  }
  const auto dtype = q.element_type();
  if (k.element_type() != dtype || v.element_type() != dtype || out->element_type() != dtype) {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: q, k, v, out must share a dtype");
  }
  const int32_t* pos = has_pos ? kv_pos.typed_data() : nullptr;
  if (dtype == ffi::F32) {
    run_all<float>(d, pool, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                   q_offset.typed_data(), kv_length.typed_data(), pos, out->untyped_data(),
                   lse->typed_data());
  } else if (dtype == ffi::BF16) {
    run_all<uint16_t>(d, pool, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                      q_offset.typed_data(), kv_length.typed_data(), pos, out->untyped_data(),
                      lse->typed_data());
  } else {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: dtype must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreeattnCpuDecode, Decode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<std::string_view>("layout")
                                  .Attr<bool>("has_pos"));
