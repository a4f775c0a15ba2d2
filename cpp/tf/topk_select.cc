// Top-k sparsification kernels for Compression.topk / Compression.gtopk
// (tf_mpi/policy/topk_compression.py): op definitions and CPU kernels, no
// collective work (that stays in cpp/core, reached through kernels.cc).
//
// Selection contract, the same for every op here: the k entries of largest
// magnitude; ties go to the lower index; NaN counts as larger than any other
// magnitude, infinity included (a rank holding a NaN or an infinity sends
// it, so the step's reduced gradient is non-finite on every rank and the
// compressor skips the step); -0 and +0 tie. The winners come out in
// ascending index order. The magnitude order is the unsigned order of the
// value's bits with the sign bit cleared, which is exactly that contract for
// IEEE half, bfloat16, float and double.
//
// The selection is O(n): a strided sample of the magnitudes estimates a
// threshold a little below the k-th largest, one pass collects the entries
// at or above it, nth_element on the candidates finds the exact k-th, and a
// pass over the candidates (in index order) keeps the winners. If the
// threshold let fewer than k entries through, the pass is repeated with a
// lower one, and at worst with every nonzero entry a candidate; when even
// those are fewer than k, the lowest-index zeros make up the rest.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

#define TFMPI_TOPK_TYPES "{half, bfloat16, float, double}"

namespace {

// Min(k, n) as the length of a selection from n entries, or unknown.
shape_inference::DimensionHandle SelectedDim(InferenceContext* c, ShapeHandle in, int64_t k) {
  const int64_t n = c->RankKnown(in) ? c->Value(c->NumElements(in)) : InferenceContext::kUnknownDim;
  if (n == InferenceContext::kUnknownDim) return c->UnknownDim();
  return c->MakeDim(std::min<int64_t>(k, n));
}

}  // namespace

REGISTER_OP("TfMpiTopkSelect")
    .Attr("T: " TFMPI_TOPK_TYPES)
    .Attr("k: int >= 1")
    .Input("x: T")
    .Output("indices: int32")
    .Output("values: T")
    .SetShapeFn([](InferenceContext* c) {
      int64_t k;
      TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
      auto d = SelectedDim(c, c->input(0), k);
      c->set_output(0, c->Vector(d));
      c->set_output(1, c->Vector(d));
      return absl::OkStatus();
    })
    .Doc("The k entries of largest magnitude of x (flattened), in ascending index order.");

REGISTER_OP("TfMpiTopkAccumulate")
    .Attr("T: " TFMPI_TOPK_TYPES)
    .Attr("k: int >= 1")
    .Input("gradient: T")
    .Input("residual: T")
    .Output("accumulated: T")
    .Output("indices: int32")
    .Output("values: T")
    .SetShapeFn([](InferenceContext* c) {
      int64_t k;
      TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
      ShapeHandle same;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &same));
      auto n = c->RankKnown(same) ? c->NumElements(same) : c->UnknownDim();
      c->set_output(0, c->Vector(n));
      auto d = SelectedDim(c, same, k);
      c->set_output(1, c->Vector(d));
      c->set_output(2, c->Vector(d));
      return absl::OkStatus();
    })
    .Doc("accumulated = flat(gradient + residual) and TfMpiTopkSelect of it, in one pass over the data.");

REGISTER_OP("TfMpiTopkMerge")
    .Attr("T: " TFMPI_TOPK_TYPES)
    .Attr("k: int >= 1")
    .Input("indices_a: int32")
    .Input("values_a: T")
    .Input("indices_b: int32")
    .Input("values_b: T")
    .Output("indices: int32")
    .Output("values: T")
    .SetShapeFn([](InferenceContext* c) {
      int64_t k;
      TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
      // The union has at least max(|a|, |b|) entries (each set's indices are distinct).
      auto a = c->Value(c->NumElements(c->input(0)));
      auto b = c->Value(c->NumElements(c->input(2)));
      bool known = a != InferenceContext::kUnknownDim && b != InferenceContext::kUnknownDim;
      auto d = known && k <= std::max(a, b) ? c->MakeDim(k) : c->UnknownDim();
      c->set_output(0, c->Vector(d));
      c->set_output(1, c->Vector(d));
      return absl::OkStatus();
    })
    .Doc("Sums two sparse sets (distinct indices each; an index in both adds its two values) and keeps "
         "the k entries of largest magnitude, in ascending index order.");

REGISTER_OP("TfMpiTopkResidual")
    .Attr("T: " TFMPI_TOPK_TYPES)
    .Input("accumulated: T")
    .Input("sent: int32")
    .Output("residual: T")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc("accumulated with the entries at `sent` and the non-finite entries set to zero.");

namespace {

template <typename T> struct MagnitudeKey;
template <> struct MagnitudeKey<Eigen::half> { using U = uint16_t; };
template <> struct MagnitudeKey<Eigen::bfloat16> { using U = uint16_t; };
template <> struct MagnitudeKey<float> { using U = uint32_t; };
template <> struct MagnitudeKey<double> { using U = uint64_t; };

template <typename T>
inline typename MagnitudeKey<T>::U KeyOf(T v) {
  using U = typename MagnitudeKey<T>::U;
  static_assert(sizeof(U) == sizeof(T), "key width");
  U bits;
  std::memcpy(&bits, &v, sizeof(U));
  return bits & static_cast<U>(~(U(1) << (8 * sizeof(U) - 1)));
}

template <typename T>
inline bool IsFinite(T v) { return Eigen::numext::isfinite(v); }

// Appends to cand the i in [begin, end) with KeyOf(x[i]) >= threshold, ascending:
// branch-free (every index is written, the count advances only for a hit).
template <typename T>
inline void Collect(const T* x, int64_t begin, int64_t end, typename MagnitudeKey<T>::U threshold,
                    std::vector<int32_t>* cand) {
  size_t count = cand->size();
  cand->resize(count + static_cast<size_t>(end - begin));
  int32_t* out = cand->data();
  for (int64_t i = begin; i < end; ++i) {
    out[count] = static_cast<int32_t>(i);
    count += KeyOf(x[i]) >= threshold;
  }
  cand->resize(count);
}

// Finds the k largest-magnitude entries of x[0, n) (k <= n) and appends their
// indices, ascending, to `out`. `fill(begin, end, threshold, cand)` must make
// x[begin, end) readable (the fused kernel computes it there) and append to
// cand the indices i in [begin, end) with KeyOf(x[i]) >= threshold, ascending;
// it is called for every block exactly once in the first pass, so it can
// produce x; later passes (a threshold that let too few through) only read x.
template <typename T, typename Fill>
void SelectLargest(const T* x, int64_t n, int64_t k, Fill fill, std::vector<int32_t>* out) {
  using U = typename MagnitudeKey<T>::U;
  std::vector<int32_t> cand;
  // A threshold from a sample, when the sample is worth it (k well below n).
  // The threshold is never below 1: entries of magnitude zero (key 0) all
  // tie, so the ones needed are the lowest-index ones, added at the end
  // without making every zero a candidate (a densified embedding gradient is
  // mostly zeros).
  constexpr int64_t kSample = 4096;
  U threshold = 1;
  int64_t sample_rank = 0;  // 0: no sample, every nonzero entry is a candidate
  std::vector<U> sample;
  if (n >= 8 * kSample && k * 4 <= n) {
    // The sample is read before x is produced: fill.Peek(i) gives one entry.
    sample.reserve(kSample);
    const int64_t stride = n / kSample;
    uint32_t h = 0x9e3779b9u;
    for (int64_t j = 0; j < kSample; ++j) {
      h = h * 1664525u + 1013904223u;  // an offset inside each stride, so no column pattern dominates
      int64_t i = j * stride + static_cast<int64_t>(h % static_cast<uint32_t>(stride));
      sample.push_back(KeyOf(fill.Peek(i)));
    }
    // Aim for about 1.3x k candidates plus four standard deviations of the sample count.
    double expect = static_cast<double>(kSample) * k / n;
    sample_rank = std::min<int64_t>(kSample, static_cast<int64_t>(1.3 * expect + 4.0 * std::sqrt(expect) + 2));
    std::nth_element(sample.begin(), sample.begin() + (sample_rank - 1), sample.end(), std::greater<U>());
    threshold = std::max<U>(1, sample[sample_rank - 1]);
    cand.reserve(static_cast<size_t>(std::min<int64_t>(n, 2 * k + 1024)));
  } else {
    cand.reserve(static_cast<size_t>(n));
  }
  constexpr int64_t kBlock = 4096;
  for (int64_t b = 0; b < n; b += kBlock) fill(b, std::min(n, b + kBlock), threshold, &cand);
  while (static_cast<int64_t>(cand.size()) < k && threshold > 1) {  // too few: lower the threshold
    cand.clear();
    sample_rank = std::min<int64_t>(kSample, sample_rank * 4);
    if (sample_rank >= kSample || sample.empty()) {
      threshold = 1;
    } else {
      std::nth_element(sample.begin(), sample.begin() + (sample_rank - 1), sample.end(), std::greater<U>());
      threshold = std::max<U>(1, sample[sample_rank - 1]);
    }
    Collect(x, 0, n, threshold, &cand);
  }
  if (static_cast<int64_t>(cand.size()) < k) {
    // Every nonzero entry is a winner; the rest are the lowest-index zeros.
    int64_t zeros = k - static_cast<int64_t>(cand.size());
    size_t j = 0;
    for (int64_t i = 0; i < n && (zeros > 0 || j < cand.size()); ++i) {
      if (j < cand.size() && cand[j] == i) {
        out->push_back(static_cast<int32_t>(i));
        ++j;
      } else if (zeros > 0 && KeyOf(x[i]) == 0) {
        out->push_back(static_cast<int32_t>(i));
        --zeros;
      }
    }
    return;
  }
  const int64_t c = static_cast<int64_t>(cand.size());
  if (c == k) {
    out->insert(out->end(), cand.begin(), cand.end());
    return;
  }
  // The exact k-th: larger key first, then lower index.
  struct Entry {
    U key;
    int32_t index;
  };
  std::vector<Entry> e(c);
  for (int64_t j = 0; j < c; ++j) e[j] = {KeyOf(x[cand[j]]), cand[j]};
  auto before = [](const Entry& a, const Entry& b) { return a.key > b.key || (a.key == b.key && a.index < b.index); };
  std::nth_element(e.begin(), e.begin() + (k - 1), e.end(), before);
  const Entry last = e[k - 1];
  for (int32_t i : cand) {
    U key = KeyOf(x[i]);
    if (key > last.key || (key == last.key && i <= last.index)) out->push_back(i);
  }
}

// x is already there: the fill only collects.
template <typename T>
struct ReadFill {
  const T* x;
  T Peek(int64_t i) const { return x[i]; }
  using U = typename MagnitudeKey<T>::U;
  void operator()(int64_t begin, int64_t end, U threshold, std::vector<int32_t>* cand) const {
    Collect(x, begin, end, threshold, cand);
  }
};

// acc = g + r, block by block, collecting as it goes.
template <typename T>
struct AccumulateFill {
  const T* g;
  const T* r;
  T* acc;
  T Peek(int64_t i) const { return static_cast<T>(g[i] + r[i]); }
  using U = typename MagnitudeKey<T>::U;
  void operator()(int64_t begin, int64_t end, U threshold, std::vector<int32_t>* cand) const {
    for (int64_t i = begin; i < end; ++i) acc[i] = static_cast<T>(g[i] + r[i]);
    Collect(acc, begin, end, threshold, cand);
  }
};

absl::Status CheckSize(int64_t n) {
  if (n >= (int64_t{1} << 31)) {
    return errors::InvalidArgument("tf_mpi: top-k selection indexes with int32; ", n, " entries are too many");
  }
  return absl::OkStatus();
}

template <typename T>
void Emit(OpKernelContext* ctx, int first_output, const T* x, const std::vector<int32_t>& winners) {
  const int64_t k = static_cast<int64_t>(winners.size());
  Tensor* idx = nullptr;
  Tensor* val = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(first_output, TensorShape({k}), &idx));
  OP_REQUIRES_OK(ctx, ctx->allocate_output(first_output + 1, TensorShape({k}), &val));
  auto iv = idx->flat<int32_t>();
  auto vv = val->flat<T>();
  for (int64_t j = 0; j < k; ++j) {
    iv(j) = winners[j];
    vv(j) = x[winners[j]];
  }
}

template <typename T>
void SelectAll(int64_t n, std::vector<int32_t>* out) {
  out->resize(n);
  for (int64_t i = 0; i < n; ++i) (*out)[i] = static_cast<int32_t>(i);
}

template <typename T>
class TopkSelectOp : public OpKernel {
 public:
  explicit TopkSelectOp(OpKernelConstruction* c) : OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("k", &k_)); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const int64_t n = x.NumElements();
    OP_REQUIRES_OK(ctx, CheckSize(n));
    const T* data = x.flat<T>().data();
    const int64_t k = std::min(k_, n);
    std::vector<int32_t> winners;
    if (k == n) {
      SelectAll<T>(n, &winners);
    } else {
      winners.reserve(k);
      SelectLargest<T>(data, n, k, ReadFill<T>{data}, &winners);
    }
    Emit<T>(ctx, 0, data, winners);
  }

 private:
  int64_t k_;
};

template <typename T>
class TopkAccumulateOp : public OpKernel {
 public:
  explicit TopkAccumulateOp(OpKernelConstruction* c) : OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("k", &k_)); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& r = ctx->input(1);
    OP_REQUIRES(ctx, g.shape() == r.shape(),
                errors::InvalidArgument("tf_mpi: gradient ", g.shape().DebugString(), " and residual ",
                                        r.shape().DebugString(), " differ in shape"));
    const int64_t n = g.NumElements();
    OP_REQUIRES_OK(ctx, CheckSize(n));
    Tensor* acc = nullptr;  // in the gradient's buffer when nothing else holds it
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, TensorShape({n}), &acc));
    AccumulateFill<T> fill{g.flat<T>().data(), r.flat<T>().data(), acc->flat<T>().data()};
    const int64_t k = std::min(k_, n);
    std::vector<int32_t> winners;
    if (k == n) {
      for (int64_t i = 0; i < n; ++i) fill.acc[i] = fill.Peek(i);
      SelectAll<T>(n, &winners);
    } else {
      winners.reserve(k);
      SelectLargest<T>(fill.acc, n, k, fill, &winners);
    }
    Emit<T>(ctx, 1, fill.acc, winners);
  }

 private:
  int64_t k_;
};

template <typename T>
class TopkMergeOp : public OpKernel {
 public:
  explicit TopkMergeOp(OpKernelConstruction* c) : OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("k", &k_)); }

  void Compute(OpKernelContext* ctx) override {
    std::vector<std::pair<int32_t, T>> a, b;
    OP_REQUIRES_OK(ctx, Sorted(ctx->input(0), ctx->input(1), &a));
    OP_REQUIRES_OK(ctx, Sorted(ctx->input(2), ctx->input(3), &b));
    // The union in ascending index order; a shared index sums its two values
    // (from zero, as a segment sum does: a + b == b + a, so both partners agree).
    std::vector<int32_t> idx;
    std::vector<T> sum;
    idx.reserve(a.size() + b.size());
    sum.reserve(a.size() + b.size());
    size_t i = 0, j = 0;
    while (i < a.size() || j < b.size()) {
      if (j == b.size() || (i < a.size() && a[i].first < b[j].first)) {
        idx.push_back(a[i].first);
        sum.push_back(static_cast<T>(T(0) + a[i++].second));
      } else if (i == a.size() || b[j].first < a[i].first) {
        idx.push_back(b[j].first);
        sum.push_back(static_cast<T>(T(0) + b[j++].second));
      } else {
        idx.push_back(a[i].first);
        sum.push_back(static_cast<T>(static_cast<T>(T(0) + a[i++].second) + b[j++].second));
      }
    }
    const int64_t n = static_cast<int64_t>(idx.size());
    const int64_t k = std::min(k_, n);
    std::vector<int32_t> pos;
    if (k == n) {
      SelectAll<T>(n, &pos);
    } else {
      pos.reserve(k);
      SelectLargest<T>(sum.data(), n, k, ReadFill<T>{sum.data()}, &pos);
    }
    Tensor* oi = nullptr;
    Tensor* ov = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &oi));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &ov));
    auto iv = oi->flat<int32_t>();
    auto vv = ov->flat<T>();
    for (int64_t p = 0; p < k; ++p) {
      iv(p) = idx[pos[p]];
      vv(p) = sum[pos[p]];
    }
  }

 private:
  // The pairs of one set by ascending index (the compressors' sets already are).
  static absl::Status Sorted(const Tensor& indices, const Tensor& values, std::vector<std::pair<int32_t, T>>* out) {
    if (indices.NumElements() != values.NumElements()) {
      return errors::InvalidArgument("tf_mpi: top-k merge got ", indices.NumElements(), " indices and ",
                                     values.NumElements(), " values");
    }
    auto iv = indices.flat<int32_t>();
    auto vv = values.flat<T>();
    const int64_t m = indices.NumElements();
    out->resize(m);
    bool ascending = true;
    for (int64_t p = 0; p < m; ++p) {
      (*out)[p] = {iv(p), vv(p)};
      if (p > 0 && iv(p) <= iv(p - 1)) ascending = false;
    }
    if (!ascending) {
      std::sort(out->begin(), out->end(), [](const auto& x, const auto& y) { return x.first < y.first; });
      for (int64_t p = 1; p < m; ++p) {
        if ((*out)[p].first == (*out)[p - 1].first) {
          return errors::InvalidArgument("tf_mpi: top-k merge got index ", (*out)[p].first, " twice in one set");
        }
      }
    }
    return absl::OkStatus();
  }

  int64_t k_;
};

template <typename T>
class TopkResidualOp : public OpKernel {
 public:
  explicit TopkResidualOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& acc = ctx->input(0);
    const Tensor& sent = ctx->input(1);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, acc.shape(), &out));
    const int64_t n = acc.NumElements();
    const T* x = acc.flat<T>().data();
    T* y = out->flat<T>().data();
    for (int64_t i = 0; i < n; ++i) y[i] = IsFinite(x[i]) ? x[i] : T(0);
    auto s = sent.flat<int32_t>();
    for (int64_t p = 0; p < sent.NumElements(); ++p) {
      const int32_t i = s(p);
      OP_REQUIRES(ctx, i >= 0 && i < n,
                  errors::InvalidArgument("tf_mpi: top-k residual: index ", i, " outside [0, ", n, ")"));
      y[i] = T(0);
    }
  }
};

#define TFMPI_REGISTER_TOPK(T)                                                                           \
  REGISTER_KERNEL_BUILDER(Name("TfMpiTopkSelect").Device(DEVICE_CPU).TypeConstraint<T>("T"), TopkSelectOp<T>); \
  REGISTER_KERNEL_BUILDER(Name("TfMpiTopkAccumulate").Device(DEVICE_CPU).TypeConstraint<T>("T"),         \
                          TopkAccumulateOp<T>);                                                         \
  REGISTER_KERNEL_BUILDER(Name("TfMpiTopkMerge").Device(DEVICE_CPU).TypeConstraint<T>("T"), TopkMergeOp<T>); \
  REGISTER_KERNEL_BUILDER(Name("TfMpiTopkResidual").Device(DEVICE_CPU).TypeConstraint<T>("T"), TopkResidualOp<T>)

TFMPI_REGISTER_TOPK(Eigen::half);
TFMPI_REGISTER_TOPK(Eigen::bfloat16);
TFMPI_REGISTER_TOPK(float);
TFMPI_REGISTER_TOPK(double);
#undef TFMPI_REGISTER_TOPK

}  // namespace
}  // namespace tensorflow
