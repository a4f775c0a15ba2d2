// Hierarchical (2D) allreduce, the scheme of the 2D-torus allreduce: with n
// nodes of L ranks each,
//   1. reduce-scatter inside the node: local rank l ends with shard l of the
//      node's sum (NodeStage; shards differ by at most one element),
//   2. allreduce of shard l across the nodes, among the ranks whose local rank
//      is l (MpiContext::cross_comm()),
//   3. allgather inside the node: every rank gets every shard.
// Each inter-node message is 1/L of the buffer, and L of them travel at once.
// Every element is reduced once, by one cross allreduce, and then copied, so
// every rank holds the same bits; integer results equal the flat path's
// exactly (they do not depend on the order of the sum).
//
// When: decided once at init (ChooseHierarchical) from the topology and the
// settings (hierarchical_model.h) and, across real hosts under auto, from
// timing both paths (hierarchical_timing.h), all identical on every rank
// (AgreeOnChoice checks), so every rank takes the same path for the same
// buffer size.
// The executor uses it for allreduces of host memory (fused buffers and
// direct tensors); GPU tensors keep their transport (gpu_transport.h).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/hierarchical_model.h"
#include "execution/node_stage.h"
#include "transports/collectives.h"
#include "transports/mpi_context.h"

namespace tfmpi {

struct HierarchicalChoice {
  HierarchicalMode mode = HierarchicalMode::kOff;
  bool usable = false;  // more than one node, more than one rank per node, all nodes alike
  SizeWindow window;    // buffers of these sizes (bytes) go hierarchical
  Link intra, inter;    // the model's links (identical on every rank: settings or the probe's broadcast)
  std::string summary;  // one line: what is used, for which sizes, and why
  PathTimings timed;    // what the window came from, where timed at start-up (else empty)
  bool Chooses(int64_t bytes) const { return usable && window.Contains(bytes); }
};

// From the topology and settings alone (no MPI call); with `timed`, where
// auto decides by size, the window is the timings' (WindowFromTimings).
HierarchicalChoice ChooseHierarchical(const HierarchicalSettings& settings, const MpiContext& mpi,
                                      const PathTimings* timed = nullptr);
// Collective over mpi.comm(): an error on every rank unless all ranks chose alike.
Status AgreeOnChoice(const MpiContext& mpi, const HierarchicalChoice& choice);

class HierarchicalAllreduce {
 public:
  using Clock = std::chrono::steady_clock;
  // Called after each phase with its name (MPI_NODE_REDUCESCATTER or
  // SHM_NODE_REDUCESCATTER, MPI_CROSS_ALLREDUCE, MPI_NODE_ALLGATHER or
  // SHM_NODE_ALLGATHER) and start time, for the timeline.
  using PhaseFn = std::function<void(const char* phase, Clock::time_point start)>;

  // Collective over mpi->comm() (the node stage is chosen here, node_stage.h).
  HierarchicalAllreduce(const MpiContext* mpi, const HierarchicalChoice& choice, const EngineConfig& config);
  bool Chooses(int64_t bytes) const { return choice_.Chooses(bytes); }
  const HierarchicalChoice& choice() const { return choice_; }
  // Only before the first allreduce, with the same usable() (identical on every rank).
  void set_choice(const HierarchicalChoice& c) { choice_ = c; }
  void set_chunk_bytes(int64_t chunk_bytes);

  // out = reduce(in) over all ranks; in == nullptr or in == out reduces in place.
  // Only where choice().usable (every rank calls it for the same buffers).
  void Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op, const PhaseFn& phase);

 private:
  const MpiContext* mpi_;
  HierarchicalChoice choice_;
  std::unique_ptr<NodeStage> node_;  // null unless usable
  Collectives cross_;
  std::vector<char> shard_;  // this rank's shard between the phases
};

}  // namespace tfmpi
