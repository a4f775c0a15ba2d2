#include "common/hierarchical_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace tfmpi {

namespace {

double Log2Ceil(int p) { return p <= 1 ? 0.0 : std::ceil(std::log2(static_cast<double>(p))); }

// One allreduce of m bytes among p members of a level, `streams` of them sharing each link.
double LevelAllreduce(int p, const Link& link, double m, int streams) {
  if (p <= 1) return 0.0;
  const double doubling = Log2Ceil(p) * (link.alpha_s + streams * m * link.beta_s);
  const double rabenseifner =
      2 * Log2Ceil(p) * link.alpha_s + 2.0 * (p - 1) / p * streams * m * link.beta_s;
  return std::min(doubling, rabenseifner);
}

// Reduce-scatter (or allgather) of m bytes among the L ranks of a node.
double NodeHalf(int L, const Link& intra, double m) {
  return L <= 1 ? 0.0 : Log2Ceil(L) * intra.alpha_s + (L - 1.0) / L * m * intra.beta_s;
}

// "ALPHA_US,GB_PER_S", e.g. "5,12.5".
Link ParseLink(const char* name, const std::string& v) {
  const size_t comma = v.find(',');
  char* end = nullptr;
  bool ok = comma != std::string::npos;
  double alpha_us = 0, gbps = 0;
  if (ok) {
    const std::string a = v.substr(0, comma), b = v.substr(comma + 1);
    alpha_us = std::strtod(a.c_str(), &end);
    ok = !a.empty() && *end == '\0';
    gbps = std::strtod(b.c_str(), &end);
    ok = ok && !b.empty() && *end == '\0';
  }
  if (!ok || !(alpha_us >= 0) || !(gbps > 0) || !std::isfinite(alpha_us) || !std::isfinite(gbps))
    throw std::invalid_argument(std::string("tf_mpi: ") + name + "=" + v +
                                " is not ALPHA_US,GB_PER_S (latency in microseconds, bandwidth in GB/s), e.g. 5,12.5");
  return Link{alpha_us * 1e-6, 1.0 / (gbps * 1e9)};
}

std::string LinkString(const Link& l, bool given, bool probed = false) {
  std::ostringstream os;
  os << l.alpha_s * 1e6 << "us," << 1e-9 / l.beta_s << "GB/s" << (given ? "" : probed ? "(probed)" : "(default)");
  return os.str();
}

}  // namespace

std::string SizeName(int64_t b) {
  if (b == std::numeric_limits<int64_t>::max()) return "any size";
  if (b >= (1 << 20) && b % (1 << 20) == 0) return std::to_string(b >> 20) + " MiB";
  if (b >= (1 << 10) && b % (1 << 10) == 0) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

const char* HierarchicalModeName(HierarchicalMode m) {
  return m == HierarchicalMode::kOff ? "0" : m == HierarchicalMode::kOn ? "1" : "auto";
}

HierarchicalSettings HierarchicalSettings::FromEnv() {
  HierarchicalSettings s;
  const char* mode = std::getenv("TF_MPI_HIERARCHICAL");
  const std::string m = mode ? mode : "";
  if (m.empty() || m == "auto") s.mode = HierarchicalMode::kAuto;
  else if (m == "0") s.mode = HierarchicalMode::kOff;
  else if (m == "1") s.mode = HierarchicalMode::kOn;
  else throw std::invalid_argument("tf_mpi: TF_MPI_HIERARCHICAL=" + m + " is not auto, 0 or 1");
  if (const char* t = std::getenv("TF_MPI_HIERARCHICAL_THRESHOLD"); t && *t) {
    char* end = nullptr;
    const long long v = std::strtoll(t, &end, 10);
    if (*end || v < 0)
      throw std::invalid_argument(std::string("tf_mpi: TF_MPI_HIERARCHICAL_THRESHOLD=") + t +
                                  " is not a size in bytes (an integer >= 0)");
    s.threshold_bytes = v;
  }
  if (const char* v = std::getenv("TF_MPI_INTRA_NODE_LINK"); v && *v) {
    s.intra = ParseLink("TF_MPI_INTRA_NODE_LINK", v);
    s.intra_given = true;
  }
  if (const char* v = std::getenv("TF_MPI_INTER_NODE_LINK"); v && *v) {
    s.inter = ParseLink("TF_MPI_INTER_NODE_LINK", v);
    s.inter_given = true;
  }
  return s;
}

std::string HierarchicalSettings::ToString() const {
  return std::string("hierarchical=") + HierarchicalModeName(mode) +
         " hierarchical_threshold=" + std::to_string(threshold_bytes) + " intra_node_link=" +
         LinkString(intra, intra_given, intra_probed) + " inter_node_link=" + LinkString(inter, inter_given, inter_probed);
}

double FlatAllreduceSeconds(double m, int n, int L, const Link& intra, const Link& inter, FlatModel flat) {
  const int N = n * L;
  if (N <= 1) return 0.0;
  if (n <= 1) return LevelAllreduce(L, intra, m, 1);
  if (flat == FlatModel::kNodeAware && L > 1) {
    const double rooted = std::min(Log2Ceil(L) * (intra.alpha_s + m * intra.beta_s), 2 * NodeHalf(L, intra, m));
    return 2 * rooted + LevelAllreduce(n, inter, m, 1);
  }
  const double ring = 2.0 * (N - 1) * inter.alpha_s + 2.0 * (N - 1) / N * m * inter.beta_s;
  const double doubling =
      Log2Ceil(L) * (intra.alpha_s + m * intra.beta_s) + Log2Ceil(n) * (inter.alpha_s + L * m * inter.beta_s);
  const double rabenseifner = 2 * Log2Ceil(L) * intra.alpha_s + 2 * Log2Ceil(n) * inter.alpha_s +
                              2.0 * (n - 1) / n * L * m * inter.beta_s + 2.0 * (L - 1) / (n * L) * m * intra.beta_s;
  return std::min({ring, doubling, rabenseifner});
}

double HierarchicalAllreduceSeconds(double m, int n, int L, const Link& intra, const Link& inter) {
  return 2 * NodeHalf(L, intra, m) + LevelAllreduce(n, inter, m / L, L);
}

SizeWindow HierarchicalWindow(int nodes, int ranks_per_node, const Link& intra, const Link& inter, FlatModel flat) {
  SizeWindow w;
  bool inside = false;
  for (int k = 6; k <= 40; ++k) {
    const int64_t bytes = int64_t{1} << k;
    const double m = static_cast<double>(bytes);
    const bool pays = HierarchicalAllreduceSeconds(m, nodes, ranks_per_node, intra, inter) <
                      (1 - kHierarchicalMargin) * FlatAllreduceSeconds(m, nodes, ranks_per_node, intra, inter, flat);
    if (pays && !inside) {
      if (w.max_bytes > w.min_bytes) break;  // a second window: keep the first
      w.min_bytes = k == 6 ? 0 : bytes;
      inside = true;
    } else if (!pays && inside) {
      w.max_bytes = bytes;
      inside = false;
    }
  }
  if (inside) w.max_bytes = std::numeric_limits<int64_t>::max();
  return w;
}

SizeWindow WindowFromTimings(const PathTimings& t) {
  // The run of timed sizes whose summed gains are largest (none if no sum is
  // positive). A size's gain is hierarchical's saving relative to the slower
  // path, less kHierarchicalMargin (a near-tie counts against the
  // hierarchical path), and bounded to +-0.5 so that one disturbed size cannot
  // outweigh its neighbours: the window is one range, as the sizes' costs vary
  // smoothly, and an isolated win or loss inside it is taken as noise.
  const size_t n = t.bytes.size();
  std::vector<double> gain(n);
  for (size_t i = 0; i < n; ++i) {
    const double slower = std::max(t.flat_s[i], t.hierarchical_s[i]);
    const double g = slower > 0 ? (t.flat_s[i] - t.hierarchical_s[i]) / slower - kHierarchicalMargin : 0;
    gain[i] = std::max(-0.5, std::min(0.5, g));
  }
  double best = 0;
  size_t from = 0, to = 0;  // [from, to): none
  for (size_t i = 0; i < n; ++i) {
    double sum = 0;
    for (size_t j = i; j < n; ++j) {
      sum += gain[j];
      if (sum > best) best = sum, from = i, to = j + 1;
    }
  }
  SizeWindow w;  // {0, 0}: nowhere
  if (to > from) {
    w.min_bytes = from == 0 ? 0 : t.bytes[from];
    w.max_bytes = to == n ? std::numeric_limits<int64_t>::max() : t.bytes[to];
  }
  return w;
}

std::string TimingsString(const PathTimings& t) {
  std::string s;
  char one[96];
  for (size_t i = 0; i < t.bytes.size(); ++i) {
    std::snprintf(one, sizeof(one), "%s%s %.3g/%.3g ms", i ? ", " : "", SizeName(t.bytes[i]).c_str(), t.flat_s[i] * 1e3,
                  t.hierarchical_s[i] * 1e3);
    s += one;
  }
  return s;
}

}  // namespace tfmpi
