// What a caller asks the engine to do (Request) and what rank 0 decides
// (Response). RequestMeta is the part every rank must agree on.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "types.h"

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
  // -1 = host memory. A GPU path would set the device here and let the
  // executor either pass device pointers to a CUDA-aware MPI or stage them.
  int device = -1;
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

}  // namespace tfmpi
