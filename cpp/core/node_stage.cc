#include "node_stage.h"

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

std::unique_ptr<NodeStage> MakeNodeStage(const MpiContext* mpi, int64_t chunk_bytes) {
  return std::make_unique<MpiNodeStage>(mpi, chunk_bytes);
}

}  // namespace tfmpi
