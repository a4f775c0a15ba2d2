#include "negotiation/protocol.h"

#include <cstdio>
#include <utility>

#include "common/logging.h"
#include "negotiation/wire.h"
#include "transports/peer_failure.h"

namespace tfmpi {

namespace {

constexpr int kTagAnnounce = 7101;  // to rank 0 directly (star)
constexpr int kTagDecide = 7102;    // decisions, from rank 0 or the parent
constexpr int kTagReport = 7103;    // announcements up the tree, to the parent

const char* const kCoordinatorGoneError =
    "tf_mpi: rank 0 called shutdown() or stopped after an error (see its log); no more collectives can run";

void FailAll(InFlight* in_flight, const Status& why) {
  for (auto& [name, r] : *in_flight) r->done(why);
  in_flight->clear();
}

// How long a partial aggregate waits before it is sent on as it is (so that
// rank 0 can name the ranks a stalled collective waits for): a quarter of the
// stall-check time, or of the stall-shutdown time when only that is set.
Clock::duration FlushAfter(const EngineConfig& c) {
  double s = 0;
  for (double t : {c.stall_check_s, c.stall_shutdown_s})
    if (t > 0) s = s > 0 ? std::min(s, t) : t;
  if (s <= 0) s = 60;  // no stall reports: partial aggregates are never needed; flush rarely anyway
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s / 4));
}

bool HasDeparture(const std::vector<Decision>& batch) {
  for (const Decision& d : batch)
    if (d.kind == Decision::Kind::kShutdownAck) return true;
  return false;
}

}  // namespace

Protocol::Protocol(const MpiContext* mpi, const EngineConfig& config, const GpuTransportChoice& gpu,
                   const HierarchicalChoice& hierarchical, ExecutorStats* stats, Timeline* timeline)
    : mpi_(mpi), config_(config), stats_(stats), rank_(mpi->rank()), size_(mpi->size()),
      cache_(static_cast<size_t>(config.cache_capacity)), executor_(mpi, config, gpu, hierarchical, stats, timeline),
      tree_(mpi->rank(), mpi->size()), tree_decisions_(config.negotiation_tree),
      tree_announcements_(config.negotiation_tree), aggregate_(tree_, FlushAfter(config)) {
  if (rank_ == 0)
    coord_ = std::make_unique<Coordinator>(size_, &cache_, config.stall_check_s, config.stall_shutdown_s, timeline);
  if (rank_ == 0 && config.autotune != AutotuneScope::kOff)
    tuner_ = std::make_unique<Autotuner>(config.tunables, config.autotune_steps, config.autotune,
                                         !executor_.direct_bytes_inert());
  departed_.assign(size_, false);
  if (rank_ != 0) truncate_announcement_ = EnvInt("TF_MPI_FAULT_TRUNCATE_ANNOUNCEMENT", 0);
}

void Protocol::Send(int dest, int tag, std::shared_ptr<std::vector<char>> bytes) {
  ++stats_->negotiation_msgs_sent;
  stats_->negotiation_bytes_sent += static_cast<int64_t>(bytes->size());
  outbox_.Send(mpi_->comm(), dest, tag, std::move(bytes));
}

bool Protocol::TryReceive(int source, int tag, int* from) {
  if (!tfmpi::TryReceive(mpi_->comm(), source, tag, &bytes_, from)) return false;
  ++stats_->negotiation_msgs_received;
  stats_->negotiation_bytes_received += static_cast<int64_t>(bytes_.size());
  return true;
}

bool Protocol::Step(std::deque<std::unique_ptr<Request>> fresh, bool stop_requested, bool on_caller, bool* deferred) {
  try {
    return StepOrThrow(fresh, stop_requested, on_caller, deferred);
  } catch (const PeerFailure& e) {
    Lose(e.what());
    for (auto& r : fresh)
      if (r) r->done(stop_status_);
    return true;
  } catch (const std::exception& e) {
    if (rank_ != 0) {
      // A worker that cannot read the negotiation no longer knows which
      // collectives the others run; they may be inside one with it already.
      LogError(std::string("internal error in the negotiation with rank 0: ") + e.what() +
               "; this rank can no longer agree with the others on what to run: aborting the job");
      AbortJob(1);
    }
    // Rank 0 fails while reading announcements or deciding: every decision
    // it sent has been executed here (Fail runs the rest), so the workers
    // wait in no collective and can be told to stop.
    Fail(e.what());
    for (auto& r : fresh)
      if (r) r->done(stop_status_);
    return true;
  }
}

bool Protocol::StepOrThrow(std::deque<std::unique_ptr<Request>>& fresh, bool stop_requested, bool on_caller,
                           bool* deferred) {
  const Clock::time_point now = Clock::now();
  bool progressed = false;
  // Rank 0: before deciding, so that this Step's batch carries the errors.
  if (rank_ == 0 && liveness_ && liveness_->news()) {
    Unreachable();
    progressed = true;
  }
  progressed = Announce(fresh, stop_requested, now) || progressed;
  if (rank_ == 0) {
    progressed = Decide(now) || progressed;
  } else {
    progressed = Aggregate(now) || progressed;
    progressed = Receive(now) || progressed;
  }
  // Every rank executes the batches in order. A caller's thread runs only
  // batches that fit the inline size; a larger one is left to the engine thread.
  while (!ready_.empty() && !done_) {
    if (on_caller) {
      const int64_t bytes = BatchBytes(ready_.front());
      if (bytes > config_.inline_bytes) {
        *deferred = true;
        break;
      }
      ++stats_->inline_batches;
      if (bytes > stats_->inline_max_batch_bytes.load()) stats_->inline_max_batch_bytes.store(bytes);
    }
    RunBatch();
    progressed = true;
  }
  // A worker: after what arrived, so that rank 0's goodbye, if it came, is seen first.
  if (rank_ != 0 && liveness_ && liveness_->news() && !done_) {
    Unreachable();
    progressed = true;
  }
  outbox_.Reap();
  return progressed;
}

Announcement Protocol::AnnouncementOf(const Request& r) const {
  Announcement a;
  if (auto id = cache_.Lookup(r.meta, rank_)) {
    a.kind = Announcement::Kind::kCached;
    a.cache_id = *id;
  } else {
    a.meta = r.meta;
    a.origin = rank_;
  }
  return a;
}

bool Protocol::Announce(std::deque<std::unique_ptr<Request>>& fresh, bool stop_requested, Clock::time_point now) {
  bool progressed = false;
  std::vector<Announcement> outgoing;
  for (auto& r : fresh) {
    progressed = true;
    const std::string name = r->meta.name;
    if (coordinator_gone_) {
      std::exchange(r, nullptr)->done(Status::Aborted(kCoordinatorGoneError));
      continue;
    }
    if (in_flight_.count(name)) {
      std::exchange(r, nullptr)->done(Status::Invalid(
          "tf_mpi: a collective named '" + name +
          "' is already in flight on this rank; concurrent collectives need distinct names"));
      continue;
    }
    Announcement a = AnnouncementOf(*r);
    in_flight_.emplace(name, std::move(r));
    if (rank_ != 0) outgoing.push_back(std::move(a));
    else if (a.kind == Announcement::Kind::kCached) coord_->AnnounceCached(RankRanges::Of(0, 1), a.cache_id, now);
    else coord_->Announce(0, std::move(a.meta), now);
  }
  fresh.clear();
  if (stop_requested && !stop_announced_) {
    stop_announced_ = progressed = true;
    if (rank_ != 0 && coordinator_gone_) done_ = true;
    else if (rank_ != 0) outgoing.push_back({Announcement::Kind::kShutdown, {}, 0, rank_, {}});
  }
  if (outgoing.empty()) return progressed;
  if (tree_announcements_) {
    for (Announcement& a : outgoing) Count(a, now, &up_);  // sent with the children's reports (Aggregate)
  } else {
    SendAnnouncements(0, kTagAnnounce, outgoing);
  }
  return progressed;
}

void Protocol::SendAnnouncements(int dest, int tag, const std::vector<Announcement>& items) {
  auto bytes = std::make_shared<std::vector<char>>(Encode(items));
  static int64_t sent_by_this_process = 0;  // only the protocol's holder gets here
  if (++sent_by_this_process == truncate_announcement_) bytes->pop_back();
  Send(dest, tag, std::move(bytes));
}

void Protocol::Count(Announcement& a, Clock::time_point now, std::vector<Announcement>* up) {
  switch (a.kind) {
    case Announcement::Kind::kCached: aggregate_.AddCached(a.cache_id, RankRanges::Of(rank_, rank_ + 1), now); break;
    case Announcement::Kind::kCachedRanges: aggregate_.AddCached(a.cache_id, a.ranks, now); break;
    case Announcement::Kind::kFull:
      if (a.meta.type == CollectiveType::kJoin) aggregate_.Joined(a.origin);
      else if (auto id = cache_.IdOf(a.meta.name)) aggregate_.AddFull(*id, a.origin, now);
      up->push_back(std::move(a));
      break;
    case Announcement::Kind::kShutdown: up->push_back(std::move(a)); break;
  }
}

bool Protocol::Aggregate(Clock::time_point now) {
  if (!config_.negotiation_tree) return false;
  bool progressed = false;
  int from = 0;
  std::vector<Announcement> items;
  // Children may report cache ids that the batches still waiting in ready_
  // create: read reports only once those have run here.
  while (!tree_.children.empty() && ready_.empty() && TryReceive(MPI_ANY_SOURCE, kTagReport, &from)) {
    progressed = true;
    if (!tree_announcements_) continue;  // late, after the tree was left: its origin re-announced it directly
    Decode(bytes_, &items);
    for (Announcement& a : items) Count(a, now, &up_);
  }
  if (!tree_announcements_) return progressed;
  for (Announcement& a : aggregate_.TakeReports(now)) up_.push_back(std::move(a));
  if (up_.empty()) return progressed;
  SendAnnouncements(tree_.parent, kTagReport, up_);
  up_.clear();
  return true;
}

void Protocol::ToCoordinator(Announcement& a, int from, Clock::time_point now) {
  switch (a.kind) {
    case Announcement::Kind::kFull: coord_->Announce(from, std::move(a.meta), now); break;
    case Announcement::Kind::kCached: coord_->AnnounceCached(RankRanges::Of(from, from + 1), a.cache_id, now); break;
    case Announcement::Kind::kCachedRanges: coord_->AnnounceCached(a.ranks, a.cache_id, now); break;
    case Announcement::Kind::kShutdown: coord_->Departed(from); break;
  }
}

bool Protocol::Collect(Clock::time_point now) {
  bool progressed = false;
  int from = 0;
  std::vector<Announcement> items;
  // Workers may announce by cache ids that the batches still waiting in
  // ready_ create: read announcements only once those have run here.
  while (ready_.empty() && TryReceive(MPI_ANY_SOURCE, kTagAnnounce, &from)) {
    progressed = true;
    Decode(bytes_, &items);
    for (Announcement& a : items) ToCoordinator(a, from, now);
  }
  while (config_.negotiation_tree && ready_.empty() && TryReceive(MPI_ANY_SOURCE, kTagReport, &from)) {
    progressed = true;
    // From the first departure on, every rank re-announces directly what it
    // announced through the tree and is undecided (LeaveTree): what comes up
    // the tree after that point would be counted twice.
    if (coord_->any_departed()) tree_announcements_ = false;
    if (!tree_announcements_) continue;
    Decode(bytes_, &items);
    for (Announcement& a : items) ToCoordinator(a, a.origin, now);
  }
  return progressed;
}

void Protocol::SendDecisions(const std::shared_ptr<std::vector<char>>& encoded) {
  if (tree_decisions_ && unreachable_seen_) {
    // The batch that acknowledges an unreachable rank (it ends the tree): that
    // rank cannot forward it, so its children get it from here (Receive).
    for (int child : tree_.children) SendAround(child, encoded);
    return;
  }
  if (tree_decisions_) {
    for (int child : tree_.children) Send(child, kTagDecide, encoded);
    return;
  }
  for (int w = 1; w < size_; ++w)
    if (!departed_[w]) Send(w, kTagDecide, encoded);
}

bool Protocol::Decide(Clock::time_point now) {
  bool progressed = Collect(now);
  if (now - last_stall_check_ > std::chrono::seconds(1)) {
    coord_->CheckStalls(now);
    last_stall_check_ = now;
  }
  std::vector<Decision> decisions =
      HoldBackBatch(holdback_, cache_, coord_->TakeDecisions(), now, stop_announced_, &holdback_gave_up_reported_);
  stats_->held_back.store(holdback_.total_held());
  if (tuner_ && !tuner_->finished()) TuneBatch(*tuner_, holdback_, cache_, now, &decisions);
  if (stop_announced_ && !gone_sent_) {
    Decision gone;
    gone.kind = Decision::Kind::kCoordinatorGone;
    decisions.push_back(gone);
    gone_sent_ = true;
  }
  if (decisions.empty()) return progressed;
  SendDecisions(std::make_shared<std::vector<char>>(Encode(decisions)));
  // A worker whose departure is acknowledged here has stopped receiving, and
  // from this batch on decisions go to every worker directly (LeaveTree).
  for (const Decision& d : decisions)
    if (d.kind == Decision::Kind::kShutdownAck && d.rank > 0) {
      departed_[d.rank] = true;
      if (liveness_) liveness_->Forget(d.rank);  // its heartbeats stop with its engine
    }
  if (HasDeparture(decisions)) tree_decisions_ = false;
  ready_.push_back(std::move(decisions));
  return true;
}

bool Protocol::Receive(Clock::time_point now) {
  bool progressed = false;
  int from = 0;
  while (!ack_received_ && !done_ && TryReceive(tree_decisions_ ? tree_.parent : 0, kTagDecide, &from)) {
    progressed = true;
    TakeBatch();
  }
  // In the tree, the batch acknowledging an unreachable ancestor comes from
  // rank 0 itself (SendDecisions). Whatever that ancestor forwarded before it
  // was cut off arrived long before rank 0 declared it (the liveness timeout),
  // so taking this batch after those keeps rank 0's order.
  if (liveness_ && tree_decisions_ && tree_.parent != 0 && now >= next_root_probe_ && !ack_received_ && !done_) {
    next_root_probe_ = now + std::chrono::milliseconds(50);
    if (TryReceive(0, kTagDecide, &from)) {
      progressed = true;
      TakeBatch();
    }
  }
  return progressed;
}

void Protocol::TakeBatch() {
  std::vector<Decision> decisions;
  Decode(bytes_, &decisions);
  for (const Decision& d : decisions)
    if (d.kind == Decision::Kind::kShutdownAck && d.rank == rank_) ack_received_ = true;
  if (tree_decisions_) {
    // Forwarded before it runs here, so the subtree executes it in parallel.
    // A departing rank forwards its own acknowledgement before it stops.
    auto encoded = std::make_shared<std::vector<char>>(bytes_);
    for (int child : tree_.children) Send(child, kTagDecide, encoded);
    if (HasDeparture(decisions)) tree_decisions_ = false;  // the next batches come from rank 0
  }
  ready_.push_back(std::move(decisions));
}

void Protocol::SendAround(int rank, const std::shared_ptr<std::vector<char>>& encoded) {
  if (!departed_[rank]) {
    Send(rank, kTagDecide, encoded);
    return;
  }
  for (int child : NegotiationTree(rank, size_).children) SendAround(child, encoded);
}

int64_t Protocol::BatchBytes(const std::vector<Decision>& batch) const {
  int64_t n = 0;
  for (const Decision& d : batch) {
    const Response* r = d.kind == Decision::Kind::kExecute ? &d.response
                        : d.kind == Decision::Kind::kExecuteCached && cache_.Has(d.cache_id) ? &cache_.Get(d.cache_id)
                                                                                            : nullptr;
    if (!r) continue;
    for (size_t t = 0; t < r->meta.tensors.size(); ++t) {
      const TensorMeta& tm = r->meta.tensors[t];
      if (r->meta.type == CollectiveType::kAllgather && t < r->dim0.size() && !tm.shape.empty()) {
        int64_t rows = 0;  // the gathered output is the larger buffer
        for (int64_t x : r->dim0[t]) rows += x;
        n += rows * (NumElements(Shape(tm.shape.begin() + 1, tm.shape.end())) * DataTypeSize(tm.dtype));
      } else {
        n += TensorBytes(tm);
      }
    }
  }
  return n;
}

void Protocol::RunBatch() {
  // Runs one batch of decisions exactly as rank 0 ran it (fusion plans depend
  // on batch boundaries, so batches are never merged).
  const std::vector<Decision> decisions = std::move(ready_.front());
  ready_.pop_front();
  for (const Decision& d : decisions) {
    if (d.kind == Decision::Kind::kCoordinatorGone) {
      coordinator_gone_ = true;
      if (liveness_) liveness_->Forget(0);  // rank 0's heartbeats stop with its engine
    }
    if (d.kind == Decision::Kind::kShutdownAck && d.rank == rank_) done_ = true;
    if (!tree_announcements_ || rank_ == 0) continue;
    // The aggregates of what is decided now are complete; what the subtree
    // announces under these ids from here on is the next step's.
    if (d.kind == Decision::Kind::kExecuteCached) {
      aggregate_.Decided(d.cache_id);
    } else if (auto id = cache_.IdOf(d.response.meta.name)) {
      aggregate_.Decided(*id);
    }
    if (d.kind == Decision::Kind::kExecute && d.response.meta.type == CollectiveType::kJoin)
      aggregate_.JoinCompleted();
  }
  bool ok = false;
  try {
    // Only batches with MPI work are timed; BatchBytes lets a large one take longer.
    const std::string* name = nullptr;
    for (const Decision& d : decisions) {
      if (d.kind == Decision::Kind::kExecute) name = &d.response.meta.name;
      else if (d.kind == Decision::Kind::kExecuteCached && cache_.Has(d.cache_id)) name = &cache_.Get(d.cache_id).meta.name;
      if (name) break;
    }
    WatchdogScope watch(name ? watchdog_ : nullptr, name, decisions.size(), name && watchdog_ ? BatchBytes(decisions) : 0);
    ok = executor_.Run(decisions, &in_flight_, &cache_);
  } catch (const PeerFailure&) {
    throw;  // Step ends the protocol (Lose); the other ranks' calls fail alike
  } catch (const std::exception& e) {
    // Nothing checked beforehand failed (limits are checked on every rank
    // alike before any MPI call, executor.cc): e.g. memory ran out on this
    // rank in the middle of a collective. The other ranks are in, or will
    // enter, the same MPI calls and cannot be released from them.
    LogError(std::string("internal error while executing collectives: ") + e.what() +
             "; the other ranks may already be inside the same MPI call, so the job cannot go on: aborting it");
    AbortJob(1);
  }
  if (!ok) AbortJob(1);
  for (const Decision& d : decisions)
    if (d.kind == Decision::Kind::kSettings) settings_ = d.tunables;
  if (coordinator_gone_) {
    FailAll(&in_flight_, Status::Aborted(kCoordinatorGoneError));
    if (stop_announced_) done_ = true;
  }
  if (rank_ != 0 && tree_announcements_ && !done_ && HasDeparture(decisions)) LeaveTree();
}

void Protocol::LeaveTree() {
  // Every rank executes this batch, so all leave the tree at the same point.
  // What this rank announced through the tree may be stuck at a rank that
  // left; rank 0 ignores the tree from the departure on, so each rank
  // announces again, directly, what is still undecided here.
  tree_announcements_ = false;
  aggregate_.Clear();
  up_.clear();
  std::vector<Announcement> again;
  for (const auto& [name, r] : in_flight_) again.push_back(AnnouncementOf(*r));
  if (stop_announced_ && !ack_received_ && !coordinator_gone_)
    again.push_back({Announcement::Kind::kShutdown, {}, 0, rank_, {}});
  if (!again.empty()) SendAnnouncements(0, kTagAnnounce, again);
}

void Protocol::Unreachable() {
  const std::vector<int> ranks = liveness_->TakeUnreachable();
  if (done_) return;
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%g", liveness_->timeout_s());
  const std::string detail = std::string("no heartbeat for ") + seconds +
                             " s, TF_MPI_PEER_TIMEOUT_SECONDS: a cut network link, or a stopped or frozen process or host";
  if (rank_ != 0) {
    // (A worker that announced its departure and waits for the acknowledgement
    // goes on here: shutdown() would otherwise wait for an unreachable rank 0.)
    if (coordinator_gone_ || ack_received_) return;  // rank 0 said goodbye, or acknowledged this rank's
    // Decided batches not run yet would meet rank 0 inside MPI: they are
    // dropped with the rest. This rank's heartbeats to rank 0 stop (it is no
    // longer watched), so rank 0, if it is alive after all, fails the others'.
    const std::string msg = "tf_mpi: rank 0 is unreachable (" + detail + "); no more collectives can run";
    LogError(msg + "; this rank's pending and later collectives fail");
    stop_status_ = Status::Aborted(msg);
    coordinator_gone_ = true;
    FailAll(&in_flight_, stop_status_);
    ready_.clear();
    done_ = true;
    return;
  }
  if (stop_announced_) return;  // rank 0 is leaving: the workers have been told
  for (int r : ranks) {
    if (departed_[r]) continue;
    LogError("rank " + std::to_string(r) + " is unreachable (" + detail +
             "); every rank's pending and later collectives fail");
    coord_->Unreachable(r, detail);
    departed_[r] = true;  // nothing more is sent to it
    unreachable_seen_ = true;
  }
}

void Protocol::Fail(const std::string& why) {
  const std::string msg = "tf_mpi: rank 0 stopped coordinating after an internal error: " + why;
  LogError(msg + "; every rank's pending and later collectives fail (shutdown() and init() start again)");
  // The workers execute every batch already sent to them, so rank 0 must too.
  while (!ready_.empty() && !done_) RunBatch();
  if (!gone_sent_) {
    Decision gone;
    gone.kind = Decision::Kind::kCoordinatorGone;
    SendDecisions(std::make_shared<std::vector<char>>(Encode(std::vector<Decision>{gone})));
    gone_sent_ = true;
  }
  coordinator_gone_ = true;
  FailAll(&in_flight_, Status::Internal(msg));
  done_ = true;
  stop_status_ = Status::Internal(msg);
}

void Protocol::Lose(const std::string& why) {
  if (!lost_) LogError(why);
  lost_ = true;
  stop_status_ = Status::Unavailable(why);
  FailAll(&in_flight_, stop_status_);
  ready_.clear();
  done_ = true;
}

Outbox::Undelivered Protocol::Close(const Status& why, Outbox::Clock::duration limit) {
  FailAll(&in_flight_, why);
  // After a loss the communicator is revoked: nothing more will be delivered, so no waiting.
  try {
    return outbox_.Close(lost_ ? Outbox::Clock::duration::zero() : limit);
  } catch (const PeerFailure& e) {  // the loss shows only now; the handler no longer throws
    Lose(e.what());
    return outbox_.Close(Outbox::Clock::duration::zero());
  }
}

}  // namespace tfmpi
