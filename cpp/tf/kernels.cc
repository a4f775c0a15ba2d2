// TensorFlow kernels: translate tensors into engine Requests and the engine's
// Status back into TensorFlow errors. All collective work is in cpp/core.
#include <memory>

#include "tensorflow/core/framework/op_kernel.h"
#include "../core/engine.h"

namespace tensorflow {
namespace {

tfmpi::DataType ToEngineType(DataType t) {
  switch (t) {
    case DT_UINT8: return tfmpi::DataType::kUInt8;
    case DT_INT8: return tfmpi::DataType::kInt8;
    case DT_INT32: return tfmpi::DataType::kInt32;
    case DT_INT64: return tfmpi::DataType::kInt64;
    case DT_HALF: return tfmpi::DataType::kFloat16;
    case DT_BFLOAT16: return tfmpi::DataType::kBFloat16;
    case DT_FLOAT: return tfmpi::DataType::kFloat32;
    case DT_DOUBLE: return tfmpi::DataType::kFloat64;
    case DT_BOOL: return tfmpi::DataType::kBool;
    default: return tfmpi::DataType::kNumTypes;  // rejected by the engine
  }
}

absl::Status ToTfStatus(const tfmpi::Status& s) {
  switch (s.code) {
    case tfmpi::StatusCode::kOk: return absl::OkStatus();
    case tfmpi::StatusCode::kInvalidArgument: return errors::InvalidArgument(s.message);
    case tfmpi::StatusCode::kPrecondition: return errors::FailedPrecondition(s.message);
    case tfmpi::StatusCode::kAborted: return errors::Aborted(s.message);
    default: return errors::Internal(s.message);
  }
}

// One kernel class for every collective: the op's attributes select the
// collective; inputs become the request's tensors.
class CollectiveOp : public AsyncOpKernel {
 public:
  CollectiveOp(OpKernelConstruction* c, tfmpi::CollectiveType type) : AsyncOpKernel(c), type_(type) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &tensor_name_));
    if (tensor_name_.empty()) tensor_name_ = name();
    if (type == tfmpi::CollectiveType::kAllreduce || type == tfmpi::CollectiveType::kReducescatter) {
      int op = 0;
      OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op));
      op_ = static_cast<tfmpi::ReduceOp>(op);
      OP_REQUIRES_OK(c, c->GetAttr("prescale_factor", &prescale_));
      OP_REQUIRES_OK(c, c->GetAttr("postscale_factor", &postscale_));
    }
    if (type == tfmpi::CollectiveType::kBroadcast) OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_));
  }

  // Submitting is cheap (the engine thread does the work), so TensorFlow may
  // run this kernel inline on the thread that made its input ready instead of
  // queueing it to the inter-op pool behind compute kernels: a gradient group
  // should reach the engine as soon as its gradients exist. (With one inter-op
  // thread the gradients themselves can still wait in that queue; see
  // docs/performance.md, "When does a gradient group reach the engine?".)
  bool IsExpensive() override { return false; }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    auto req = std::make_unique<tfmpi::Request>();
    req->meta.name = tensor_name_;
    req->meta.type = type_;
    req->meta.op = op_;
    req->meta.prescale = prescale_;
    req->meta.postscale = postscale_;
    req->meta.root = root_;
    auto& engine = tfmpi::Engine::Get();
    OP_REQUIRES_ASYNC(ctx, engine.initialized(),
                      errors::FailedPrecondition("tf_mpi has not been initialized; call tf_mpi.init() first"), done);
    const bool alltoall = type_ == tfmpi::CollectiveType::kAlltoall;
    const int num_tensors = alltoall ? 1 : ctx->num_inputs();
    for (int i = 0; i < num_tensors; ++i) {
      const Tensor& in = ctx->input(i);
      tfmpi::Shape shape;
      for (int d = 0; d < in.dims(); ++d) shape.push_back(in.dim_size(d));
      req->meta.tensors.push_back({ToEngineType(in.dtype()), shape});
      req->inputs.push_back(in.tensor_data().data());
      if (type_ == tfmpi::CollectiveType::kAllreduce) {
        // Reduce in place when TensorFlow can hand us the input buffer (a
        // temporary such as a gradient): saves allocating and touching a new one.
        Tensor* out = nullptr;
        OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({i}, i, in.shape(), &out), done);
        req->outputs.push_back(const_cast<char*>(out->tensor_data().data()));
      } else if (type_ == tfmpi::CollectiveType::kBroadcast) {
        Tensor* out = nullptr;
        OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(i, in.shape(), &out), done);
        req->outputs.push_back(const_cast<char*>(out->tensor_data().data()));
      } else if (type_ == tfmpi::CollectiveType::kReducescatter && in.dims() > 0) {
        // Rank r keeps rows [r * q + min(r, rem), ...): the first `rem` ranks get one more.
        const int n = engine.mpi().size(), r = engine.mpi().rank();
        TensorShape out_shape = in.shape();
        out_shape.set_dim(0, in.dim_size(0) / n + (r < in.dim_size(0) % n ? 1 : 0));
        Tensor* out = nullptr;
        OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(i, out_shape, &out), done);
        req->outputs.push_back(const_cast<char*>(out->tensor_data().data()));
      }
    }
    if (alltoall && ctx->input(0).dims() > 0) {
      const Tensor& splits = ctx->input(1);
      const int n = engine.mpi().size();
      const int64_t rows = ctx->input(0).dim_size(0);
      if (splits.NumElements() == 0) {
        OP_REQUIRES_ASYNC(ctx, rows % n == 0,
                          errors::InvalidArgument("tf_mpi: alltoall '", tensor_name_, "' without splits needs dim 0 (",
                                                  rows, ") divisible by the number of ranks (", n, ")"), done);
        req->meta.splits.assign(n, rows / n);
      } else {
        auto s = splits.flat<int64>();
        req->meta.splits.assign(s.data(), s.data() + s.size());
      }
    }
    // Runs on the engine thread once shapes are negotiated (allgather).
    req->allocate = [ctx](size_t i, const tfmpi::Shape& shape) -> void* {
      TensorShape ts;
      for (int64_t d : shape) ts.AddDim(d);
      Tensor* out = nullptr;
      absl::Status s = ctx->allocate_output(static_cast<int>(i), ts, &out);
      if (!s.ok()) {
        LOG(ERROR) << "tf_mpi: cannot allocate allgather output: " << s;
        tfmpi::Engine::Abort(1);  // other ranks are already in the collective
      }
      return const_cast<char*>(out->tensor_data().data());
    };
    req->done = [ctx, done](const tfmpi::Status& s) {
      ctx->SetStatus(ToTfStatus(s));
      done();
    };
    OP_REQUIRES_OK_ASYNC(ctx, ToTfStatus(tfmpi::Engine::Get().Enqueue(std::move(req))), done);
  }

 private:
  tfmpi::CollectiveType type_;
  std::string tensor_name_;
  tfmpi::ReduceOp op_ = tfmpi::ReduceOp::kSum;
  float prescale_ = 1.0f, postscale_ = 1.0f;
  int root_ = 0;
};

template <tfmpi::CollectiveType kType>
class TypedCollectiveOp : public CollectiveOp {
 public:
  explicit TypedCollectiveOp(OpKernelConstruction* c) : CollectiveOp(c, kType) {}
};

REGISTER_KERNEL_BUILDER(Name("TfMpiAllreduce").Device(DEVICE_CPU),
                        TypedCollectiveOp<tfmpi::CollectiveType::kAllreduce>);
REGISTER_KERNEL_BUILDER(Name("TfMpiGroupedAllreduce").Device(DEVICE_CPU),
                        TypedCollectiveOp<tfmpi::CollectiveType::kAllreduce>);
REGISTER_KERNEL_BUILDER(Name("TfMpiAllgather").Device(DEVICE_CPU),
                        TypedCollectiveOp<tfmpi::CollectiveType::kAllgather>);
REGISTER_KERNEL_BUILDER(Name("TfMpiBroadcast").Device(DEVICE_CPU),
                        TypedCollectiveOp<tfmpi::CollectiveType::kBroadcast>);
REGISTER_KERNEL_BUILDER(Name("TfMpiAlltoall").Device(DEVICE_CPU).HostMemory("splits"),
                        TypedCollectiveOp<tfmpi::CollectiveType::kAlltoall>);
REGISTER_KERNEL_BUILDER(Name("TfMpiReducescatter").Device(DEVICE_CPU),
                        TypedCollectiveOp<tfmpi::CollectiveType::kReducescatter>);

// Scalar runtime queries; fail clearly before init().
template <int (tfmpi::MpiContext::*Getter)() const>
class RuntimeOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    auto& engine = tfmpi::Engine::Get();
    OP_REQUIRES(ctx, engine.initialized(),
                errors::FailedPrecondition("tf_mpi has not been initialized; call tf_mpi.init() first"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int32>()() = (engine.mpi().*Getter)();
  }
};

REGISTER_KERNEL_BUILDER(Name("TfMpiRank").Device(DEVICE_CPU), RuntimeOp<&tfmpi::MpiContext::rank>);
REGISTER_KERNEL_BUILDER(Name("TfMpiSize").Device(DEVICE_CPU), RuntimeOp<&tfmpi::MpiContext::size>);
REGISTER_KERNEL_BUILDER(Name("TfMpiLocalRank").Device(DEVICE_CPU), RuntimeOp<&tfmpi::MpiContext::local_rank>);
REGISTER_KERNEL_BUILDER(Name("TfMpiLocalSize").Device(DEVICE_CPU), RuntimeOp<&tfmpi::MpiContext::local_size>);

}  // namespace
}  // namespace tensorflow
