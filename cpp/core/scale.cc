#include "scale.h"

#include <cstring>
#include <limits>

#include "dispatch.h"

namespace tfmpi {

void ScaleCopy(void* dst, const void* src, int64_t count, DataType dtype, double factor) {
  DispatchType(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = typename Arith<T>::type;
    const T* in = static_cast<const T*>(src);
    T* out = static_cast<T*>(dst);
    if (factor == 1.0) {
      if (dst != src) std::memcpy(out, in, count * sizeof(T));
      return;
    }
    if constexpr (std::is_floating_point_v<A>) {
      const A f = static_cast<A>(factor);
      for (int64_t i = 0; i < count; ++i) out[i] = Store<T>(Load(in[i]) * f);
    } else {
      for (int64_t i = 0; i < count; ++i)
        out[i] = static_cast<T>(static_cast<double>(in[i]) * factor);
    }
  });
}

void FillIdentity(void* dst, int64_t count, DataType dtype, ReduceOp op) {
  DispatchType(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = typename Arith<T>::type;
    A v = 0;
    if (op == ReduceOp::kProduct) v = 1;
    if (op == ReduceOp::kMin) v = std::numeric_limits<A>::has_infinity ? std::numeric_limits<A>::infinity() : std::numeric_limits<A>::max();
    if (op == ReduceOp::kMax) v = std::numeric_limits<A>::has_infinity ? -std::numeric_limits<A>::infinity() : std::numeric_limits<A>::lowest();
    T* out = static_cast<T*>(dst);
    const T s = Store<T>(v);
    for (int64_t i = 0; i < count; ++i) out[i] = s;
  });
}

}  // namespace tfmpi
