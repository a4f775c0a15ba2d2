#include "transports/link_probe.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "common/logging.h"

namespace tfmpi {

namespace {

constexpr int64_t kSmallBytes = 8;
constexpr int64_t kLargeBytes = kLinkProbeLargeBytes;
constexpr int kSmallTrips = 15, kLargeTrips = 9;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median one-way time of `trips` round trips of `bytes` between ranks 0 and 1 of `comm` (one warm-up trip).
double PingPong(MPI_Comm comm, int rank, std::vector<char>& buf, int64_t bytes, int trips) {
  std::vector<double> t;
  const int peer = 1 - rank;
  for (int i = 0; i <= trips; ++i) {
    const double t0 = MPI_Wtime();
    if (rank == 0) {
      MPI_Send(buf.data(), static_cast<int>(bytes), MPI_BYTE, peer, 0, comm);
      MPI_Recv(buf.data(), static_cast<int>(bytes), MPI_BYTE, peer, 0, comm, MPI_STATUS_IGNORE);
    } else {
      MPI_Recv(buf.data(), static_cast<int>(bytes), MPI_BYTE, peer, 0, comm, MPI_STATUS_IGNORE);
      MPI_Send(buf.data(), static_cast<int>(bytes), MPI_BYTE, peer, 0, comm);
    }
    if (i > 0) t.push_back((MPI_Wtime() - t0) / 2);
  }
  return Median(t);
}

// Mean time of `trips` back-to-back exchanges of `bytes` both ways at once
// between cross ranks 0 and 1 (one warm-up): an allreduce's traffic runs in
// both directions, and a large one sees the sustained rate, with the network's
// burst allowance spent and the CPU's pauses included, which a median of short
// exchanges would leave out.
double Exchange(MPI_Comm cross, int cross_rank, std::vector<char>& out, std::vector<char>& in, int64_t bytes,
                int trips) {
  const int peer = 1 - cross_rank;
  double t0 = 0;
  for (int i = 0; i <= trips; ++i) {
    if (i == 1) t0 = MPI_Wtime();
    MPI_Sendrecv(out.data(), static_cast<int>(bytes), MPI_BYTE, peer, 1, in.data(), static_cast<int>(bytes), MPI_BYTE,
                 peer, 1, cross, MPI_STATUS_IGNORE);
  }
  return (MPI_Wtime() - t0) / trips;
}

}  // namespace

Link LinkFromPingPong(double small_s, int64_t small_bytes, double large_s, int64_t large_bytes, int streams) {
  const double node_bytes = static_cast<double>(large_bytes) * std::max(1, streams);
  double beta = (large_s - small_s) / (node_bytes - static_cast<double>(small_bytes) * std::max(1, streams));
  if (!(beta > 0)) beta = large_s / node_bytes;
  return Link{std::max(0.0, small_s), beta};
}

LinkProbe ProbeInterNodeLink(const MpiContext& mpi) {
  LinkProbe p;
  p.large_bytes = kLargeBytes;
  const auto start = std::chrono::steady_clock::now();
  double figures[3] = {0, 0, 0};  // one-way seconds: small, large across nodes; small inside a node
  MPI_Barrier(mpi.comm());
  if (mpi.local_size() > 1 && mpi.local_rank() < 2) {  // every node at once, as the in-node phases run
    std::vector<char> small(kSmallBytes);
    figures[2] = PingPong(mpi.node_comm(), mpi.local_rank(), small, kSmallBytes, kSmallTrips);
  }
  MPI_Barrier(mpi.comm());
  if (mpi.cross_rank() < 2) {  // the first two nodes; the others wait in the broadcast
    std::vector<char> out(kLargeBytes, 1), in(kLargeBytes);
    figures[0] = PingPong(mpi.cross_comm(), mpi.cross_rank(), out, kSmallBytes, kSmallTrips);
    MPI_Barrier(mpi.node_comm());  // the node's ranks send their large messages together
    figures[1] = Exchange(mpi.cross_comm(), mpi.cross_rank(), out, in, kLargeBytes, kLargeTrips);
  }
  MPI_Bcast(figures, 3, MPI_DOUBLE, 0, mpi.comm());
  p.inter = LinkFromPingPong(figures[0], kSmallBytes, figures[1], kLargeBytes, mpi.local_size());
  p.intra_alpha_s = figures[2];
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return p;
}

}  // namespace tfmpi

namespace tfmpi {

void ApplyInterNodeProbe(HierarchicalSettings* s, const MpiContext& mpi) {
  // homogeneous(), cross_size() and the topology's source are the same on every
  // rank, so all or none get past here. Nodes declared by TF_MPI_TOPOLOGY share
  // one machine: nothing crosses a network, the model keeps its figures.
  if (!mpi.homogeneous() || mpi.cross_size() <= 1 || mpi.nodes_declared()) return;
  // Ranks may differ in their variables (AgreeOnChoice reports that after); the
  // probe is collective, so it runs where any rank needs it.
  int need = s->UsesModel() && !s->inter_given ? 1 : 0, any = 0;
  MPI_Allreduce(&need, &any, 1, MPI_INT, MPI_MAX, mpi.comm());
  if (!any) return;
  const LinkProbe p = ProbeInterNodeLink(mpi);
  if (!need) return;
  s->inter = p.inter;
  s->inter_probed = true;
  if (!s->intra_given && p.intra_alpha_s > 0) {
    s->intra.alpha_s = p.intra_alpha_s;
    s->intra_probed = true;
  }
  if (mpi.rank() == 0) {
    char line[384];
    std::snprintf(line, sizeof(line),
                  "inter-node link measured at start-up: %.1f us per message, %.3g GB/s per node (%d rank(s) x "
                  "%lld KiB at once), in %.0f ms; TF_MPI_INTER_NODE_LINK=%.1f,%.3g sets it instead",
                  p.inter.alpha_s * 1e6, 1e-9 / p.inter.beta_s, mpi.local_size(),
                  static_cast<long long>(p.large_bytes >> 10), p.seconds * 1e3, p.inter.alpha_s * 1e6,
                  1e-9 / p.inter.beta_s);
    std::string text = line;
    if (s->intra_probed) {
      std::snprintf(line, sizeof(line), "; inside a node %.1f us per message (TF_MPI_INTRA_NODE_LINK sets it)",
                    s->intra.alpha_s * 1e6);
      text += line;
    }
    LogInfo(text);
  }
}

}  // namespace tfmpi
