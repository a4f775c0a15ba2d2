// A memory segment shared by the ranks of one node, with the flags the
// shared-memory collectives (shm_allreduce.h) synchronise through.
//
// MPI provides the memory and the process set: MPI_Win_allocate_shared over
// the node communicator (MPI_COMM_TYPE_SHARED) gives every rank an area that
// all ranks of the node can load from and store to directly
// (MPI_Win_shared_query). Each rank's area holds
//   - a control block: three monotonic step counters (kInputs, kResult,
//     kConsumed), each alone on its cache lines, the rank's pid, and an
//     "aborted" flag with a reason;
//   - `buffers` buffers of `local size` slots of `slot_bytes` each; slot p of
//     a buffer holds what this rank writes for local rank p (its input for
//     p's block, or, in slot = own rank, its own result).
//
// Writers and readers. Only the owner of an area writes to it (its slots,
// its counters, its abort flag); peers only read it. A counter is raised
// with a release store after the data it announces has been written, and a
// reader loads it with acquire before reading that data; that pairs every
// write of a slot with every later read of it (C++ release/acquire, which
// holds across processes for lock-free atomics on memory both map). On x86
// these are plain moves plus compiler barriers, which is why they are used
// instead of MPI_Win_sync (a full fence per call). The window must use MPI's
// unified memory model (public and private copies are the same memory), which
// Create checks; the epoch is opened once, MPI_Win_lock_all(MPI_MODE_NOCHECK),
// and never closed. Counters only grow, so a value can never be mistaken for
// one of an earlier step.
//
// Waiting (WaitFor) spins for a few microseconds, then yields the CPU
// (sched_yield) and after a few milliseconds sleeps in short naps, so a
// rank waiting on a descheduled peer (more ranks than cores) lets it run.
// While yielding or napping it also lets MPI progress (an MPI_Iprobe on the
// node communicator): a peer may be waiting for a message this rank has
// already handed to MPI (rank 0's decisions are sent with MPI_Isend) and
// that MPI moves only when this rank calls into it, as it would inside an
// MPI collective. While yielding or napping it checks every few milliseconds that the peers
// are alive (their pid still exists and is not a zombie) and have not given
// up (their aborted flag): a peer that died or gave up turns the wait into an
// error, this rank raises its own aborted flag so that ranks waiting on it
// stop as well, and the segment stays broken (every later call fails at
// once). The launcher normally ends such a job anyway; this makes sure no
// rank is left waiting for ever meanwhile. An optional limit
// (TF_MPI_STALL_SHUTDOWN_TIME_SECONDS) also ends a wait on a live peer.
//
// The window is never freed: MPI_Win_free is collective, and a rank leaving
// (shutdown) cannot know that its peers will call it; it is kept until
// MPI_Finalize, like the engine's communicators (mpi_context.cc). Its size
// is small (buffers x local size x slot_bytes per rank, 1 MiB by default).
//
// Not thread-safe: one thread at a time (the engine's executor) uses it.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/types.h"

namespace tfmpi {

class ShmSegment {
 public:
  enum Flag { kInputs = 0, kResult = 1, kConsumed = 2 };

  // Collective over `local` (all ranks sharing one node's memory). Returns
  // nullptr with `*why` set on every rank alike when the segment cannot be
  // used (allocation failed, the window is not in the unified model).
  // `stall_limit_s` > 0 bounds a wait on a live peer.
  static std::unique_ptr<ShmSegment> Create(MPI_Comm local, int64_t slot_bytes, int buffers, double stall_limit_s,
                                            std::string* why);
  ~ShmSegment();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int buffers() const { return buffers_; }
  int64_t slot_bytes() const { return slot_bytes_; }

  // Slot `slot` of buffer `buffer` in `owner`'s area.
  char* Slot(int owner, int buffer, int slot) const {
    return data_[owner] + (static_cast<int64_t>(buffer) * size_ + slot) * slot_bytes_;
  }
  // Raises this rank's counter `f` to `value` (release: what was written before is visible with it).
  void Publish(Flag f, uint64_t value);
  // Returns once `peer`'s counter `f` is at least `value` (acquire), or an
  // error if a peer died, gave up or the stall limit passed.
  Status WaitFor(int peer, Flag f, uint64_t value);
  // The segment cannot be used any more: tells the peers (aborted flag) and
  // fails every later call with `why`.
  void Break(const Status& why);
  const Status& broken() const { return broken_; }
  // Nanoseconds spent in WaitFor beyond its first check, since the last call.
  int64_t TakeWaitNanos() { int64_t w = wait_ns_; wait_ns_ = 0; return w; }

 private:
  struct Control;
  ShmSegment() = default;
  Control* control(int rank) const { return controls_[rank]; }
  // Whether the peers are alive and have not given up; checked while waiting.
  Status CheckPeers() const;

  // Lets MPI progress the requests this rank has pending.
  void ProgressMpi() const;

  MPI_Comm local_ = MPI_COMM_NULL;
  MPI_Win win_ = MPI_WIN_NULL;
  int rank_ = 0, size_ = 1, buffers_ = 0;
  int64_t slot_bytes_ = 0;
  double stall_limit_s_ = 0;
  std::vector<Control*> controls_;
  std::vector<char*> data_;
  std::vector<int64_t> pids_;         // each local rank's pid
  std::vector<bool> pid_visible_;     // false: another pid namespace, liveness left to the launcher
  Status broken_;
  int64_t wait_ns_ = 0;
};

}  // namespace tfmpi
