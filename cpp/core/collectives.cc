#include "collectives.h"

#include <algorithm>
#include <climits>
#include <stdexcept>

#include "wait_policy.h"

namespace tfmpi {

namespace {
int64_t RowsBytes(const std::vector<int64_t>& rows, int64_t row_bytes) {
  int64_t n = 0;
  for (int64_t r : rows) n += r;
  return n * row_bytes;
}
}  // namespace

void Collectives::Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op) const {
  const int64_t elem = DataTypeSize(dtype);
  const int64_t per_call = std::max<int64_t>(1, std::min<int64_t>(chunk_bytes_ / elem, INT_MAX));
  const MPI_Datatype type = mpi_->Type(dtype);
  const MPI_Op mpi_op = mpi_->Op(op, dtype);
  const bool in_place = in == nullptr || in == out;
  YieldWhileWaiting wait(count * elem, yield_bytes_);
  char* o = static_cast<char*>(out);
  const char* i = static_cast<const char*>(in);
  for (int64_t done = 0; done < count; done += per_call) {
    const int n = static_cast<int>(std::min(per_call, count - done));
    const void* src = in_place ? MPI_IN_PLACE : static_cast<const void*>(i + done * elem);
    MPI_Allreduce(src, o + done * elem, n, type, mpi_op, mpi_->comm());
  }
}

void Collectives::Allgather(const void* in, void* out, const std::vector<int64_t>& rows_per_rank,
                            int64_t row_bytes) const {
  if (row_bytes == 0) return;
  // Counts are in rows (a derived type of row_bytes), so a large tensor with
  // modest dim 0 never overflows MPI's int counts.
  if (row_bytes > INT_MAX) throw std::runtime_error("tf_mpi: allgather row larger than 2 GiB");
  MPI_Datatype row;
  MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &row);
  MPI_Type_commit(&row);
  const int n = static_cast<int>(rows_per_rank.size());
  std::vector<int> counts(n), displs(n);
  int64_t offset = 0;
  YieldWhileWaiting wait(RowsBytes(rows_per_rank, row_bytes), yield_bytes_);
  for (int r = 0; r < n; ++r) {
    if (rows_per_rank[r] > INT_MAX || offset > INT_MAX)
      throw std::runtime_error("tf_mpi: allgather of more than 2^31 rows is not supported");
    counts[r] = static_cast<int>(rows_per_rank[r]);
    displs[r] = static_cast<int>(offset);
    offset += rows_per_rank[r];
  }
  MPI_Allgatherv(in, counts[mpi_->rank()], row, out, counts.data(), displs.data(), row, mpi_->comm());
  MPI_Type_free(&row);
}

namespace {
// MPI counts and displacements are ints: refuse (loudly) what does not fit.
std::vector<int> ToInts(const std::vector<int64_t>& v, const char* what) {
  std::vector<int> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] > INT_MAX) throw std::runtime_error(std::string("tf_mpi: ") + what + " count above 2^31-1");
    out[i] = static_cast<int>(v[i]);
  }
  return out;
}

std::vector<int64_t> Offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> out(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) out[i] = out[i - 1] + counts[i - 1];
  return out;
}
}  // namespace

void Collectives::Alltoall(const void* in, void* out, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows, int64_t row_bytes) const {
  if (row_bytes == 0) return;
  if (row_bytes > INT_MAX) throw std::runtime_error("tf_mpi: alltoall row larger than 2 GiB");
  MPI_Datatype row;
  MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &row);
  MPI_Type_commit(&row);
  std::vector<int> sc = ToInts(send_rows, "alltoall"), rc = ToInts(recv_rows, "alltoall");
  std::vector<int> sd = ToInts(Offsets(send_rows), "alltoall"), rd = ToInts(Offsets(recv_rows), "alltoall");
  YieldWhileWaiting wait(RowsBytes(send_rows, row_bytes) + RowsBytes(recv_rows, row_bytes), yield_bytes_);
  MPI_Alltoallv(in, sc.data(), sd.data(), row, out, rc.data(), rd.data(), row, mpi_->comm());
  MPI_Type_free(&row);
}

void Collectives::ReduceScatter(const void* in, void* out, const std::vector<int64_t>& recv_counts,
                                DataType dtype, ReduceOp op) const {
  std::vector<int> counts = ToInts(recv_counts, "reducescatter");
  YieldWhileWaiting wait(RowsBytes(recv_counts, DataTypeSize(dtype)), yield_bytes_);
  MPI_Reduce_scatter(in, out, counts.data(), mpi_->Type(dtype), mpi_->Op(op, dtype), mpi_->comm());
}

void Collectives::Broadcast(void* buf, int64_t bytes, int root) const {
  char* p = static_cast<char*>(buf);
  YieldWhileWaiting wait(bytes, yield_bytes_);
  const int64_t per_call = std::max<int64_t>(1, std::min<int64_t>(chunk_bytes_, INT_MAX));
  for (int64_t done = 0; done < bytes; done += per_call) {
    const int n = static_cast<int>(std::min(per_call, bytes - done));
    MPI_Bcast(p + done, n, MPI_BYTE, root, mpi_->comm());
  }
}

}  // namespace tfmpi
