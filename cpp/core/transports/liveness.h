// The peer liveness check: tells a peer that cannot be reached (a cut network
// link, a host that froze, a stopped process) from one that is merely slow.
//
// The MPI watchdog (execution/watchdog.h) covers a rank blocked inside an MPI
// call. A cut that comes while the ranks negotiate leaves no one inside MPI:
// rank 0 waits for the cut-off rank's announcement and the other ranks wait
// for rank 0's decision, and the stall inspector cannot tell a rank that is
// gone from one whose Python side is computing for a long time (it waits
// forever by default, as it must for a slow rank). This check can tell them
// apart, because it does not depend on what the user's code submits:
//
//  - Each engine runs a thread of its own (started by Engine::Init) that every
//    `interval` (min(1 s, timeout / 6)) sends a one-int heartbeat on a
//    communicator used for nothing else (MpiContext::liveness_comm, so a
//    heartbeat never matches a negotiation receive): a worker to rank 0, rank 0
//    to every worker. It then reads the heartbeats that arrived.
//  - Rank 0 declares worker r unreachable when nothing came from r for
//    `timeout` (TF_MPI_PEER_TIMEOUT_SECONDS); a worker declares rank 0
//    unreachable likewise. The check runs between `timeout` and `timeout` +
//    2 x `interval` after the last heartbeat that arrived.
//  - A rank whose Python side is busy, whose engine thread is inside a long
//    MPI call, or whose completion callbacks block keeps sending: this thread
//    depends on none of them. A stopped process (SIGSTOP) sends nothing and is
//    declared unreachable after the timeout, as a frozen host would be. Its
//    own thread, when it runs again after more than half the timeout, counts
//    its peers' silence from then on (it saw nothing meanwhile), so a job
//    stopped and resumed as a whole declares no one.
//  - A declaration only records the rank and wakes the engine (`wake`); the
//    protocol (negotiation/protocol.cc) turns it into errors: rank 0 fails
//    every pending and later collective on every rank, naming the rank (the
//    path of a rank that called shutdown()); a worker that lost rank 0 fails
//    its own. A rank sends only to the peers it still watches, so a worker
//    that declared rank 0 falls silent, and rank 0, if it is alive after all,
//    declares that worker in turn and fails the rest.
//  - Ranks that left on purpose are forgotten (Forget): a worker whose
//    shutdown() rank 0 acknowledged, rank 0 once a worker learned it stopped.
//
// Not in elastic mode (ULFM's own detector covers it: peer_failure.h) and not
// where MPI lacks MPI_THREAD_MULTIPLE: this thread calls MPI beside the
// engine's (MpiContext::Init), which MPI_THREAD_SERIALIZED forbids.
//
// Hot path: none. The protocol reads one atomic per step (news()); this
// thread wakes every `interval`, sends O(1) messages on a worker and N-1 on
// rank 0.
//
// Locking: mu_ guards everything below it in the class except news_ (an
// atomic the protocol may read without it) and the thread's own MPI state
// (requests_, last_heard_: only the thread touches them). `wake` is called
// without mu_ held, so it may take the engine's locks.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tfmpi {

class Liveness {
 public:
  using Clock = std::chrono::steady_clock;

  Liveness() = default;
  ~Liveness() { Stop(); }
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;

  // Starts the thread on `comm` (this rank is `rank` of `size`), unless
  // timeout_s <= 0 or size == 1. `wake` is called after a declaration.
  void Start(MPI_Comm comm, int rank, int size, double timeout_s, std::function<void()> wake);
  // Stops the thread; heartbeats not yet delivered are cancelled (or, where MPI
  // cannot cancel a send, freed: their buffer is static).
  void Stop();

  bool running() const { return thread_.joinable(); }
  double timeout_s() const { return timeout_s_; }
  // Something was declared since the last TakeUnreachable (one relaxed load).
  bool news() const { return news_.load(std::memory_order_relaxed); }
  // The ranks declared unreachable since the last call, ascending.
  std::vector<int> TakeUnreachable();
  // Stop watching `rank` and sending to it: it left on purpose.
  void Forget(int rank);

 private:
  void Run();
  // Sends one heartbeat to `peer` unless the previous one is still in flight.
  void Beat(int peer);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  double timeout_s_ = 0;
  Clock::duration interval_{};
  std::function<void()> wake_;
  std::thread thread_;
  std::atomic<bool> news_{false};
  // The thread's own: the heartbeat in flight to each peer, when each was last heard.
  std::vector<MPI_Request> requests_;
  std::vector<Clock::time_point> last_heard_;

  std::mutex mu_;  // see "Locking" above
  std::condition_variable cv_;
  bool running_ = false;
  std::vector<bool> watched_;   // peers still expected to send
  std::vector<int> declared_;   // declared and not taken yet
};

}  // namespace tfmpi
