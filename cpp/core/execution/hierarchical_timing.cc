#include "execution/hierarchical_timing.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <thread>

#include "common/env.h"
#include "transports/collectives.h"

namespace tfmpi {

namespace {

// Timed calls per path and size (plus one warm-up each): more where a call is short.
int CallsFor(int64_t bytes) { return bytes <= (256 << 10) ? 7 : 3; }

}  // namespace

PathTimings TimeAllreducePaths(const MpiContext& mpi, HierarchicalAllreduce& hierarchical, int64_t chunk_bytes) {
  // Test hook (TF_MPI_FAULT_STALL_STARTUP_TIMING=r): rank r stops responding here, as a host
  // frozen or cut off during init() would; the others wait inside MPI until the watchdog, which
  // the engine arms around this timing, ends the job (tests/test_hierarchical_auto.py).
  if (EnvInt("TF_MPI_FAULT_STALL_STARTUP_TIMING", -1) == mpi.rank()) std::this_thread::sleep_for(std::chrono::hours(1));
  PathTimings t;
  const auto start = std::chrono::steady_clock::now();
  const Collectives flat(&mpi, chunk_bytes);
  std::vector<float> in, out;  // grown with the sizes: a fast network times up to kTimingLargestBytes
  double spent = 0;  // from the reduced (identical) times, so every rank stops at the same size
  for (int64_t bytes = kTimingSmallestBytes; bytes <= kTimingLargestBytes; bytes *= 4) {
    const int64_t count = bytes / static_cast<int64_t>(sizeof(float));
    in.resize(count, 1.0f);
    out.resize(count);
    auto run = [&](bool hier) {
      MPI_Barrier(mpi.comm());
      const double t0 = MPI_Wtime();
      if (hier) hierarchical.Allreduce(in.data(), out.data(), count, DataType::kFloat32, ReduceOp::kSum, nullptr);
      else flat.Allreduce(in.data(), out.data(), count, DataType::kFloat32, ReduceOp::kSum);
      return MPI_Wtime() - t0;
    };
    run(false);
    run(true);
    const int calls = CallsFor(bytes);
    std::vector<double> mine(2 * calls), slowest(2 * calls);
    for (int i = 0; i < calls; ++i) {
      mine[2 * i] = run(false);
      mine[2 * i + 1] = run(true);
    }
    MPI_Allreduce(mine.data(), slowest.data(), 2 * calls, MPI_DOUBLE, MPI_MAX, mpi.comm());
    // The fastest call of each path: a busy machine only ever adds time (a
    // descheduled rank, a late wake-up), so the minimum is what the path costs.
    double flat_s = slowest[0], hier_s = slowest[1];
    for (int i = 1; i < calls; ++i) {
      flat_s = std::min(flat_s, slowest[2 * i]);
      hier_s = std::min(hier_s, slowest[2 * i + 1]);
    }
    t.bytes.push_back(bytes);
    t.flat_s.push_back(flat_s);
    t.hierarchical_s.push_back(hier_s);
    spent += (calls + 1) * (flat_s + hier_s);
    // The next size's calls take about 4x as long (bandwidth-bound sizes; less below).
    if (bytes < kTimingLargestBytes && spent + 4 * (CallsFor(bytes * 4) + 1) * (flat_s + hier_s) > kTimingBudgetSeconds)
      break;
  }
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return t;
}

}  // namespace tfmpi

namespace tfmpi {

bool WantsPathTimings(const HierarchicalSettings& s, const MpiContext& mpi, const HierarchicalChoice& choice) {
  // usable, cross_size() and the topology's source are the same on every rank:
  // all or none get past here, and then all take part in the reduction.
  if (!choice.usable || mpi.nodes_declared()) return false;
  int need = s.UsesModel() && !s.inter_given ? 1 : 0, any = 0;
  MPI_Allreduce(&need, &any, 1, MPI_INT, MPI_MAX, mpi.comm());
  return any != 0;
}

}  // namespace tfmpi
