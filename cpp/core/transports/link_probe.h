// The start-up probe of the inter-node link, for TF_MPI_HIERARCHICAL=auto's
// model (hierarchical_model.h) when TF_MPI_INTER_NODE_LINK is not set.
//
// Inside a node, local ranks 0 and 1 first ping-pong a small message: the
// intra-node alpha (unless TF_MPI_INTRA_NODE_LINK is set). The hierarchical
// path pays it twice more than the flat one (its in-node phases before and
// after the cross-node one), so it decides the small sizes: about 1 us where
// each rank has a core, a scheduler's time slice where ranks share cores.
//
// Between the first two nodes, every local rank l ping-pongs with local rank l
// of the other node over its cross-node communicator, all at once: a small
// message's ping-pong gives alpha (half the round trip); a large one,
// exchanged both ways at once, the bytes per second through one node's
// network interface while all its ranks use it in both directions, as the
// flat allreduce does (beta = extra time / (ranks per node x bytes)).
// That share of the interface, and the CPU time the transport spends moving
// the bytes, is what the model's beta stands for. Alpha: the median of 15 round
// trips; beta: the mean of 9 back-to-back exchanges (a sustained rate). A few
// ms on a fast network, about 20-50 ms at 1 Gb/s.
//
// World rank 0's figures are broadcast, so every rank of the job decides with
// identical parameters (the ranks must pick the same allreduce path per size).
#pragma once

#include "common/hierarchical_model.h"
#include "transports/mpi_context.h"

namespace tfmpi {

// The probe's large message per rank: past the eager limits, short at 1 Gb/s.
constexpr int64_t kLinkProbeLargeBytes = 128 << 10;

struct LinkProbe {
  Link inter;              // what the model uses
  double intra_alpha_s = 0;  // one-way small-message time between local ranks 0 and 1; 0 with one rank per node
  double seconds = 0;      // the probe's own wall time on rank 0
  int64_t large_bytes = 0; // the large message, per rank
};

// Collective over mpi.comm(). Needs more than one node and the same number of
// ranks on every node (mpi.homogeneous()); the caller checks.
LinkProbe ProbeInterNodeLink(const MpiContext& mpi);

// Alpha and beta from the median one-way time of a small message and the
// mean time of a large exchange (`streams` ranks sending `large_bytes` each
// through one interface at once).
// Pure; a beta that the noise makes non-positive becomes one from the large
// message alone.
Link LinkFromPingPong(double small_one_way_s, int64_t small_bytes, double large_one_way_s, int64_t large_bytes,
                      int streams);

}  // namespace tfmpi

namespace tfmpi {

// With more than one real node (all alike; not nodes declared by
// TF_MPI_TOPOLOGY on one machine), TF_MPI_HIERARCHICAL=auto deciding by
// the model and no TF_MPI_INTER_NODE_LINK on some rank: probes and puts the
// result in settings->inter (inter_probed), rank 0 logging it once. Collective
// over mpi.comm() where the job has more than one node; free otherwise.
void ApplyInterNodeProbe(HierarchicalSettings* settings, const MpiContext& mpi);

}  // namespace tfmpi
