#include "execution/node_stage.h"

#include <stdexcept>

namespace tfmpi {

ShardLayout ShardLayout::Even(int64_t count, int parts) {
  ShardLayout l;
  l.counts.resize(parts);
  l.offsets.resize(parts);
  int64_t offset = 0;
  for (int r = 0; r < parts; ++r) {
    l.counts[r] = count / parts + (r < count % parts ? 1 : 0);
    l.offsets[r] = offset;
    offset += l.counts[r];
  }
  return l;
}

void MpiNodeStage::ReduceScatter(const void* in, void* shard, const ShardLayout& layout, DataType dtype,
                                 ReduceOp op) {
  node_.ReduceScatter(in, shard, layout.counts, dtype, op);
}

void MpiNodeStage::Allgather(const void* shard, void* out, const ShardLayout& layout, DataType dtype) {
  // Rows of one element: the shards' element counts are the row counts.
  node_.Allgather(shard, out, layout.counts, static_cast<int64_t>(DataTypeSize(dtype)));
}

namespace {
void ThrowIfFailed(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message);
}
}  // namespace

void ShmNodeStage::ReduceScatter(const void* in, void* shard, const ShardLayout& layout, DataType dtype,
                                 ReduceOp op) {
  ThrowIfFailed(shm_->ReduceScatter(in, shard, layout.counts, dtype, op, 1.0, 1.0));
}

void ShmNodeStage::Allgather(const void* shard, void* out, const ShardLayout& layout, DataType dtype) {
  ThrowIfFailed(shm_->Allgather(shard, out, layout.counts, dtype));
}

std::unique_ptr<NodeStage> MakeNodeStage(const MpiContext* mpi, const EngineConfig& config) {
  if (auto shm = ShmCollectives::ForNodeStage(mpi, config)) return std::make_unique<ShmNodeStage>(std::move(shm));
  return std::make_unique<MpiNodeStage>(mpi, config.tunables.chunk_bytes);
}

}  // namespace tfmpi
