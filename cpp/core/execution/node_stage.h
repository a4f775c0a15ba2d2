// The node-local half of the hierarchical allreduce (hierarchical.h): a
// reduce-scatter among the ranks of one node, and the allgather that later
// spreads the reduced shards back. Behind this interface so that a transport
// other than MPI messages (e.g. a shared-memory window on the node) can take
// the node's part without touching the algorithm: implement NodeStage and
// return it from MakeNodeStage.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/env.h"
#include "common/types.h"
#include "transports/collectives.h"
#include "transports/mpi_context.h"
#include "transports/shm_allreduce.h"

namespace tfmpi {

// How `count` elements are cut into one shard per local rank: shard r is
// [offsets[r], offsets[r] + counts[r]), and the first count % parts shards
// have one element more (so shards differ by at most one element).
struct ShardLayout {
  std::vector<int64_t> counts, offsets;
  static ShardLayout Even(int64_t count, int parts);
};

class NodeStage {
 public:
  virtual ~NodeStage() = default;
  // Reduces `in` (all of `layout`'s elements) over the node's ranks with `op`
  // and writes shard local_rank() of the result to `shard` (which does not alias `in`).
  virtual void ReduceScatter(const void* in, void* shard, const ShardLayout& layout, DataType dtype,
                             ReduceOp op) = 0;
  // Writes every local rank's `shard` to its place in `out` (which does not alias `shard`).
  virtual void Allgather(const void* shard, void* out, const ShardLayout& layout, DataType dtype) = 0;
  // Must change at the same point of the decision stream on every rank (see tunables.h).
  virtual void set_chunk_bytes(int64_t chunk_bytes) = 0;
  // The timeline's names of the two phases (MPI_NODE_* or SHM_NODE_*).
  virtual const char* reducescatter_phase() const = 0;
  virtual const char* allgather_phase() const = 0;
};

// MPI collectives on MpiContext::node_comm(). Counts must fit an int (the
// hierarchical allreduce cuts larger buffers into pieces first).
class MpiNodeStage : public NodeStage {
 public:
  MpiNodeStage(const MpiContext* mpi, int64_t chunk_bytes)
      : node_(mpi, mpi->node_comm(), chunk_bytes) {}
  void ReduceScatter(const void* in, void* shard, const ShardLayout& layout, DataType dtype, ReduceOp op) override;
  void Allgather(const void* shard, void* out, const ShardLayout& layout, DataType dtype) override;
  void set_chunk_bytes(int64_t chunk_bytes) override { node_.set_chunk_bytes(chunk_bytes); }
  const char* reducescatter_phase() const override { return "MPI_NODE_REDUCESCATTER"; }
  const char* allgather_phase() const override { return "MPI_NODE_ALLGATHER"; }

 private:
  Collectives node_;
};

// The node's shared-memory window (shm_allreduce.h): the same block layout,
// each rank reducing its own shard reading the others' data where it lies. A
// failure (a peer that exited) throws: the other nodes are already inside the
// cross-node stage with this one, so the job cannot go on (Protocol::RunBatch).
class ShmNodeStage : public NodeStage {
 public:
  explicit ShmNodeStage(std::unique_ptr<ShmCollectives> shm) : shm_(std::move(shm)) {}
  void ReduceScatter(const void* in, void* shard, const ShardLayout& layout, DataType dtype, ReduceOp op) override;
  void Allgather(const void* shard, void* out, const ShardLayout& layout, DataType dtype) override;
  // The shared-memory pipeline has its own step size (TF_MPI_SHM_CHUNK_BYTES).
  void set_chunk_bytes(int64_t) override {}
  const char* reducescatter_phase() const override { return "SHM_NODE_REDUCESCATTER"; }
  const char* allgather_phase() const override { return "SHM_NODE_ALLGATHER"; }

 private:
  std::unique_ptr<ShmCollectives> shm_;
};

// The node stage this process uses: shared memory where TF_MPI_SHM allows it
// on this node (ShmCollectives::ForNodeStage), MPI otherwise. Collective over
// mpi->comm().
std::unique_ptr<NodeStage> MakeNodeStage(const MpiContext* mpi, const EngineConfig& config);

}  // namespace tfmpi
