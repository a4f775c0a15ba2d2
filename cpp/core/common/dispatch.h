// One switch from a runtime DataType to a C++ element type, so per-type code
// is written once as a template.
#pragma once

#include <cstdint>
#include <stdexcept>

#include "common/half.h"
#include "common/types.h"

namespace tfmpi {

// Calls fn(T{}) with T the element type of dtype.
template <typename Fn>
auto DispatchType(DataType dtype, Fn&& fn) {
  switch (dtype) {
    case DataType::kUInt8: return fn(uint8_t{});
    case DataType::kInt8: return fn(int8_t{});
    case DataType::kInt32: return fn(int32_t{});
    case DataType::kInt64: return fn(int64_t{});
    case DataType::kFloat16: return fn(Float16{});
    case DataType::kBFloat16: return fn(BFloat16{});
    case DataType::kFloat32: return fn(float{});
    case DataType::kFloat64: return fn(double{});
    case DataType::kBool: return fn(bool{});
    case DataType::kInt16: return fn(int16_t{});
    case DataType::kUInt16: return fn(uint16_t{});
    default: throw std::invalid_argument("tf_mpi: unknown dtype");
  }
}

// Arithmetic view of an element: 16-bit floats compute in float.
template <typename T> struct Arith { using type = T; };
template <> struct Arith<Float16> { using type = float; };
template <> struct Arith<BFloat16> { using type = float; };

template <typename T> inline typename Arith<T>::type Load(T v) { return v; }
inline float Load(Float16 v) { return ToFloat(v); }
inline float Load(BFloat16 v) { return ToFloat(v); }

template <typename T> inline T Store(typename Arith<T>::type v) { return static_cast<T>(v); }
template <> inline Float16 Store<Float16>(float v) { return ToFloat16(v); }
template <> inline BFloat16 Store<BFloat16>(float v) { return ToBFloat16(v); }

}  // namespace tfmpi
