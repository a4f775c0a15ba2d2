// The engine's public header: cpp/tf and cpp/python reach the engine through
// this file (and common/). Below it the work flows through negotiation/ (what
// runs in which order), execution/ (running it) and transports/ (moving the
// bytes); includes only run that way down, to common/ (cpp/README.md has the
// rule, cpp/check_layers.py checks it).
//
// The per-process engine: callers (TensorFlow kernels, the Python binding)
// enqueue Requests from any thread and return; the negotiation protocol
// (protocol.h) announces them, agrees with the other ranks on what runs in
// which order and executes it, calling each request's `done`. This file owns
// the engine's lifecycle (Init/Shutdown), who runs the protocol when (the
// background thread's Loop and its wait policy, or a caller: Enqueue/Drive)
// and the locks.
//
// Who runs the protocol: normally the background thread. A caller that
// submits a small request runs it itself for a short while instead (Drive):
// with one core per rank, handing a 1 KiB allreduce to another thread and back
// costs more than the collective. A caller executes only batches that fit
// config().inline_bytes; a larger batch waits for the background thread.
//
// Locking rules (the only place they are written):
//  - progress_mu_: whoever holds it runs the protocol (the background thread,
//    or a caller in Drive). It guards protocol_ (all negotiation state: the
//    Protocol takes no lock of its own) and completions_. Every MPI call the
//    engine makes while it runs is made under it (Init and Shutdown call MPI
//    only while no engine thread runs), so the engine's MPI calls are
//    serialised; see MpiContext::Init for the thread level required.
//  - mu_ (taken through StateLock): guards queue_, stop_requested_,
//    stop_status_, driving_, handoff_, liveness_news_ and tunables_, and cv_
//    waits on it. It may be taken while holding progress_mu_, never the other
//    way round.
//  - The peer liveness check (liveness_, transports/liveness.h) runs a thread
//    of its own that calls MPI, on a communicator of its own, without
//    progress_mu_: MPI_THREAD_MULTIPLE allows that, and it is started only
//    where MPI provides it. That thread takes mu_ only to set liveness_news_
//    (waking the engine thread), holding no lock of its own then; the protocol
//    calls into the Liveness under progress_mu_ (Liveness's own lock is the
//    innermost).
//  - Completion callbacks (Request::done) never run under an engine lock: the
//    protocol queues them (completions_) and whoever ran the protocol calls
//    them after releasing progress_mu_ (RunCompletions), so a callback may
//    submit the next collective (TensorFlow does) or block without stopping
//    the protocol.
//  - Thread-locals (engine.cc), what the calling thread holds: tls_turn
//    (progress_mu_), tls_state_locks (how many StateLocks on mu_),
//    tls_completing (it is running completion callbacks). A request
//    submitted while tls_turn or tls_completing is set is queued for the
//    background thread instead of being driven here, so drives never nest;
//    RunCompletions counts callbacks that find tls_turn or tls_state_locks
//    set (stats: callbacks_under_lock, always 0 unless a bug).
//  - initialized_ and gpu_device_ are atomics; mpi_, config_ and gpu_choice_
//    are written only by Init, before the background thread starts.
//  - Process sets (ids > 0): each set this rank belongs to has an Engine of
//    its own, on the set's communicator, with its own thread, locks and
//    negotiation, so sets never wait on each other. The registry (engine.cc:
//    g_sets, under g_sets_mu) maps ids to engines; it is only held to look an
//    engine up, add or remove one, never while an engine runs its protocol.
//    Callers keep the shared_ptr for as long as they use the engine.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/env.h"
#include "common/request.h"
#include "common/timeline.h"
#include "execution/executor.h"
#include "execution/hierarchical.h"
#include "execution/watchdog.h"
#include "negotiation/autotune.h"
#include "negotiation/protocol.h"
#include "transports/gpu_transport.h"
#include "transports/liveness.h"
#include "transports/mpi_context.h"

namespace tfmpi {

class Engine {
 public:
  // Process sets' engines are freed once removed and no caller holds them
  // (Shutdown first); the global one never is (Get).
  ~Engine();

  // The engine of the global set (id 0).
  static Engine& Get();
  // The engine of process set `id` (0: the global one); null where `id` is
  // not registered, or registered but this rank is not in it (`*registered`
  // says which when given).
  static std::shared_ptr<Engine> ForSet(int id, bool* registered = nullptr);
  // Registers process set `id` (collective over the set's members, in the
  // same order everywhere). Members pass the set's communicator in
  // `member_comm` (has_comm; the engine duplicates it) and start an engine on
  // it; other ranks (member false) only record that the id exists.
  static Status AddSet(int id, const InitOptions& member_comm, bool member);
  // Stops and forgets set `id` (collective over its members). False if unknown or 0.
  static bool RemoveSet(int id);
  static std::vector<int> SetIds();
  // Stops every process set's engine, then the global one (what tf_mpi.shutdown() does).
  static void ShutdownAll();

  // Collective over the chosen communicator. Idempotent while initialised.
  Status Init(const InitOptions& opts);
  // Stops the background thread after telling rank 0; pending and later
  // requests fail with an error. MPI stays initialised (see Finalize).
  void Shutdown();
  // Shutdown(), then MPI_Finalize if this library initialised MPI (not in elastic mode: engine.cc).
  static void Finalize();
  // Kills the whole job (MPI_Abort); used when one rank cannot go on.
  [[noreturn]] static void Abort(int code);

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
  struct Completion { DoneCallback done; Status status; };
  using Completions = std::vector<Completion>;

  Engine();
  // Init's part from MPI on (settings: whether this rank's TF_MPI_* could be read).
  Status InitOnMpi(InitOptions opts, const Status& settings);
  void Loop();
  // One Step of the protocol with what callers queued (see Protocol::Step).
  bool RunProtocol(bool on_caller, bool* deferred);
  // Runs the protocol on the calling thread until `finished`, until config().inline_wait_us
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
  WatchdogSettings watchdog_settings_;
  Watchdog watchdog_;  // times each batch's MPI work (watchdog.h)
  Liveness liveness_;  // tells unreachable peers from slow ones (liveness.h)
  std::atomic<bool> initialized_{false};
  GpuTransportChoice gpu_choice_;
  HierarchicalChoice hierarchical_;
  mutable std::atomic<int> gpu_device_{-1};  // the GPU of this rank's first GPU request
  std::thread thread_;

  std::mutex progress_mu_;  // see the locking rules above
  std::unique_ptr<Protocol> protocol_;
  Completions completions_;  // requests' done callbacks, not yet run

  std::mutex mu_;  // see the locking rules above
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Request>> queue_;
  bool stop_requested_ = false;
  Status stop_status_;  // why Enqueue refuses work after the protocol ended on its own (Fail, Lose)
  bool driving_ = false;   // a caller is in Drive(): the background thread stays asleep
  bool handoff_ = false;   // a caller left Drive() with work in flight: the background thread takes over
  bool liveness_news_ = false;  // the liveness check declared a peer: the background thread runs a Step
  Tunables tunables_;  // a copy for callers; the executor's own copy is the one that acts
};

}  // namespace tfmpi
