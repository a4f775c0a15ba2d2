// Owns everything MPI: initialisation (or adoption of an MPI started by
// mpi4py), the engine's private communicators, and the mapping of our
// DataType/ReduceOp onto MPI datatypes and ops (with custom ops for 16-bit
// floats, which MPI cannot add natively).
//
// Topology: the ranks sharing a node form the node communicator
// (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)); the ranks with the same local
// rank on every node form the cross communicator. TF_MPI_TOPOLOGY=NODESxRANKS
// (e.g. 2x2) replaces the real nodes by pretend ones: ranks 0..RANKS-1 are
// node 0, the next RANKS node 1, and so on (NODES*RANKS must be the job's
// size), so node-aware code paths can run on one machine.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "common/types.h"

namespace tfmpi {

struct InitOptions {
  bool has_comm = false;     // use `fortran_comm` (e.g. mpi4py's comm.py2f())
  MPI_Fint fortran_comm = 0;
  std::vector<int> ranks;    // else, if non-empty: these ranks of MPI_COMM_WORLD
  bool process_set = false;  // an engine of a process set (engine.h), not the global one
  bool elastic = false;      // a lost peer fails calls instead of ending the job (peer_failure.h)
};

class MpiContext {
 public:
  // Initialises MPI if nobody has; duplicates the chosen communicator so the
  // engine's traffic never matches a user's messages.
  Status Init(const InitOptions& opts);
  // Frees the engine's datatype and ops and retires its communicator (kept,
  // never freed: see mpi_context.cc); MPI itself stays initialised.
  void Release();
  // MPI_Finalize if this library called MPI_Init and MPI is still up.
  static void FinalizeIfOwned();
  static bool ThreadMultiple();

  MPI_Comm comm() const { return comm_; }
  // A second duplicate, for the peer liveness check's heartbeats alone
  // (liveness.h); MPI_COMM_NULL in elastic mode, where that check is off.
  MPI_Comm liveness_comm() const { return liveness_comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int cross_rank() const { return cross_rank_; }
  int cross_size() const { return cross_size_; }
  // Ranks of this node / ranks with this local rank on every node (collectives only).
  MPI_Comm node_comm() const { return node_comm_; }
  MPI_Comm cross_comm() const { return cross_comm_; }
  // Every node has the same number of ranks (agreed by all ranks at init).
  bool homogeneous() const { return homogeneous_; }
  // The ranks run on more than one host, as shared memory tells (whatever
  // TF_MPI_TOPOLOGY pretends); the same on every rank.
  bool spans_hosts() const { return spans_hosts_; }
  // Where the topology came from: "TF_MPI_TOPOLOGY=2x2" or "shared memory".
  const std::string& topology_source() const { return topology_source_; }
  // The nodes are TF_MPI_TOPOLOGY's, not hosts: the MPI library sees one host
  // (its collectives know no nodes) and there is no network between them.
  bool nodes_declared() const { return topology_source_.rfind("TF_MPI_TOPOLOGY", 0) == 0; }

  MPI_Datatype Type(DataType t) const;
  // Average is reduced as a sum; the executor divides afterwards.
  MPI_Op Op(ReduceOp op, DataType t) const;

 private:
  // Splits comm_ into node_comm_ and cross_comm_ (collective over comm_).
  Status SplitTopology();

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm liveness_comm_ = MPI_COMM_NULL;
  MPI_Comm node_comm_ = MPI_COMM_NULL, cross_comm_ = MPI_COMM_NULL;
  bool homogeneous_ = true;
  bool spans_hosts_ = false;
  std::string topology_source_;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, cross_rank_ = 0, cross_size_ = 1;
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
  // [0] float16, [1] bfloat16; each indexed by ReduceOp (Sum, Min, Max, Product).
  MPI_Op half_ops_[2][5] = {};
};

// Kills the whole job (MPI_Abort, bounded in time: see mpi_context.cc); used
// when one rank cannot go on. Engine::Abort is the same call for callers above the engine.
[[noreturn]] void AbortJob(int code);

}  // namespace tfmpi
