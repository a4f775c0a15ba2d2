// Owns everything MPI: initialisation (or adoption of an MPI started by
// mpi4py), the engine's private communicators, and the mapping of our
// DataType/ReduceOp onto MPI datatypes and ops (with custom ops for 16-bit
// floats, which MPI cannot add natively).
#pragma once

#include <mpi.h>

#include <vector>

#include "types.h"

namespace tfmpi {

struct InitOptions {
  bool has_comm = false;     // use `fortran_comm` (e.g. mpi4py's comm.py2f())
  MPI_Fint fortran_comm = 0;
  std::vector<int> ranks;    // else, if non-empty: these ranks of MPI_COMM_WORLD
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
  // The ranks of comm() that share this node's memory (MPI_COMM_TYPE_SHARED),
  // ordered as in comm(); what the shared-memory collectives run over.
  MPI_Comm local_comm() const { return local_comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int cross_rank() const { return cross_rank_; }
  int cross_size() const { return cross_size_; }

  MPI_Datatype Type(DataType t) const;
  // Average is reduced as a sum; the executor divides afterwards.
  MPI_Op Op(ReduceOp op, DataType t) const;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm local_comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, cross_rank_ = 0, cross_size_ = 1;
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
  // [0] float16, [1] bfloat16; each indexed by ReduceOp (Sum, Min, Max, Product).
  MPI_Op half_ops_[2][5] = {};
};

}  // namespace tfmpi
