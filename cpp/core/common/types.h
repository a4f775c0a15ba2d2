// Framework-independent vocabulary of the engine: data types, reduce ops,
// collective kinds and a small Status. Nothing here knows about TensorFlow.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tfmpi {

// Wire values are stable: they travel between ranks during negotiation.
enum class DataType : uint8_t {
  kUInt8 = 0, kInt8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64,
  kBool, kInt16, kUInt16, kNumTypes
};

enum class ReduceOp : uint8_t { kAverage = 0, kSum, kMin, kMax, kProduct, kAdasum };

enum class CollectiveType : uint8_t { kAllreduce = 0, kAllgather, kBroadcast, kAlltoall, kReducescatter, kJoin };

size_t DataTypeSize(DataType t);
const char* DataTypeName(DataType t);
const char* ReduceOpName(ReduceOp op);
const char* CollectiveName(CollectiveType t);

// Why a collective failed; the message is shown to the user verbatim.
// kUnavailable: a rank of the job was lost (elastic mode, transports/peer_failure.h).
enum class StatusCode : uint8_t { kOk = 0, kInvalidArgument, kPrecondition, kAborted, kInternal, kUnavailable };

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;
  bool ok() const { return code == StatusCode::kOk; }
  static Status OK() { return {}; }
  static Status Invalid(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status Precondition(std::string m) { return {StatusCode::kPrecondition, std::move(m)}; }
  static Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
};

using Shape = std::vector<int64_t>;
int64_t NumElements(const Shape& s);
std::string ShapeString(const Shape& s);

}  // namespace tfmpi
