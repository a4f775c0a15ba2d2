#include "execution/hierarchical.h"

#include <cstdio>

#include <algorithm>
#include <climits>
#include <limits>

#include "execution/hierarchical_timing.h"

namespace tfmpi {

namespace {

std::string WindowString(const SizeWindow& w) {
  if (w.min_bytes >= w.max_bytes) return "no buffer size";
  if (w.max_bytes == std::numeric_limits<int64_t>::max())
    return w.min_bytes == 0 ? "every buffer" : "buffers of " + SizeName(w.min_bytes) + " and more";
  return "buffers from " + SizeName(w.min_bytes) + " up to (not including) " + SizeName(w.max_bytes);
}

}  // namespace

HierarchicalChoice ChooseHierarchical(const HierarchicalSettings& s, const MpiContext& mpi, const PathTimings* timed) {
  HierarchicalChoice c;
  c.mode = s.mode;
  c.intra = s.intra;
  c.inter = s.inter;
  const int nodes = mpi.cross_size(), per_node = mpi.local_size();
  const std::string topology = std::to_string(nodes) + " node(s) x " + std::to_string(per_node) +
                               " rank(s) per node, from " + mpi.topology_source();
  c.usable = mpi.homogeneous() && nodes > 1 && per_node > 1;
  const std::string prefix = std::string("TF_MPI_HIERARCHICAL=") + HierarchicalModeName(s.mode) + ": ";
  if (s.mode == HierarchicalMode::kOff) {
    c.summary = prefix + "flat allreduce only";
    return c;
  }
  if (!c.usable) {
    c.summary = prefix + "not used: it needs more than one node and more than one rank per node, the same number "
                "on every node; this job has " + (mpi.homogeneous() ? topology : "nodes with different numbers of ranks");
    return c;
  }
  const int64_t any = std::numeric_limits<int64_t>::max();
  std::string why;
  if (s.mode == HierarchicalMode::kOn) {
    c.window = {0, any};
  } else if (s.threshold_bytes >= 0) {
    c.window = {s.threshold_bytes, any};
    why = " (TF_MPI_HIERARCHICAL_THRESHOLD)";
  } else {
    const std::string links =
        "intra-node link " + std::string(s.intra_given ? "from TF_MPI_INTRA_NODE_LINK" : "default") +
        ", inter-node link " +
        (s.inter_given    ? "from TF_MPI_INTER_NODE_LINK"
         : s.inter_probed ? "measured at start-up"
                          : "default: not measured, set TF_MPI_INTER_NODE_LINK");
    if (timed && !timed->bytes.empty() && !s.inter_given) {
      c.timed = *timed;
      c.window = WindowFromTimings(*timed);
      char took[64];
      std::snprintf(took, sizeof(took), " in %.2f s", timed->seconds);
      why = " (both paths timed at start-up" + std::string(took) + ", flat/hierarchical: " + TimingsString(*timed) +
            "; larger sizes as the largest; the model's " + links + ")";
    } else {
      // Nodes the MPI library sees (real hosts) get its node-aware allreduce;
      // TF_MPI_TOPOLOGY's nodes share one host, where it runs a single level.
      const bool pretend = mpi.nodes_declared();
      c.window = HierarchicalWindow(nodes, per_node, s.intra, s.inter,
                                    pretend ? FlatModel::kSingleLevel : FlatModel::kNodeAware);
      why = std::string(" (alpha-beta model, flat ") + (pretend ? "single-level" : "node-aware") +
            ", sizes rounded to powers of two; " + links + ")";
    }
  }
  c.summary = prefix + "hierarchical for " + WindowString(c.window) + why + "; " + topology;
  return c;
}

Status AgreeOnChoice(const MpiContext& mpi, const HierarchicalChoice& c) {
  const int64_t mode = static_cast<int64_t>(c.mode), usable = c.usable ? 1 : 0;
  int64_t mine[8] = {mode, -mode, usable, -usable, c.window.min_bytes, -c.window.min_bytes, c.window.max_bytes,
                     -c.window.max_bytes};
  int64_t all[8];
  MPI_Allreduce(mine, all, 8, MPI_INT64_T, MPI_MAX, mpi.comm());
  for (int i = 0; i < 8; i += 2)
    if (all[i] != -all[i + 1])
      return Status::Invalid("tf_mpi: the ranks disagree on the hierarchical allreduce (this rank: " + c.summary +
                             "); set TF_MPI_HIERARCHICAL, TF_MPI_HIERARCHICAL_THRESHOLD, TF_MPI_INTRA_NODE_LINK and "
                             "TF_MPI_INTER_NODE_LINK alike on every rank (mpirun -x NAME)");
  return Status::OK();
}

HierarchicalAllreduce::HierarchicalAllreduce(const MpiContext* mpi, const HierarchicalChoice& choice,
                                             const EngineConfig& config)
    : mpi_(mpi), choice_(choice),
      node_(choice.usable ? MakeNodeStage(mpi, config) : nullptr),
      cross_(mpi, mpi->cross_comm(), config.tunables.chunk_bytes) {}

void HierarchicalAllreduce::set_chunk_bytes(int64_t chunk_bytes) {
  if (node_) node_->set_chunk_bytes(chunk_bytes);
  cross_.set_chunk_bytes(chunk_bytes);
}

void HierarchicalAllreduce::Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op,
                                      const PhaseFn& phase) {
  const int local_size = mpi_->local_size(), me = mpi_->local_rank();
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  // Pieces small enough that the node allgather's counts and offsets (in
  // elements) fit MPI's ints; one piece for any realistic buffer.
  const int64_t piece = int64_t{1} << 30;
  const char* src = static_cast<const char*>(in ? in : out);
  char* dst = static_cast<char*>(out);
  for (int64_t done = 0; done < count; done += piece) {
    const int64_t n = std::min(piece, count - done);
    const ShardLayout layout = ShardLayout::Even(n, local_size);
    const int64_t mine = layout.counts[me];
    if (static_cast<int64_t>(shard_.size()) < std::max<int64_t>(1, mine) * elem)
      shard_.resize(std::max<int64_t>(1, mine) * elem);
    auto t0 = Clock::now();
    // Reads all of the piece before the allgather below writes it, so in-place works.
    node_->ReduceScatter(src + done * elem, shard_.data(), layout, dtype, op);
    if (phase) phase(node_->reducescatter_phase(), t0);
    t0 = Clock::now();
    // The members of cross_comm() share this local rank, hence this shard's size.
    if (mine > 0) cross_.Allreduce(nullptr, shard_.data(), mine, dtype, op);
    if (phase) phase("MPI_CROSS_ALLREDUCE", t0);
    t0 = Clock::now();
    node_->Allgather(shard_.data(), dst + done * elem, layout, dtype);
    if (phase) phase(node_->allgather_phase(), t0);
  }
}

}  // namespace tfmpi
