// How the engine thread waits inside a large MPI call (TF_MPI_YIELD_BYTES).
//
// Open MPI busy-polls while a collective waits for its peers. That is right
// when every rank has a core to itself, but a data-parallel rank often
// shares its core with its own backprop: a gradient group reduced while
// backprop still runs then spins on the core the compute thread needs
// (benchmarks/overlap_bench.py, 2 ranks on 2 cores: a compute thread kept
// 61-67 % of its speed beside spinning 256 KiB-8 MiB allreduces, 95 % beside
// yielding ones). Open MPI can yield the CPU whenever a progress pass finds
// nothing to do ("yield when idle") and reads that flag on every pass, so
// the engine turns it on only around calls that move at least
// TF_MPI_YIELD_BYTES and keeps small, latency-bound collectives spinning
// (unlike OMPI_MCA_mpi_yield_when_idle=1, which doubles their latency).
//
// Off by default: a yielding collective finishes later (the same benchmark:
// 20-130 ms instead of 15-40 ms beside the compute thread), which moves
// communication into the step's tail. In training on this 2-core machine the
// two effects cancelled out (docs/configuration.md, experimental settings: LSTM +2 %, MLP -1 %, medians
// of alternating launches, both within noise).
//
// The switch is Open MPI's exported opal_progress_set_yield_when_idle(),
// found at run time; with another MPI (MPICH, Intel MPI) it is absent and
// this is a no-op (their own wait settings apply).
#pragma once

#include <cstdint>

namespace tfmpi {

class YieldWhileWaiting {
 public:
  // Turns yielding on for this scope when `bytes` >= `threshold` > 0.
  YieldWhileWaiting(int64_t bytes, int64_t threshold);
  ~YieldWhileWaiting();
  YieldWhileWaiting(const YieldWhileWaiting&) = delete;
  YieldWhileWaiting& operator=(const YieldWhileWaiting&) = delete;

  // Whether this MPI lets the engine switch (Open MPI does).
  static bool Supported();

 private:
  bool active_ = false;
  bool previous_ = false;
};

}  // namespace tfmpi
