// Settings that every rank must apply identically, because they decide how a
// batch of allreduces is cut into MPI calls. Rank 0 owns them: it sends them
// to all ranks as a decision (Decision::Kind::kSettings), so a change takes
// effect at the same point of the decision stream everywhere. The autotuner
// changes them this way; nothing else may change them after init.
#pragma once

#include <cstdint>
#include <string>

namespace tfmpi {

// TF_MPI_CHUNK_BYTES's default when the ranks span several hosts. A call's
// fixed cost across a network (the ranks synchronise, the link idles while the
// next call starts) outweighs the cache effects that make 1 MiB pieces win
// over shared memory: a 16 MiB allreduce between two hosts over 1 Gbit/s took
// 0.43 s in 1 MiB calls and 0.17-0.24 s in one (benchmarks/cluster_link_bench.py).
constexpr int64_t kNetworkChunkBytes = 16ll << 20;

struct Tunables {
  int64_t fusion_threshold = 64ll << 20;  // TF_MPI_FUSION_THRESHOLD: largest fused buffer; 0 disables fusion
  int64_t direct_bytes = 256ll << 10;     // TF_MPI_FUSION_DIRECT_BYTES: tensors this big skip the buffer; 0: never
  int64_t chunk_bytes = 1ll << 20;        // TF_MPI_CHUNK_BYTES: largest single MPI call (one host)

  bool operator==(const Tunables& o) const {
    return fusion_threshold == o.fusion_threshold && direct_bytes == o.direct_bytes && chunk_bytes == o.chunk_bytes;
  }
  std::string ToString() const {
    return "fusion_threshold=" + std::to_string(fusion_threshold) + " direct_bytes=" + std::to_string(direct_bytes) +
           " chunk_bytes=" + std::to_string(chunk_bytes);
  }
};

}  // namespace tfmpi
