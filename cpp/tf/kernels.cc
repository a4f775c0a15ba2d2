// TensorFlow kernels: translate tensors into engine Requests and the engine's
// Status back into TensorFlow errors. All collective work is in cpp/core.
//
// Every collective has a CPU and a GPU kernel, both this file's CollectiveOp.
// The GPU kernels touch CUDA only through the engine: from TensorFlow they take
// public virtual APIs (DeviceContext::stream, Stream::platform_specific_handle,
// AcceleratorDeviceInfo::gpu_id), so this file compiles against the headers of
// any TensorFlow wheel, tensorflow-cpu included, without a CUDA toolkit and
// without forward-declaring TensorFlow internals (Horovod's declaration of
// stream_executor::gpu::AsGpuStreamValue broke its build across versions).
#include <memory>

#include "tensorflow/core/framework/op_kernel.h"
#include "xla/stream_executor/stream.h"
#include "engine/engine.h"

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
    case DT_INT16: return tfmpi::DataType::kInt16;
    case DT_UINT16: return tfmpi::DataType::kUInt16;
    default: return tfmpi::DataType::kNumTypes;  // rejected by the engine
  }
}

absl::Status ToTfStatus(const tfmpi::Status& s) {
  switch (s.code) {
    case tfmpi::StatusCode::kOk: return absl::OkStatus();
    case tfmpi::StatusCode::kInvalidArgument: return errors::InvalidArgument(s.message);
    case tfmpi::StatusCode::kPrecondition: return errors::FailedPrecondition(s.message);
    case tfmpi::StatusCode::kAborted: return errors::Aborted(s.message);
    case tfmpi::StatusCode::kUnavailable: return errors::Unavailable(s.message);
    default: return errors::Internal(s.message);
  }
}

// Marks `req` as a GPU request on the device `ctx` runs on. The tensors are
// produced by kernels TensorFlow has queued on its compute stream, which may
// not have run yet. The engine gets that stream: it records an event on it at
// submission and its own stream waits for the event before reading the inputs.
// That orders the collective after its producers on the GPU without blocking
// anyone; synchronizing TensorFlow's stream from the host here would stall
// this executor thread and drain every kernel queued so far, serializing
// compute with communication.
absl::Status SetGpuPlacement(OpKernelContext* ctx, tfmpi::Request* req) {
  const DeviceBase::AcceleratorDeviceInfo* info = ctx->device()->tensorflow_accelerator_device_info();
  // gpu_id is the platform (CUDA) ordinal, not TensorFlow's /GPU:<n> index:
  // they differ under tf.config.set_visible_devices, Horovod's usual
  // one-GPU-per-rank setup, which leaves every rank's only GPU named /GPU:0.
  if (info == nullptr || info->gpu_id < 0) {
    return errors::Internal("tf_mpi: ", ctx->op_kernel().name(), " on ", ctx->device()->name(),
                            ": the device reports no CUDA ordinal");
  }
  DeviceContext* dc = ctx->op_device_context();
  stream_executor::Stream* stream = dc == nullptr ? nullptr : dc->stream();
  void* handle = stream == nullptr ? nullptr : stream->platform_specific_handle().stream;
  if (handle == nullptr) {
    return errors::Internal("tf_mpi: ", ctx->op_kernel().name(), " on ", ctx->device()->name(),
                            ": TensorFlow gave the kernel no CUDA stream to order the collective after its inputs");
  }
  req->meta.gpu = true;
  req->device = info->gpu_id;
  req->stream = handle;
  return absl::OkStatus();
}

// One kernel class for every collective: the op's attributes select the
// collective; inputs become the request's tensors. On a GPU device inputs and
// outputs are device memory (allocate_output allocates there), except the
// alltoall splits, which the registration keeps in host memory.
class CollectiveOp : public AsyncOpKernel {
 public:
  CollectiveOp(OpKernelConstruction* c, tfmpi::CollectiveType type)
      : AsyncOpKernel(c), type_(type), gpu_(c->device_type() == DeviceType(DEVICE_GPU)) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &tensor_name_));
    OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &process_set_));
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
    OP_REQUIRES_ASYNC(ctx, tfmpi::Engine::Get().initialized(),
                      errors::FailedPrecondition("tf_mpi has not been initialized; call tf_mpi.init() first"), done);
    bool registered = false;
    std::shared_ptr<tfmpi::Engine> set_engine = tfmpi::Engine::ForSet(process_set_, &registered);
    OP_REQUIRES_ASYNC(ctx, registered,
                      errors::InvalidArgument(tfmpi::CollectiveName(type_), ": Process set provided does not exist, ",
                                              "or has not been registered."), done);
    OP_REQUIRES_ASYNC(ctx, set_engine != nullptr,
                      errors::InvalidArgument(tfmpi::CollectiveName(type_), ": Rank ",
                                              tfmpi::Engine::Get().mpi().rank(),
                                              " is not a member of the provided process set."), done);
    auto& engine = *set_engine;
    const bool alltoall = type_ == tfmpi::CollectiveType::kAlltoall;
    const int num_tensors = alltoall ? 1 : ctx->num_inputs();
    if (gpu_) {
      // TensorFlow keeps int32 tensors of GPU kernels in host memory: such a
      // collective is a host request (every rank decides alike), and a group
      // cannot mix the two.
      int on_host = 0;
      for (int i = 0; i < num_tensors; ++i) on_host += ctx->input_memory_type(i) == HOST_MEMORY;
      OP_REQUIRES_ASYNC(ctx, on_host == 0 || on_host == num_tensors,
                        errors::InvalidArgument("tf_mpi: '", tensor_name_, "' mixes tensors TensorFlow keeps in host ",
                                                "memory on a GPU (int32) with device tensors; group them separately"),
                        done);
      if (on_host == 0) OP_REQUIRES_OK_ASYNC(ctx, SetGpuPlacement(ctx, req.get()), done);
    }
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
        if (engine.mpi().rank() == root_) {
          // The root's result is its input: the output shares the input's
          // buffer (tensors are immutable; MPI only reads it on the root),
          // which saves a copy of the whole tensor.
          ctx->set_output(i, in);
          req->outputs.push_back(const_cast<char*>(in.tensor_data().data()));
        } else {
          Tensor* out = nullptr;
          OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({i}, i, in.shape(), &out), done);
          req->outputs.push_back(const_cast<char*>(out->tensor_data().data()));
        }
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
    // Runs on the engine thread once shapes are negotiated (allgather). On a
    // GPU the memory may have been freed by tensors whose last readers are
    // still queued on TensorFlow's stream after the submission event; the
    // engine must order its writes after that stream again, not after the
    // submission event alone.
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
    OP_REQUIRES_OK_ASYNC(ctx, ToTfStatus(engine.Enqueue(std::move(req))), done);
  }

 private:
  tfmpi::CollectiveType type_;
  bool gpu_;  // registered for DEVICE_GPU: tensors in device memory
  std::string tensor_name_;
  tfmpi::ReduceOp op_ = tfmpi::ReduceOp::kSum;
  float prescale_ = 1.0f, postscale_ = 1.0f;
  int root_ = 0;
  int process_set_ = 0;  // the engine to submit to (engine.h: process sets)
};

template <tfmpi::CollectiveType kType>
class TypedCollectiveOp : public CollectiveOp {
 public:
  explicit TypedCollectiveOp(OpKernelConstruction* c) : CollectiveOp(c, kType) {}
};

// The same class on both devices (the constructor reads which). No
// TypeConstraint: the ops' T attributes already list the supported types.
#define TFMPI_REGISTER_COLLECTIVE(op, type)                                                            \
  REGISTER_KERNEL_BUILDER(Name(op).Device(DEVICE_CPU), TypedCollectiveOp<tfmpi::CollectiveType::type>); \
  REGISTER_KERNEL_BUILDER(Name(op).Device(DEVICE_GPU), TypedCollectiveOp<tfmpi::CollectiveType::type>)

TFMPI_REGISTER_COLLECTIVE("TfMpiAllreduce", kAllreduce);
TFMPI_REGISTER_COLLECTIVE("TfMpiGroupedAllreduce", kAllreduce);
TFMPI_REGISTER_COLLECTIVE("TfMpiAllgather", kAllgather);
TFMPI_REGISTER_COLLECTIVE("TfMpiBroadcast", kBroadcast);
TFMPI_REGISTER_COLLECTIVE("TfMpiReducescatter", kReducescatter);
#undef TFMPI_REGISTER_COLLECTIVE

// Alltoall's splits are read, and its received_splits written, by the host
// (the engine negotiates them over MPI before any data moves).
REGISTER_KERNEL_BUILDER(Name("TfMpiAlltoall").Device(DEVICE_CPU).HostMemory("splits"),
                        TypedCollectiveOp<tfmpi::CollectiveType::kAlltoall>);
REGISTER_KERNEL_BUILDER(Name("TfMpiAlltoall").Device(DEVICE_GPU).HostMemory("splits").HostMemory("received_splits"),
                        TypedCollectiveOp<tfmpi::CollectiveType::kAlltoall>);

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
