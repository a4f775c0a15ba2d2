// Element-wise helpers the executor needs on raw buffers of any DataType.
#pragma once

#include <cstdint>

#include "common/types.h"

namespace tfmpi {

// dst[i] = src[i] * factor for `count` elements of `dtype` (dst may equal src).
// Integers are scaled in double and truncated toward zero, as C casts do.
void ScaleCopy(void* dst, const void* src, int64_t count, DataType dtype, double factor);

// Fills `count` elements of `dtype` with the identity of `op` (0 for Sum, ...).
// Used when a rank contributes nothing (join) and for empty fused slots.
void FillIdentity(void* dst, int64_t count, DataType dtype, ReduceOp op);

// dst[i] = op(a[i], b[i]) for `count` elements (dst may equal a or b), with
// the semantics of the MPI path (MpiContext::Op): Average adds (the caller
// divides), integers wrap around as MPI's C arithmetic does, bool Sum/Max
// are OR and Min/Product AND, 16-bit floats compute in float and round once
// per pair, as the engine's MPI ops for them do.
void ReduceInto(void* dst, const void* a, const void* b, int64_t count, DataType dtype, ReduceOp op);

}  // namespace tfmpi
