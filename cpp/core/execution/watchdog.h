// The MPI watchdog: ends the job when one batch of collectives has been
// inside MPI far longer than its bytes can explain.
//
// The stall inspector (coordinator.cc) covers collectives that some ranks
// never submit. Once every rank has submitted and the engine runs the MPI
// calls, a peer that stops responding without dying (a cut or dead network
// link, a stopped process, a host that froze) leaves this rank blocked inside
// MPI: Open MPI's TCP transport does not time out for many minutes, and the
// launcher sees no process exit. The watchdog notices that the batch has been
// in flight for longer than
//
//     TF_MPI_MPI_TIMEOUT_SECONDS + bytes / (TF_MPI_MPI_TIMEOUT_MB_PER_S * 1e6)
//
// (bytes: the batch's largest buffers, BatchBytes in protocol.cc), logs which
// collective and for how long, and aborts the job. The rate term keeps a large
// allreduce over a slow link from being taken for a hang: a ring allreduce
// moves about twice its bytes per rank, so 10 MB/s allows for links down to
// ~160 Mbit/s before the base time is touched at all.
//
// It cannot be an op error: the engine thread (or the caller driving it) is
// still inside the MPI call and the tensors' memory is still MPI's, so there
// is nothing to return to. Every surviving rank sees its own batch stuck, so
// each one logs the error and aborts; AbortJob (mpi_context.h) bounds MPI_Abort, which
// itself may wait on a launcher that cannot reach the lost host. In elastic
// mode it revokes the engine's communicators instead: the stuck call then
// fails here and on every rank, and the job goes on without the lost peer.
//
// Hot path: Begin and End take one uncontended mutex and read the clock
// (tens of nanoseconds against >= 10 us per collective). The monitor thread
// wakes a few times per timeout, never per collective.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace tfmpi {

struct WatchdogSettings {
  double seconds = 30.0;       // TF_MPI_MPI_TIMEOUT_SECONDS; 0 turns the watchdog off
  double mb_per_s = 10.0;      // TF_MPI_MPI_TIMEOUT_MB_PER_S: slowest rate a batch's bytes may move at
  // Throws std::invalid_argument on an unreadable value (Engine::Init agrees on it across ranks).
  static WatchdogSettings FromEnv();
  // The time one batch of `bytes` may spend inside MPI.
  std::chrono::duration<double> Limit(int64_t bytes) const;
};

class Watchdog {
 public:
  Watchdog() = default;
  ~Watchdog() { Stop(); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Starts the monitor thread (not when settings.seconds <= 0).
  void Start(const WatchdogSettings& settings);
  void Stop();

  // Around one batch's MPI work; `name` is its first collective's name,
  // `count` the number of collectives in the batch. Called by whoever runs the
  // protocol (one at a time per engine).
  void Begin(const std::string& name, size_t count, int64_t bytes);
  void End();

 private:
  using Clock = std::chrono::steady_clock;
  void Monitor();
  // Aborts the job; in elastic mode revokes the engine's communicators instead
  // (the stuck call fails on every rank, transports/peer_failure.h) and returns.
  void Expire(const std::string& what, double waited_s, double limit_s);

  WatchdogSettings settings_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool running_ = false;
  bool in_flight_ = false;
  Clock::time_point started_;
  Clock::duration limit_{};
  std::string name_;
  size_t count_ = 0;
  int64_t bytes_ = 0;
  std::thread thread_;
};

// Begin/End for a scope (End also when the MPI work throws).
class WatchdogScope {
 public:
  WatchdogScope(Watchdog* w, const std::string* name, size_t count, int64_t bytes) : w_(w) {
    if (w_) w_->Begin(*name, count, bytes);
  }
  ~WatchdogScope() {
    if (w_) w_->End();
  }
  WatchdogScope(const WatchdogScope&) = delete;
  WatchdogScope& operator=(const WatchdogScope&) = delete;

 private:
  Watchdog* w_;
};

}  // namespace tfmpi
