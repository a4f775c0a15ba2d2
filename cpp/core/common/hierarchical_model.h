// The settings of the hierarchical allreduce (hierarchical.h) and the
// alpha-beta model from which TF_MPI_HIERARCHICAL=auto takes the buffer sizes
// where it pays. Pure functions: no MPI.
//
// A level of the machine is a Link: `alpha_s`, the time of one message step,
// and `beta_s`, seconds per byte through the level's bottleneck: one rank's
// path to the others of its node (intra), one node's network interface (inter).
// An allreduce among p members of one level is what an MPI picks by size, the
// faster of recursive doubling, ceil(log2 p) * (alpha + s*m*beta), and
// Rabenseifner's reduce-scatter + allgather, 2*ceil(log2 p)*alpha +
// 2*(p-1)/p * s*m*beta, where m is the message and s how many such allreduces
// share each link at once. With n nodes of L ranks, N = n*L:
//   flat, node-aware   (FlatModel::kNodeAware: nodes that are real hosts, which the MPI library
//                 sees: Open MPI 5's coll/han, MPICH's SMP-aware collectives) a reduce to one
//                 rank per node, the cheaper of a binomial tree log2(L)*(alpha_l + m*beta_l)
//                 and reduce-scatter + gather 2*(log2(L)*alpha_l + (L-1)/L*m*beta_l), one
//                 allreduce of m among the n node leaders over the inter-node link (one stream
//                 per node), and a broadcast in the node, priced as the reduce;
//   flat, single-level (FlatModel::kSingleLevel: nodes the MPI does not see, TF_MPI_TOPOLOGY's
//                 pretend nodes on one host) one allreduce over all N ranks, its steps crossing nodes:
//                   ring          2(N-1)*alpha_x + 2(N-1)/N*m*beta_x (one ring edge per node's interface)
//                   doubling      log2(L)*(alpha_l + m*beta_l) + log2(n)*(alpha_x + L*m*beta_x)
//                   Rabenseifner  2log2(L)*alpha_l + 2log2(n)*alpha_x + 2(n-1)/n*L*m*beta_x
//                                 + 2(L-1)/(n*L)*m*beta_l
//                 (in the latter two, all L ranks of a node talk off-node at once), the fastest of them;
//   hierarchical  reduce-scatter in the node, log2(L)*alpha_l + (L-1)/L*m*beta_l, the same again for
//                 the allgather in the node, and between them L allreduces of m/L bytes among the n
//                 nodes at once (s = L) over the inter-node link.
// It leaves out: the reduction arithmetic, contention inside a node (ranks
// sharing cores), the MPI's exact algorithm switch points, and overlap between
// the levels. The window asks the modelled hierarchical time to beat flat's by
// kHierarchicalMargin, as timed windows do: a near-tie goes to MPI's allreduce.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tfmpi {

struct Link {
  double alpha_s;  // per message step
  double beta_s;   // per byte
};

// TF_MPI_HIERARCHICAL: 0 (never), auto (where the model says it pays), 1 (every allreduce).
enum class HierarchicalMode { kOff, kAuto, kOn };
const char* HierarchicalModeName(HierarchicalMode m);

// Defaults when no figures are given: shared memory inside a node, 100 Gb/s
// InfiniBand between nodes (round figures). With more than one node and no
// TF_MPI_INTER_NODE_LINK, the engine replaces the inter-node default by a
// start-up measurement (link_probe.h).
constexpr Link kDefaultIntraNodeLink{1e-6, 1.0 / 10e9};     // 1 us, 10 GB/s
constexpr Link kDefaultInterNodeLink{5e-6, 1.0 / 12.5e9};   // 5 us, 12.5 GB/s

struct HierarchicalSettings {
  HierarchicalMode mode = HierarchicalMode::kAuto;  // TF_MPI_HIERARCHICAL
  int64_t threshold_bytes = -1;  // TF_MPI_HIERARCHICAL_THRESHOLD: auto from this size up; -1: from the model
  Link intra = kDefaultIntraNodeLink;  // TF_MPI_INTRA_NODE_LINK=ALPHA_US,GB_PER_S
  Link inter = kDefaultInterNodeLink;  // TF_MPI_INTER_NODE_LINK=ALPHA_US,GB_PER_S
  bool intra_given = false, inter_given = false;
  bool inter_probed = false;  // inter from the start-up probe (link_probe.h), not the default
  bool intra_probed = false;  // intra's alpha from the start-up probe (its beta stays the default)
  // Whether the model's window decides (auto, no threshold): then the inter-node link matters.
  bool UsesModel() const { return mode == HierarchicalMode::kAuto && threshold_bytes < 0; }
  // Reads the variables above; throws std::invalid_argument naming a bad one.
  static HierarchicalSettings FromEnv();
  std::string ToString() const;
};

// Hierarchical must beat flat by this share to be chosen (by
// the model's window or by start-up timings): closer, the two are a
// tie, and a tie goes to MPI's own allreduce.
constexpr double kHierarchicalMargin = 0.05;

// How the MPI library's own (flat) allreduce crosses nodes (the model above).
enum class FlatModel { kNodeAware, kSingleLevel };

// Modelled seconds of one allreduce of `bytes` on nodes x ranks_per_node ranks.
double FlatAllreduceSeconds(double bytes, int nodes, int ranks_per_node, const Link& intra, const Link& inter,
                            FlatModel flat);
double HierarchicalAllreduceSeconds(double bytes, int nodes, int ranks_per_node, const Link& intra,
                                    const Link& inter);

// The sizes where the model has hierarchical faster: [min_bytes, max_bytes),
// scanned over powers of two from 64 B to 1 TiB (min_bytes 0: from the
// smallest; max_bytes INT64_MAX: no upper end; min == max: nowhere).
struct SizeWindow {
  int64_t min_bytes = 0, max_bytes = 0;
  bool Contains(int64_t bytes) const { return bytes >= min_bytes && bytes < max_bytes; }
};
SizeWindow HierarchicalWindow(int nodes, int ranks_per_node, const Link& intra, const Link& inter, FlatModel flat);

// Across real hosts auto's window comes from timing both paths at start-up
// instead (execution/hierarchical_timing.h says how and why); these are the
// figures and the pure arithmetic on them.
struct PathTimings {
  std::vector<int64_t> bytes;                  // the sizes timed, ascending
  std::vector<double> flat_s, hierarchical_s;  // seconds per size (the slowest rank's fastest call)
  double seconds = 0;                          // the timing's own wall time
};

// The window of sizes where the hierarchical path was faster, by more than
// kHierarchicalMargin over the run of sizes (the .cc says how a disturbed size
// is outvoted): from a timed size to the next timed size outside it (min_bytes
// 0 when from the smallest, max_bytes INT64_MAX when through the largest).
// Identical on every rank, as the figures are.
SizeWindow WindowFromTimings(const PathTimings& t);

// "4 KiB", "16 MiB", "1000 B"; INT64_MAX (a window's open end) is "any size".
std::string SizeName(int64_t bytes);

// "4 KiB 0.25/0.26 ms, 16 KiB ...": flat/hierarchical per size.
std::string TimingsString(const PathTimings& t);

}  // namespace tfmpi
