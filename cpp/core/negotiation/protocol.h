// The negotiation protocol of one rank: announces what callers submitted,
// decides (rank 0) or receives decisions, and executes the decided batches in
// rank 0's order.
//
//   worker ranks:  announce (to rank 0, or up the tree)   <-- decisions (from rank 0, or the parent)
//   rank 0:        Coordinator collects announcements, decides, sends
//   then every rank: Executor runs decisions in order (fusion, MPI), completes the requests
//
// How messages travel (star or tree) is described in negotiation_tree.h.
// The Engine (engine.h) owns the Protocol and the locks: every call here is
// made by whoever holds Engine's progress_mu_, and a Protocol takes no lock.
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/env.h"
#include "common/request.h"
#include "common/timeline.h"
#include "execution/executor.h"
#include "execution/response_cache.h"
#include "execution/watchdog.h"
#include "negotiation/autotune.h"
#include "negotiation/coordinator.h"
#include "negotiation/holdback.h"
#include "negotiation/negotiation_tree.h"
#include "negotiation/outbox.h"
#include "transports/gpu_transport.h"
#include "transports/liveness.h"
#include "transports/mpi_context.h"

namespace tfmpi {

class Protocol {
 public:
  Protocol(const MpiContext* mpi, const EngineConfig& config, const GpuTransportChoice& gpu,
           const HierarchicalChoice& hierarchical, ExecutorStats* stats, Timeline* timeline);

  // One pass: announces `fresh` (and this rank's departure if `stop_requested`),
  // decides (rank 0) or receives decisions, executes them. Returns whether
  // anything happened. `on_caller`: a caller's thread runs it, so batches larger
  // than config.inline_bytes are left for the background thread (*deferred).
  // An internal error becomes a clean stop of the protocol (see Fail), or on a
  // worker, which can no longer agree with the others, the end of the job.
  bool Step(std::deque<std::unique_ptr<Request>> fresh, bool stop_requested, bool on_caller, bool* deferred);

  // The protocol has ended on this rank (departure acknowledged, rank 0 gone or failed).
  bool done() const { return done_; }
  // Requests announced and not completed, or batches not executed yet.
  bool busy() const { return !in_flight_.empty() || !ready_.empty(); }
  // Requests announced and not completed.
  size_t in_flight() const { return in_flight_.size(); }
  bool stop_announced() const { return stop_announced_; }
  // Settings decided since the last call (kSettings), for the Engine's copy.
  std::optional<Tunables> TakeSettings() { return std::exchange(settings_, std::nullopt); }
  // Why the protocol stopped by itself (Fail, Lose), once; OK otherwise.
  Status TakeStopStatus() { return std::exchange(stop_status_, Status::OK()); }
  // A peer was lost (elastic mode, transports/peer_failure.h): the protocol has ended without a goodbye.
  bool lost() const { return lost_; }
  // Times each batch's MPI work (watchdog.h); null: not timed.
  void set_watchdog(Watchdog* w) { watchdog_ = w; }
  // The executor's hierarchical allreduce, for timing it at init before any
  // request (hierarchical_timing.h); then the window chosen from the timings.
  HierarchicalAllreduce& hierarchical_allreduce() { return executor_.hierarchical_allreduce(); }
  void set_hierarchical(const HierarchicalChoice& c) { executor_.hierarchical_allreduce().set_choice(c); }
  // The peer liveness check (liveness.h) whose declarations this protocol
  // turns into errors; null: none runs.
  void set_liveness(Liveness* l) { liveness_ = l; }
  // At exit: fails what is pending with `why`, gives peers `limit` to take the
  // last messages (Outbox::Close) and returns what never reached them.
  Outbox::Undelivered Close(const Status& why, Outbox::Clock::duration limit);

 private:
  bool StepOrThrow(std::deque<std::unique_ptr<Request>>& fresh, bool stop_requested, bool on_caller, bool* deferred);
  // 1. Announces `fresh`: to the Coordinator (rank 0), up the tree or to rank 0.
  bool Announce(std::deque<std::unique_ptr<Request>>& fresh, bool stop_requested, Clock::time_point now);
  // How this rank announces `r` (by cache id when its entry fits).
  Announcement AnnouncementOf(const Request& r) const;
  // Rank 0: what arrived from the workers (star) or the children (tree), to the Coordinator.
  bool Collect(Clock::time_point now);
  // Rank 0: one announcement by `from` (or, relayed, its origin) to the Coordinator.
  void ToCoordinator(Announcement& a, int from, Clock::time_point now);
  void SendAnnouncements(int dest, int tag, const std::vector<Announcement>& items);
  // A worker in tree mode: children's reports into the aggregate or relayed on.
  bool Aggregate(Clock::time_point now);
  // A worker in tree mode: counts one announcement of this subtree (its own or relayed).
  void Count(Announcement& a, Clock::time_point now, std::vector<Announcement>* up);
  // 2. Rank 0 decides and sends a batch; a worker receives batches (and forwards them in the tree).
  bool Decide(Clock::time_point now);
  bool Receive(Clock::time_point now);
  // One batch of decisions in bytes_ (from the parent, or from rank 0), forwarded and queued.
  void TakeBatch();
  // Sends decisions to the children (tree) or to every worker still there (star).
  void SendDecisions(const std::shared_ptr<std::vector<char>>& encoded);
  // Executes the oldest decided batch.
  void RunBatch();
  // Bytes the collectives of `batch` move on this rank (what a caller's drive bounds).
  int64_t BatchBytes(const std::vector<Decision>& batch) const;
  // Sends to `rank`, or, if it was declared unreachable, to its children in the
  // tree in its stead (recursively).
  void SendAround(int rank, const std::shared_ptr<std::vector<char>>& encoded);
  // After the first departure: the tree has a hole; from here on the star.
  void LeaveTree();
  // The liveness check declared peers unreachable. Rank 0: every rank's
  // pending and later collectives fail naming them (Coordinator::Unreachable);
  // a worker that lost rank 0: its own fail and the protocol ends here.
  void Unreachable();
  // The protocol cannot go on (an internal error while negotiating on rank 0):
  // fails what is pending here with `why`, tells the workers that no more
  // decisions come and ends the protocol on this rank.
  void Fail(const std::string& why);
  // Elastic mode, a peer lost (PeerFailure): fails what is pending here with
  // StatusCode::kUnavailable and ends the protocol without a message to
  // anyone (the communicators are revoked); init() on the ranks that remain starts again.
  void Lose(const std::string& why);
  // Negotiation messages, counted in the stats.
  void Send(int dest, int tag, std::shared_ptr<std::vector<char>> bytes);
  bool TryReceive(int source, int tag, int* from);

  const MpiContext* mpi_;
  const EngineConfig config_;
  ExecutorStats* stats_;
  const int rank_, size_;
  ResponseCache cache_;
  std::unique_ptr<Coordinator> coord_;  // rank 0 only
  Executor executor_;
  std::unique_ptr<Autotuner> tuner_;    // rank 0 with TF_MPI_AUTOTUNE set
  Holdback holdback_;                   // rank 0: runs set by the tuner
  bool holdback_gave_up_reported_ = false;
  InFlight in_flight_;
  Outbox outbox_;
  // Batches decided (rank 0) or received (workers) and not executed yet, in
  // order. Normally executed in the Step that got them; a caller leaves a
  // large one to the background thread.
  std::deque<std::vector<Decision>> ready_;
  std::vector<bool> departed_;    // rank 0: workers whose departure was acknowledged; nothing more is sent to them
  bool ack_received_ = false;     // a worker: rank 0 acknowledged its departure; nothing more comes
  bool stop_announced_ = false;   // this rank told rank 0 (or, on rank 0, the workers) it is leaving
  bool gone_sent_ = false;        // rank 0: the workers were told it stopped
  bool coordinator_gone_ = false;
  bool done_ = false;             // the protocol has ended on this rank
  Watchdog* watchdog_ = nullptr;
  Liveness* liveness_ = nullptr;
  bool unreachable_seen_ = false;  // rank 0: a worker was declared unreachable (SendDecisions)
  // A worker in the tree: when it next looks for a batch from rank 0 itself
  // (sent around an unreachable ancestor: SendDecisions). Rarely, so the
  // steady state pays one comparison.
  Clock::time_point next_root_probe_{};
  // The tree (negotiation_tree.h) until the first departure; the star after.
  // Decisions leave the tree when a batch with a departure is received (and
  // forwarded), announcements when it is executed.
  const NegotiationTree tree_;
  bool tree_decisions_;
  bool tree_announcements_;
  CachedAnnouncements aggregate_;  // a worker's subtree (tree mode)
  std::vector<Announcement> up_;   // to the parent at the end of this Step (tree mode)
  // Test hook (TF_MPI_FAULT_TRUNCATE_ANNOUNCEMENT=k): a worker cuts the last
  // byte off the k-th announcement message this process sends (once per
  // process), as a rank running an incompatible build would, so the tests can
  // show rank 0 stopping cleanly.
  int64_t truncate_announcement_ = 0;
  Clock::time_point last_stall_check_ = Clock::now();
  std::vector<char> bytes_;  // the last message received
  std::optional<Tunables> settings_;
  Status stop_status_;
  bool lost_ = false;
};

}  // namespace tfmpi
