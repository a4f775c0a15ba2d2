// What every rank executes, in rank 0's order: one Decision of the batches
// rank 0 sends (their encoding: negotiation/wire.h). Declared here, below the
// negotiation, because the executor runs them without knowing how they were
// agreed on.
#pragma once

#include <cstdint>

#include "common/request.h"
#include "common/tunables.h"
#include "common/types.h"

namespace tfmpi {

struct Decision {
  enum class Kind : uint8_t {
    kExecuteCached = 0, kExecute = 1, kError = 2, kShutdownAck = 3, kCoordinatorGone = 4, kSettings = 5 };
  Kind kind = Kind::kExecute;
  uint32_t cache_id = 0;  // kExecuteCached
  Response response;      // kExecute / kError
  // kError: how the failed collective completes on every rank. Disagreeing
  // ranks (shape, dtype, root, ...) are kPrecondition (Horovod's
  // FailedPreconditionError); a rank that left or stalled is kAborted.
  StatusCode error_code = StatusCode::kPrecondition;
  int32_t rank = -1;      // kShutdownAck: whose shutdown
  Tunables tunables;      // kSettings: apply from here on
};

}  // namespace tfmpi
