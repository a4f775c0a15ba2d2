#include "common/types.h"

namespace tfmpi {

namespace {
struct TypeInfo { const char* name; size_t size; };
// Indexed by DataType; one row per type keeps size and name in one place.
constexpr TypeInfo kTypes[] = {
    {"uint8", 1},   {"int8", 1},     {"int32", 4},   {"int64", 8},  {"float16", 2}, {"bfloat16", 2},
    {"float32", 4}, {"float64", 8},  {"bool", 1},    {"int16", 2},  {"uint16", 2},
};
static_assert(sizeof(kTypes) / sizeof(kTypes[0]) == static_cast<size_t>(DataType::kNumTypes),
              "kTypes must list every DataType");
}  // namespace

size_t DataTypeSize(DataType t) { return kTypes[static_cast<int>(t)].size; }
const char* DataTypeName(DataType t) { return kTypes[static_cast<int>(t)].name; }

const char* ReduceOpName(ReduceOp op) {
  static const char* names[] = {"Average", "Sum", "Min", "Max", "Product", "Adasum"};
  return names[static_cast<int>(op)];
}

const char* CollectiveName(CollectiveType t) {
  static const char* names[] = {"allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "join"};
  return names[static_cast<int>(t)];
}

int64_t NumElements(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string ShapeString(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

}  // namespace tfmpi
