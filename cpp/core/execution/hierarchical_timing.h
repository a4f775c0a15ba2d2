// TF_MPI_HIERARCHICAL=auto across real hosts: the sizes that go hierarchical
// are those where the hierarchical allreduce was faster than the flat one when
// both were timed at start-up, on this job's ranks and network.
//
// Why timing and not the alpha-beta model (hierarchical_model.h): on
// block-placed ranks the hierarchical allreduce moves the same bytes across
// nodes as a flat Rabenseifner allreduce that pairs ranks of its own node
// first, and the MPI's own allreduce is often node-aware already (Open MPI 5's
// coll/han, MPICH's SMP collectives). Which is faster then depends on the
// MPI's algorithm at each size, on how many streams a node needs to fill its
// link and on the CPU each stream costs, none of which the model knows. On a
// 2x2 cluster of pretend hosts, 1 Gb/s links, Open MPI 5's flat allreduce was
// 1.3-1.9x faster than the hierarchical one at 4-16 MiB while the model chose
// the hierarchical one; unlimited, the hierarchical one was 1.1-1.4x faster.
//
// What is timed: float32 Sum allreduces of 4 KiB, 16 KiB, ... (x4) through the
// engine's own two paths (Collectives::Allreduce over all ranks; the
// HierarchicalAllreduce), alternating, after one warm-up call each, each call
// after a barrier, the slowest rank's time counting; the fastest of 7 calls
// (to 256 KiB) or 3 (larger) per path and size. Sizes grow while the next
// one's calls are projected to fit in what is left of kTimingBudgetSeconds
// (on the test bed: 0.45-0.58 s at 1 Gb/s, 0.33-1.4 s unlimited); sizes
// beyond the largest timed one take its winner. All ranks reduce their times
// together after each size, so they stop at the same size and derive the same
// window (WindowFromTimings, hierarchical_model.h). The engine skips the
// timing in process sets and in elastic mode (engine.cc says why).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/env.h"
#include "common/hierarchical_model.h"
#include "execution/hierarchical.h"
#include "transports/mpi_context.h"

namespace tfmpi {

// Whether this job times the two paths: more than one real host (not nodes
// declared by TF_MPI_TOPOLOGY), the hierarchical allreduce usable, and on some
// rank auto deciding by size without TF_MPI_INTER_NODE_LINK (a given link asks
// for the model). Collective over mpi.comm() where `choice` is usable: the
// same answer on every rank.
bool WantsPathTimings(const HierarchicalSettings& settings, const MpiContext& mpi, const HierarchicalChoice& choice);

// Collective over mpi.comm(), before the engine's first request: times
// `hierarchical` (the executor's own, usable, whatever its window) against
// the flat allreduce in calls of `chunk_bytes`.
PathTimings TimeAllreducePaths(const MpiContext& mpi, HierarchicalAllreduce& hierarchical, int64_t chunk_bytes);

constexpr double kTimingBudgetSeconds = 1.0;
constexpr int64_t kTimingSmallestBytes = 4 << 10, kTimingLargestBytes = 64 << 20;

}  // namespace tfmpi
