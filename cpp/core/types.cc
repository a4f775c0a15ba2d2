#include "types.h"

namespace tfmpi {

namespace {
struct TypeInfo { const char* name; size_t size; bool floating; };
// Indexed by DataType; one row per type keeps size/name/kind in one place.
constexpr TypeInfo kTypes[] = {
    {"uint8", 1, false},   {"int8", 1, false},     {"int32", 4, false},
    {"int64", 8, false},   {"float16", 2, true},   {"bfloat16", 2, true},
    {"float32", 4, true},  {"float64", 8, true},   {"bool", 1, false},
    {"int16", 2, false},   {"uint16", 2, false},
};
static_assert(sizeof(kTypes) / sizeof(kTypes[0]) == static_cast<size_t>(DataType::kNumTypes),
              "kTypes must list every DataType");
}  // namespace

size_t DataTypeSize(DataType t) { return kTypes[static_cast<int>(t)].size; }
const char* DataTypeName(DataType t) { return kTypes[static_cast<int>(t)].name; }
bool IsFloating(DataType t) { return kTypes[static_cast<int>(t)].floating; }

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
