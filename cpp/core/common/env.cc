#include "common/env.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace tfmpi {

namespace {
// Measured with benchmarks/allreduce_bench.py (docs/performance.md).
constexpr int64_t kShmMinBytesDefault = 0;
// A step of 1 MiB (512 KiB per rank at 2 ranks) was as fast as 256 KiB when
// the ranks' cores share a last-level cache and 1.2x faster when they do not
// (a rank then reads its peers' just-written slots from a remote cache, and
// larger steps amortise that): docs/performance.md.
constexpr int64_t kShmChunkBytesDefault = 1 << 20;
}  // namespace

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  if (*end) throw std::invalid_argument(std::string("tf_mpi: ") + name + "=" + v + " is not an integer");
  return x;
}

double EnvDouble(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  double x = std::strtod(v, &end);
  if (*end) throw std::invalid_argument(std::string("tf_mpi: ") + name + "=" + v + " is not a number");
  return x;
}

EngineConfig EngineConfig::FromEnv() {
  EngineConfig c;
  // Defaults come from benchmarks/allreduce_bench.py on a 2-core machine
  // (see docs/performance.md): 64 MiB fused buffers, cut into 1 MiB MPI calls
  // because cache-sized messages pipeline better than one huge call; tensors
  // of 256 KiB and more are not copied into the buffer at all.
  const Tunables defaults;
  c.tunables.fusion_threshold = std::max<int64_t>(0, EnvInt("TF_MPI_FUSION_THRESHOLD", defaults.fusion_threshold));
  c.tunables.direct_bytes = std::max<int64_t>(0, EnvInt("TF_MPI_FUSION_DIRECT_BYTES", defaults.direct_bytes));
  c.tunables.chunk_bytes = EnvInt("TF_MPI_CHUNK_BYTES", defaults.chunk_bytes);
  c.chunk_bytes_set = c.tunables.chunk_bytes > 0 && std::getenv("TF_MPI_CHUNK_BYTES") && *std::getenv("TF_MPI_CHUNK_BYTES");
  if (c.tunables.chunk_bytes <= 0) c.tunables.chunk_bytes = defaults.chunk_bytes;
  const char* tune = std::getenv("TF_MPI_AUTOTUNE");
  const std::string scope = tune ? tune : "";
  if (scope.empty() || scope == "0") c.autotune = AutotuneScope::kOff;
  else if (scope == "1") c.autotune = AutotuneScope::kAll;
  else if (scope == "plan") c.autotune = AutotuneScope::kPlan;
  else throw std::invalid_argument("tf_mpi: TF_MPI_AUTOTUNE=" + scope + " is not 0, 1 or plan");
  c.autotune_steps = std::max<int64_t>(1, EnvInt("TF_MPI_AUTOTUNE_STEPS", 10));
  c.cache_capacity = EnvInt("TF_MPI_CACHE_CAPACITY", 4096);
  c.stall_check_s = EnvDouble("TF_MPI_STALL_CHECK_TIME_SECONDS", 60.0);
  c.stall_shutdown_s = EnvDouble("TF_MPI_STALL_SHUTDOWN_TIME_SECONDS", 0.0);
  // 30 s, the MPI watchdog's base time: a rank descheduled on an overloaded
  // node, a long swap or a VM pause is not taken for a lost one, while a cut
  // during negotiation ends as promptly as one inside a collective.
  c.peer_timeout_s = std::max(0.0, EnvDouble("TF_MPI_PEER_TIMEOUT_SECONDS", 30.0));
  c.spin_us = EnvInt("TF_MPI_SPIN_US", 250);
  c.poll_us = EnvInt("TF_MPI_POLL_US", 200);
  c.inline_bytes = std::max<int64_t>(0, EnvInt("TF_MPI_INLINE_BYTES", 64 << 10));
  c.inline_wait_us = std::max<int64_t>(0, EnvInt("TF_MPI_INLINE_WAIT_US", 100));
  const char* aware = std::getenv("TF_MPI_CUDA_AWARE");
  c.cuda_aware = aware && *aware ? aware : "auto";
  if (c.cuda_aware != "auto" && c.cuda_aware != "0" && c.cuda_aware != "1")
    throw std::invalid_argument("tf_mpi: TF_MPI_CUDA_AWARE=" + c.cuda_aware + " is not auto, 0 or 1");
  // 4 MiB chunks: large enough that a copy runs near the link's speed, small
  // enough that the pipeline's fill and drain (one chunk each way) stay short.
  c.gpu_chunk_bytes = EnvInt("TF_MPI_GPU_CHUNK_BYTES", 4 << 20);
  if (c.gpu_chunk_bytes <= 0) c.gpu_chunk_bytes = 4 << 20;
  c.hierarchical = HierarchicalSettings::FromEnv();
  const char* negotiation = std::getenv("TF_MPI_NEGOTIATION");
  const std::string shape = negotiation && *negotiation ? negotiation : "tree";
  if (shape != "tree" && shape != "star")
    throw std::invalid_argument("tf_mpi: TF_MPI_NEGOTIATION=" + shape + " is not tree or star");
  c.negotiation_tree = shape == "tree";
  const char* elastic = std::getenv("TF_MPI_ELASTIC");
  const std::string elastic_value = elastic ? elastic : "";
  if (elastic_value != "" && elastic_value != "0" && elastic_value != "1")
    throw std::invalid_argument("tf_mpi: TF_MPI_ELASTIC=" + elastic_value + " is not 0 or 1");
  c.elastic = elastic_value == "1";
  const char* shm = std::getenv("TF_MPI_SHM");
  c.shm = shm && *shm ? shm : "auto";
  if (c.shm != "auto" && c.shm != "0" && c.shm != "1")
    throw std::invalid_argument("tf_mpi: TF_MPI_SHM=" + c.shm + " is not auto, 0 or 1");
  c.shm_min_bytes = std::max<int64_t>(0, EnvInt("TF_MPI_SHM_MIN_BYTES", kShmMinBytesDefault));
  c.shm_chunk_bytes = EnvInt("TF_MPI_SHM_CHUNK_BYTES", kShmChunkBytesDefault);
  if (c.shm_chunk_bytes <= 0) c.shm_chunk_bytes = kShmChunkBytesDefault;
  const char* slot_writes = std::getenv("TF_MPI_SHM_SLOT_WRITES");
  c.shm_slot_writes = slot_writes && *slot_writes ? slot_writes : "auto";
  if (c.shm_slot_writes != "auto" && c.shm_slot_writes != "cached" && c.shm_slot_writes != "streamed")
    throw std::invalid_argument("tf_mpi: TF_MPI_SHM_SLOT_WRITES=" + c.shm_slot_writes +
                                " is not auto, cached or streamed");
  return c;
}

std::string EngineConfig::ToString() const {
  std::ostringstream os;
  os << tunables.ToString() << " autotune="
     << (autotune == AutotuneScope::kAll ? "1" : autotune == AutotuneScope::kPlan ? "plan" : "0") << " cache_capacity=" << cache_capacity << " stall_check_s=" << stall_check_s
     << " stall_shutdown_s=" << stall_shutdown_s << " peer_timeout_s=" << peer_timeout_s << " spin_us=" << spin_us << " poll_us=" << poll_us
     << " inline_bytes=" << inline_bytes << " inline_wait_us=" << inline_wait_us
     << " cuda_aware=" << cuda_aware << " gpu_chunk_bytes=" << gpu_chunk_bytes
     << " negotiation=" << (negotiation_tree ? "tree" : "star") << " " << hierarchical.ToString()
     << " shm=" << shm << " shm_min_bytes=" << shm_min_bytes << " shm_chunk_bytes=" << shm_chunk_bytes
     << " shm_slot_writes=" << shm_slot_writes << " elastic=" << (elastic ? 1 : 0);
  return os.str();
}

}  // namespace tfmpi
