#include "common/request.h"

#include <sstream>

namespace tfmpi {

namespace {
Shape TrailingDims(const Shape& s) { return s.empty() ? s : Shape(s.begin() + 1, s.end()); }
}  // namespace

std::string FirstDifference(const RequestMeta& a, const RequestMeta& b) {
  if (a.type != b.type) return "collective";
  if (a.tensors.size() != b.tensors.size()) return "number of tensors";
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const std::string idx = a.tensors.size() > 1 ? "[" + std::to_string(i) + "]" : "";
    if (a.tensors[i].dtype != b.tensors[i].dtype) return "dtype" + idx;
    const Shape& sa = a.tensors[i].shape;
    const Shape& sb = b.tensors[i].shape;
    if (a.type == CollectiveType::kAllgather || a.type == CollectiveType::kAlltoall) {
      if (sa.size() != sb.size() || sa.empty() || TrailingDims(sa) != TrailingDims(sb))
        return "shape" + idx;
    } else if (sa != sb) {
      return "shape" + idx;
    }
  }
  if (a.type == CollectiveType::kAllreduce || a.type == CollectiveType::kReducescatter) {
    if (a.op != b.op) return "reduce op";
    if (a.prescale != b.prescale) return "prescale_factor";
    if (a.postscale != b.postscale) return "postscale_factor";
  }
  if (a.type == CollectiveType::kBroadcast && a.root != b.root) return "root rank";
  if (a.gpu != b.gpu) return "device";
  return "";
}

std::string FieldValue(const RequestMeta& m, const std::string& field) {
  std::ostringstream os;
  size_t idx = 0;
  auto bracket = field.find('[');
  if (bracket != std::string::npos) idx = std::stoul(field.substr(bracket + 1));
  const std::string base = field.substr(0, bracket);
  if (base == "collective") os << CollectiveName(m.type);
  else if (base == "number of tensors") os << m.tensors.size();
  else if (base == "dtype") os << DataTypeName(m.tensors.at(idx).dtype);
  else if (base == "shape") os << ShapeString(m.tensors.at(idx).shape);
  else if (base == "reduce op") os << ReduceOpName(m.op);
  else if (base == "prescale_factor") os << m.prescale;
  else if (base == "postscale_factor") os << m.postscale;
  else if (base == "root rank") os << m.root;
  else if (base == "device") os << (m.gpu ? "GPU" : "CPU");
  return os.str();
}

Status ValidateRequest(const Request& r, int world_size) {
  const RequestMeta& m = r.meta;
  const std::string what = std::string(CollectiveName(m.type)) + " '" + m.name + "'";
  if (m.name.empty()) return Status::Invalid("tf_mpi: every collective needs a name");
  if (m.type == CollectiveType::kJoin) {
    if (m.name != kJoinName || r.outputs.size() != 1) return Status::Invalid("tf_mpi: malformed join request");
    return Status::OK();
  }
  if (m.tensors.empty()) return Status::Invalid("tf_mpi: " + what + " has no tensors");
  if (r.inputs.size() != m.tensors.size())
    return Status::Invalid("tf_mpi: " + what + ": inputs do not match tensors");
  for (const TensorMeta& t : m.tensors) {
    if (t.dtype >= DataType::kNumTypes) return Status::Invalid("tf_mpi: " + what + ": unsupported dtype");
    const bool reduces = m.type == CollectiveType::kAllreduce || m.type == CollectiveType::kReducescatter;
    if (reduces && t.dtype == DataType::kBool)
      return Status::Invalid("tf_mpi: " + what + ": " + CollectiveName(m.type) + " does not support bool tensors");
    if (m.type != CollectiveType::kAllreduce && m.type != CollectiveType::kBroadcast && t.shape.empty())
      return Status::Invalid("tf_mpi: " + what + ": " + CollectiveName(m.type) +
                             " needs tensors with at least one dimension (got a scalar)");
  }
  if (m.gpu != (r.device >= 0)) return Status::Invalid("tf_mpi: " + what + ": meta.gpu and device disagree");
  const bool sized_later = m.type == CollectiveType::kAllgather || m.type == CollectiveType::kAlltoall;
  const bool reduces = m.type == CollectiveType::kAllreduce || m.type == CollectiveType::kReducescatter;
  if (reduces && static_cast<int>(m.op) > static_cast<int>(ReduceOp::kAdasum))
    return Status::Invalid("tf_mpi: " + what + ": unknown reduce op " + std::to_string(static_cast<int>(m.op)) +
                           " (Average=0, Sum=1, Min=2, Max=3, Product=4)");
  if (reduces && m.op == ReduceOp::kAdasum)
    return Status::Invalid("tf_mpi: Adasum is not implemented yet; use Average or Sum");
  if (!sized_later && r.outputs.size() != m.tensors.size())
    return Status::Invalid("tf_mpi: " + what + ": outputs do not match tensors");
  if (sized_later && !r.allocate)
    return Status::Invalid("tf_mpi: " + what + ": no output allocator");
  if (m.type == CollectiveType::kAlltoall) {
    if (m.tensors.size() != 1) return Status::Invalid("tf_mpi: " + what + ": alltoall takes one tensor");
    if (static_cast<int>(m.splits.size()) != world_size)
      return Status::Invalid("tf_mpi: " + what + ": splits has " + std::to_string(m.splits.size()) +
                             " entries but there are " + std::to_string(world_size) + " ranks");
    int64_t total = 0;
    for (int64_t s : m.splits) {
      if (s < 0) return Status::Invalid("tf_mpi: " + what + ": negative split");
      total += s;
    }
    if (total != m.tensors[0].shape[0])
      return Status::Invalid("tf_mpi: " + what + ": splits sum to " + std::to_string(total) +
                             " but the tensor's first dimension is " + std::to_string(m.tensors[0].shape[0]));
  }
  if (m.type == CollectiveType::kBroadcast && (m.root < 0 || m.root >= world_size))
    return Status::Invalid("tf_mpi: " + what + ": root rank " + std::to_string(m.root) + " is out of range for " +
                           std::to_string(world_size) + " ranks");
  return Status::OK();
}

}  // namespace tfmpi
