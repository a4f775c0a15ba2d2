// What a caller asks the engine to do (Request) and what rank 0 decides
// (Response). RequestMeta is the part every rank must agree on.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/types.h"

namespace tfmpi {

struct TensorMeta {
  DataType dtype = DataType::kFloat32;
  Shape shape;
};

inline int64_t TensorBytes(const TensorMeta& t) {
  return NumElements(t.shape) * static_cast<int64_t>(DataTypeSize(t.dtype));
}

// The negotiated identity of a collective. A grouped collective is one
// RequestMeta with several tensors: it is negotiated and completed as a unit.
struct RequestMeta {
  std::string name;
  CollectiveType type = CollectiveType::kAllreduce;
  ReduceOp op = ReduceOp::kSum;
  double prescale = 1.0;
  double postscale = 1.0;
  int32_t root = 0;
  std::vector<TensorMeta> tensors;
  std::vector<int64_t> splits;  // alltoall: rows this rank sends to each rank
  // The tensors are in GPU memory. Negotiated (every rank must agree, as in
  // Horovod), so that every rank cuts the same fusion buckets; the GPU's
  // ordinal is per rank (Request::device).
  bool gpu = false;
};

using DoneCallback = std::function<void(const Status&)>;
// Allocates output `index` once its shape is known (allgather); returns its data.
using OutputAllocator = std::function<void*(size_t index, const Shape& shape)>;

// One caller's submission: metadata plus this rank's buffers.
struct Request {
  RequestMeta meta;
  std::vector<const void*> inputs;
  std::vector<void*> outputs;   // preallocated outputs (allreduce, broadcast)
  OutputAllocator allocate;     // outputs sized by negotiation (allgather)
  // -1 = host memory, else the CUDA device ordinal holding inputs and
  // outputs (then meta.gpu is true). The executor moves them through the GPU
  // transport (gpu_transport.h): device pointers to a CUDA-aware MPI, or
  // staged through pinned host memory.
  int device = -1;
  // GPU requests: the stream (cudaStream_t) whose queued work produces the
  // inputs and will consume the outputs, e.g. TensorFlow's compute stream or a
  // CUDA array's interface stream. The engine's own stream waits on an event
  // recorded on it at submission; nullptr: the inputs are ready now.
  void* stream = nullptr;
  // GPU requests: set by Engine::Enqueue from `stream` (cuda_device.h); the
  // event the engine's stream waits on before reading the inputs.
  void* ready_event = nullptr;
  DoneCallback done;
};

// Rank 0's verdict on one negotiated name, broadcast to all ranks in the
// order every rank executes them.
struct Response {
  enum class Kind : uint8_t { kExecute = 0, kError = 1 };
  Kind kind = Kind::kExecute;
  RequestMeta meta;                         // for kError only meta.name is set
  std::vector<std::vector<int64_t>> dim0;   // allgather: [tensor][rank] first dims
  std::vector<std::vector<int64_t>> splits; // alltoall: [sender][receiver] rows
  std::vector<int32_t> joined;              // ranks that called join(): they contribute zeros
  std::string error;
};

// The name under which every rank's join() is negotiated.
inline const char* kJoinName = "__tfmpi_join__";

// "" when `a` and `b` can take part in the same collective, else which field
// differs. Allgather tensors may differ in their first dimension.
std::string FirstDifference(const RequestMeta& a, const RequestMeta& b);

// Human-readable value of `field` (as named by FirstDifference) in `m`.
std::string FieldValue(const RequestMeta& m, const std::string& field);

// What one rank can check of its own request before negotiation (names,
// tensors, dtypes, ops, splits, root rank in a job of `world_size` ranks):
// an InvalidArgument error naming the collective, or OK.
Status ValidateRequest(const Request& r, int world_size);

}  // namespace tfmpi
