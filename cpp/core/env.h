// Engine settings read from TF_MPI_* environment variables at init().
#pragma once

#include <cstdint>
#include <string>

namespace tfmpi {

int64_t EnvInt(const char* name, int64_t fallback);
double EnvDouble(const char* name, double fallback);

struct EngineConfig {
  int64_t fusion_threshold_bytes;  // TF_MPI_FUSION_THRESHOLD; 0 disables fusion
  int64_t chunk_bytes;             // TF_MPI_CHUNK_BYTES: largest single MPI call
  int64_t cache_capacity;          // TF_MPI_CACHE_CAPACITY; 0 disables the response cache
  double stall_check_s;            // TF_MPI_STALL_CHECK_TIME_SECONDS; 0 disables warnings
  double stall_shutdown_s;         // TF_MPI_STALL_SHUTDOWN_TIME_SECONDS; 0 = wait forever
  int64_t spin_us;                 // TF_MPI_SPIN_US: spin this long after activity
  int64_t poll_us;                 // TF_MPI_POLL_US: then poll at most this far apart
  static EngineConfig FromEnv();
  std::string ToString() const;
};

}  // namespace tfmpi
