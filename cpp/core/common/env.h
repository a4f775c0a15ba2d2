// Engine settings read from TF_MPI_* environment variables at init().
#pragma once

#include <cstdint>
#include <string>

#include "common/hierarchical_model.h"
#include "common/tunables.h"

namespace tfmpi {

// TF_MPI_AUTOTUNE: 0 (off), plan (which gradient groups rank 0 sends
// together), 1 (the plan, then the fusion and MPI sizes).
enum class AutotuneScope { kOff, kPlan, kAll };

int64_t EnvInt(const char* name, int64_t fallback);
double EnvDouble(const char* name, double fallback);

struct EngineConfig {
  bool chunk_bytes_set;            // TF_MPI_CHUNK_BYTES given (else its default depends on the hosts)
  Tunables tunables;               // the starting values (see tunables.h)
  AutotuneScope autotune;          // TF_MPI_AUTOTUNE: what rank 0 tunes during the first steps
  int64_t autotune_steps;          // TF_MPI_AUTOTUNE_STEPS: timed steps per candidate
  int64_t cache_capacity;          // TF_MPI_CACHE_CAPACITY; 0 disables the response cache
  double stall_check_s;            // TF_MPI_STALL_CHECK_TIME_SECONDS; 0 disables warnings
  double stall_shutdown_s;         // TF_MPI_STALL_SHUTDOWN_TIME_SECONDS; 0 = wait forever
  // TF_MPI_PEER_TIMEOUT_SECONDS: a peer not heard from for this long is unreachable
  // (transports/liveness.h); 0 turns the check off.
  double peer_timeout_s;
  int64_t spin_us;                 // TF_MPI_SPIN_US: spin this long after activity
  int64_t poll_us;                 // TF_MPI_POLL_US: then poll at most this far apart
  int64_t inline_bytes;            // TF_MPI_INLINE_BYTES: a caller runs requests up to this size itself; 0: never
  int64_t inline_wait_us;          // TF_MPI_INLINE_WAIT_US: ... for at most this long without progress
  std::string cuda_aware;          // TF_MPI_CUDA_AWARE: auto (ask the MPI), 1 (direct transport), 0 (staged)
  int64_t gpu_chunk_bytes;         // TF_MPI_GPU_CHUNK_BYTES: the staged transport's pipeline chunk
  HierarchicalSettings hierarchical;  // TF_MPI_HIERARCHICAL and its model (hierarchical_model.h)
  bool negotiation_tree;           // TF_MPI_NEGOTIATION: tree (default) or star (negotiation_tree.h)
  // Shared-memory allreduce (shm_allreduce.h); rank 0's values apply on every rank.
  std::string shm;                 // TF_MPI_SHM: auto (when it pays), 1 (whenever possible), 0 (never)
  int64_t shm_min_bytes;           // TF_MPI_SHM_MIN_BYTES: smaller allreduces keep the MPI path (auto and 1)
  int64_t shm_chunk_bytes;         // TF_MPI_SHM_CHUNK_BYTES: bytes of a buffer one pipeline step reduces
  std::string shm_slot_writes;     // TF_MPI_SHM_SLOT_WRITES: auto (measured), cached or streamed; rank 0's applies
  // TF_MPI_ELASTIC=1: a lost peer fails collectives instead of ending the job
  // (transports/peer_failure.h); set by `python -m tf_mpi.run --min-np ...`.
  bool elastic;
  static EngineConfig FromEnv();
  std::string ToString() const;
};

}  // namespace tfmpi
