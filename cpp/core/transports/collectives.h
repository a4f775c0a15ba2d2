// Raw MPI collectives on host buffers, cut into calls of at most
// `chunk_bytes` (which also keeps every MPI count below 2^31).
//
// Allgather and alltoall count in rows (one derived type per row) and are
// not cut: their limits are checked first (Check*), from what every rank
// knows alike, so a collective beyond them fails on every rank before any
// MPI call instead of leaving the others inside it. Nothing here throws.
#pragma once

#include <cstdint>
#include <vector>

#include "common/types.h"
#include "transports/mpi_context.h"

namespace tfmpi {

class Collectives {
 public:
  // Over the engine's communicator.
  Collectives(const MpiContext* mpi, int64_t chunk_bytes)
      : Collectives(mpi, mpi->comm(), chunk_bytes) {}
  // Over `comm`, one of the engine's communicators (e.g. mpi->node_comm()).
  Collectives(const MpiContext* mpi, MPI_Comm comm, int64_t chunk_bytes);
  // Must change at the same point of the decision stream on every rank (see tunables.h).
  void set_chunk_bytes(int64_t chunk_bytes) { chunk_bytes_ = chunk_bytes; }

  // out = reduce(in) over ranks; in == nullptr or in == out reduces in place.
  void Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op) const;
  // Whether Allgather/Alltoall can move these counts (MPI's ints); the error names the limit.
  static Status CheckAllgather(const std::vector<int64_t>& rows_per_rank, int64_t row_bytes);
  // `splits[s][r]`: rows rank s sends to rank r, for every pair of ranks.
  static Status CheckAlltoall(const std::vector<std::vector<int64_t>>& splits, int64_t row_bytes);

  // Concatenates each rank's rows; rows_per_rank[r] rows of row_bytes bytes.
  void Allgather(const void* in, void* out, const std::vector<int64_t>& rows_per_rank,
                 int64_t row_bytes) const;
  void Broadcast(void* buf, int64_t bytes, int root) const;
  // Sends send_rows[j] rows to rank j and receives recv_rows[j] rows from it.
  void Alltoall(const void* in, void* out, const std::vector<int64_t>& send_rows,
                const std::vector<int64_t>& recv_rows, int64_t row_bytes) const;
  // Reduces `in` (sum of recv_counts elements) and leaves block r on rank r.
  // Above chunk_bytes in all, cut into MPI calls of at most chunk_bytes.
  void ReduceScatter(const void* in, void* out, const std::vector<int64_t>& recv_counts, DataType dtype,
                     ReduceOp op) const;

 private:
  const MpiContext* mpi_;  // datatypes and ops
  MPI_Comm comm_;
  int rank_;  // in comm_
  int64_t chunk_bytes_;
};

}  // namespace tfmpi
