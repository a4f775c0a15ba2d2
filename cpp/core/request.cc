#include "request.h"

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

}  // namespace tfmpi
