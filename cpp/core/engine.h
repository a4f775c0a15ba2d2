// The per-process engine: callers (TensorFlow kernels, the Python binding)
// enqueue Requests from any thread and return; the protocol announces them to
// rank 0, executes rank 0's decisions and calls each request's `done`.
//
//   caller threads --Enqueue--> queue --> Step() (whoever holds progress_mu_)
//        worker ranks:  announce (Isend to rank 0)  <-- decisions (from rank 0)
//        rank 0:        Coordinator collects announcements, decides, sends
//   then every rank: Executor runs decisions in order (fusion, MPI), done(status)
//
// Step() is normally run by the background thread. A caller that submits a
// small request runs it itself for a short while instead (see Drive): with
// one core per rank, handing a 1 KiB allreduce to another thread and back
// costs more than the collective. A caller executes only batches that fit
// config().inline_bytes; a larger batch waits for the background thread.
//
// Completion callbacks (Request::done) never run under an engine lock: the
// protocol queues them (completions_) and whoever ran the protocol calls them
// after releasing progress_mu_, so a callback may submit the next collective
// (TensorFlow does) or block without stopping the protocol.
//
// Thread safety of MPI: every MPI call the engine makes while it runs is made
// by whoever holds progress_mu_ (Step, the final drain in Loop); Init and
// Shutdown call MPI only while no engine thread runs. So the engine's own MPI
// calls are serialised; see MpiContext::Init for the thread level required.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "env.h"
#include "autotune.h"
#include "executor.h"
#include "gpu_transport.h"
#include "hierarchical.h"
#include "mpi_context.h"
#include "request.h"
#include "timeline.h"

namespace tfmpi {

class Engine {
 public:
  static Engine& Get();

  // Collective over the chosen communicator. Idempotent while initialised.
  Status Init(const InitOptions& opts);
  // Stops the background thread after telling rank 0; pending and later
  // requests fail with an error. MPI stays initialised (see Finalize).
  void Shutdown();
  // Shutdown(), then MPI_Finalize if this library initialised MPI.
  static void Finalize();
  // Kills the whole job (MPI_Abort); used when one rank cannot go on.
  static void Abort(int code);

  bool initialized() const { return initialized_.load(); }
  const MpiContext& mpi() const { return mpi_; }
  const EngineConfig& config() const { return config_; }
  // The settings in use now: config().tunables until the autotuner changes them.
  Tunables tunables() {
    std::lock_guard<std::mutex> lock(mu_);
    return tunables_;
  }

  // Queues `r`. On an immediate error (bad arguments, not initialised) returns
  // it and does not call r->done; otherwise r->done is called exactly once.
  Status Enqueue(std::unique_ptr<Request> r);

  const ExecutorStats& stats() const { return stats_; }
  // How GPU tensors reach MPI in this process (chosen at Init; gpu_transport.h).
  const GpuTransportChoice& gpu_transport() const { return gpu_choice_; }
  // Where allreduces use the hierarchical scheme (chosen at Init; hierarchical.h).
  const HierarchicalChoice& hierarchical() const { return hierarchical_; }

  // Rank 0 writes the timeline; on other ranks these do nothing.
  Status StartTimeline(const std::string& path);
  void StopTimeline() { timeline_.Stop(); }

 private:
  struct Protocol;  // the protocol's state; touched only under progress_mu_ (engine.cc)
  struct Completion { DoneCallback done; Status status; };
  using Completions = std::vector<Completion>;

  Engine();
  ~Engine();
  void Loop();
  // One pass of the protocol: announce what was submitted, decide (rank 0) or
  // receive decisions, execute them. Returns whether anything happened.
  // `on_caller`: a caller runs it (Drive), so batches larger than
  // config().inline_bytes are left for the background thread (*deferred).
  bool Step(Protocol& p, bool on_caller, bool* deferred);
  // Step() that turns an exception into a clean stop of the protocol (Fail).
  bool SafeStep(Protocol& p, bool on_caller, bool* deferred);
  // Executes the oldest decided batch.
  void RunBatch(Protocol& p);
  // Bytes the collectives of `batch` move on this rank (what Drive bounds).
  int64_t BatchBytes(const Protocol& p, const std::vector<Decision>& batch) const;
  // The protocol cannot go on (an internal error while negotiating): fails
  // what is pending here with `why`, tells the peers (rank 0: no more
  // decisions; a worker: it leaves) and ends the protocol on this rank.
  void Fail(Protocol& p, const std::string& why);
  // Runs Step() on the calling thread until `finished`, until config().inline_wait_us
  // pass without progress, until a batch too large for a caller is next or the
  // drive's time is up; then hands what is left to the background thread.
  void Drive(std::unique_lock<std::mutex> turn, const std::atomic<bool>& finished);
  // Under progress_mu_: the callbacks queued so far, to run after releasing it.
  Completions TakeCompletions();
  // Runs callbacks; the caller holds no engine lock.
  void RunCompletions(Completions& list);
  Status Validate(const Request& r) const;

  MpiContext mpi_;
  ExecutorStats stats_;
  Timeline timeline_;
  EngineConfig config_{};
  std::atomic<bool> initialized_{false};
  GpuTransportChoice gpu_choice_;
  HierarchicalChoice hierarchical_;
  mutable std::atomic<int> gpu_device_{-1};  // the GPU of this rank's first GPU request
  std::thread thread_;

  std::unique_ptr<Protocol> protocol_;
  // Whoever holds it runs Step(): the background thread, or a caller in Drive().
  std::mutex progress_mu_;
  Completions completions_;  // guarded by progress_mu_: requests' done callbacks, not yet run

  std::mutex mu_;  // guards the fields below
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Request>> queue_;
  bool stop_requested_ = false;
  std::string stop_reason_;  // why Enqueue refuses work after the protocol ended on its own (Fail)
  bool driving_ = false;   // a caller is in Drive(): the background thread stays asleep
  bool handoff_ = false;   // a caller left Drive() with work in flight: the background thread takes over
  Tunables tunables_;  // a copy for callers; the executor's own copy is the one that acts
};

}  // namespace tfmpi
