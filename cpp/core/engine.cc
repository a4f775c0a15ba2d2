#include "engine.h"

#include <cstdlib>
#include <list>
#include <set>

#include "autotune.h"
#include "coordinator.h"
#include "executor.h"
#include "holdback.h"
#include "logging.h"
#include "outbox.h"
#include "response_cache.h"
#include "wire.h"

namespace tfmpi {

namespace {

constexpr int kTagAnnounce = 7101;
constexpr int kTagDecide = 7102;
// How often rank 0 looks at the world when it has nothing in flight (see Loop, step 3).
constexpr auto kCoordinatorIdleWake = std::chrono::milliseconds(20);

void FailAll(InFlight* in_flight, const Status& why) {
  for (auto& [name, r] : *in_flight) r->done(why);
  in_flight->clear();
}

const char* const kCoordinatorGoneError =
    "tf_mpi: rank 0 called shutdown() or stopped after an error (see its log); no more collectives can run";

// What this thread holds of the engine: progress_mu_ (tls_turn), mu_
// (tls_state_locks). A request submitted while the thread holds the protocol
// or runs completion callbacks (tls_completing) is queued for the background
// thread instead of being driven here, so callbacks never nest drives.
thread_local bool tls_turn = false;
thread_local bool tls_completing = false;
thread_local int tls_state_locks = 0;

// Engine::mu_, counted in tls_state_locks (RunCompletions checks that no engine lock is held).
class StateLock {
 public:
  explicit StateLock(std::mutex& mu) : lock_(mu) { ++tls_state_locks; }
  ~StateLock() { --tls_state_locks; }
  std::unique_lock<std::mutex>& lock() { return lock_; }
 private:
  std::unique_lock<std::mutex> lock_;
};

std::string RankList(const std::set<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return (ranks.size() == 1 ? "rank " : "ranks ") + out;
}

int64_t RequestBytes(const Request& r) {
  int64_t n = 0;
  for (const TensorMeta& t : r.meta.tensors) n += TensorBytes(t);
  return n;
}

}  // namespace

struct Engine::Protocol {
  Protocol(const MpiContext* mpi, const EngineConfig& config, const GpuTransportChoice& gpu,
           const HierarchicalChoice& hierarchical, ExecutorStats* stats, Timeline* timeline)
      : cache(static_cast<size_t>(config.cache_capacity)), executor(mpi, config, gpu, hierarchical, stats, timeline) {
    if (mpi->rank() == 0)
      coord = std::make_unique<Coordinator>(mpi->size(), &cache, config.stall_check_s, config.stall_shutdown_s, timeline);
    if (mpi->rank() == 0 && config.autotune != AutotuneScope::kOff)
      tuner = std::make_unique<Autotuner>(config.tunables, config.autotune_steps, config.autotune);
    departed.assign(mpi->size(), false);
    if (mpi->rank() != 0) truncate_announcement = EnvInt("TF_MPI_FAULT_TRUNCATE_ANNOUNCEMENT", 0);
  }
  ResponseCache cache;
  std::unique_ptr<Coordinator> coord;  // rank 0 only
  Executor executor;
  std::unique_ptr<Autotuner> tuner;    // rank 0 with TF_MPI_AUTOTUNE set
  Holdback holdback;                   // rank 0: runs set by the tuner
  bool holdback_gave_up_reported = false;
  InFlight in_flight;
  Outbox outbox;
  // Batches decided (rank 0) or received (workers) and not executed yet, in
  // order. Normally executed in the Step that got them; a caller leaves a
  // large one to the background thread (Drive).
  std::deque<std::vector<Decision>> ready;
  std::vector<bool> departed;    // rank 0: workers whose departure was acknowledged; nothing more is sent to them
  bool ack_received = false;     // a worker: rank 0 acknowledged its departure; nothing more comes
  bool stop_announced = false;   // this rank told rank 0 (or, on rank 0, the workers) it is leaving
  bool gone_sent = false;        // rank 0: the workers were told it stopped
  bool coordinator_gone = false;
  bool done = false;             // the protocol has ended on this rank
  // Test hook (TF_MPI_FAULT_TRUNCATE_ANNOUNCEMENT=k): a worker cuts the last
  // byte off the k-th announcement message this process sends (once per
  // process), as a rank running an incompatible build would, so the tests can
  // show rank 0 stopping cleanly.
  int64_t truncate_announcement = 0;
  Clock::time_point last_stall_check = Clock::now();
  std::vector<char> bytes;
};

Engine::Engine() = default;
Engine::~Engine() = default;

Engine& Engine::Get() {
  // Leaked on purpose: a static destructor would run after MPI_Finalize and
  // while TensorFlow threads may still hold callbacks.
  static Engine* engine = new Engine();
  return *engine;
}

Status Engine::Init(const InitOptions& opts) {
  if (initialized_) return Status::OK();
  try {
    config_ = EngineConfig::FromEnv();
    tunables_ = config_.tunables;
  } catch (const std::exception& e) {
    return Status::Invalid(e.what());
  }
  Status s = mpi_.Init(opts);
  if (!s.ok()) return s;
  SetLogRank(mpi_.rank());
  hierarchical_ = ChooseHierarchical(config_.hierarchical, mpi_);
  if (s = AgreeOnChoice(mpi_, hierarchical_); !s.ok()) {
    mpi_.Release();
    return s;
  }
  if (mpi_.rank() == 0) {
    // Said once where it matters: more than one node, or forced on.
    if (hierarchical_.mode == HierarchicalMode::kOn && !hierarchical_.usable) LogWarning(hierarchical_.summary);
    else if (mpi_.cross_size() > 1 && hierarchical_.mode != HierarchicalMode::kOff) LogInfo(hierarchical_.summary);
  }
  {
    StateLock lock(mu_);
    stop_requested_ = false;
    stop_reason_.clear();
  }
  // Asking the MPI needs no GPU and no CUDA library, so the transport is known
  // (and shown by tf_mpi.gpu_transport()) before any GPU tensor arrives.
  gpu_choice_ = ChooseGpuTransport(config_.cuda_aware);
  protocol_ = std::make_unique<Protocol>(&mpi_, config_, gpu_choice_, hierarchical_, &stats_, &timeline_);
  initialized_ = true;
  if (const char* path = std::getenv("TF_MPI_TIMELINE"); path && *path) {
    s = StartTimeline(path);
    if (!s.ok()) LogWarning(s.message);
  }
  thread_ = std::thread([this] { Loop(); });
  return Status::OK();
}

void Engine::Shutdown() {
  if (!initialized_) return;
  {
    StateLock lock(mu_);
    stop_requested_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard<std::mutex> turn(progress_mu_);
    protocol_.reset();
  }
  timeline_.Stop();
  mpi_.Release();
  initialized_ = false;
}

Status Engine::StartTimeline(const std::string& path) {
  if (!initialized_) return Status::Precondition("tf_mpi has not been initialized; call tf_mpi.init() first");
  if (mpi_.rank() != 0) return Status::OK();
  if (!timeline_.Start(path)) return Status::Invalid("tf_mpi: cannot open timeline file " + path);
  return Status::OK();
}

void Engine::Finalize() {
  Get().Shutdown();
  MpiContext::FinalizeIfOwned();
}

void Engine::Abort(int code) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

Status Engine::Validate(const Request& r) const {
  Status s = ValidateRequest(r, mpi_.size());
  if (!s.ok() || r.device < 0) return s;
  std::string why;
  if (!CudaApi(&why)) return Status::Precondition(why);
  int expected = -1;
  if (!gpu_device_.compare_exchange_strong(expected, r.device) && expected != r.device)
    return Status::Invalid("tf_mpi: " + std::string(CollectiveName(r.meta.type)) + " '" + r.meta.name +
                           "' is on GPU " + std::to_string(r.device) + ", but this rank's collectives use GPU " +
                           std::to_string(expected) + " (one GPU per rank: pick it with local_rank())");
  return Status::OK();
}

Status Engine::Enqueue(std::unique_ptr<Request> r) {
  if (!initialized_)
    return Status::Precondition("tf_mpi has not been initialized; call tf_mpi.init() first");
  Status s = Validate(*r);
  if (!s.ok()) return s;
  // The engine's stream will wait for what the caller queued on its stream so
  // far; no host-side synchronisation of the caller's stream.
  if (r->device >= 0 && r->stream) {
    s = RecordReadyEvent(r->device, r->stream, &r->ready_event);
    if (!s.ok()) return s;
  }
  // A small host request is run by this thread (Drive) when no one else is
  // running the protocol right now; otherwise the background thread is woken.
  // GPU requests always go to the background thread: their copies and
  // synchronisation do not belong on a caller's (e.g. TensorFlow's) thread.
  std::unique_lock<std::mutex> turn;
  if (!tls_turn && !tls_completing && r->device < 0 && config_.inline_bytes > 0 &&
      RequestBytes(*r) <= config_.inline_bytes)
    turn = std::unique_lock<std::mutex>(progress_mu_, std::try_to_lock);
  const bool drive = turn.owns_lock() && protocol_ && !protocol_->done;
  if (turn.owns_lock() && !drive) turn.unlock();
  auto finished = drive ? std::make_shared<std::atomic<bool>>(false) : nullptr;
  // Whoever holds progress_mu_ calls this; the callback itself runs once the
  // lock is released (RunCompletions).
  r->done = [this, done = std::move(r->done), finished](const Status& st) mutable {
    completions_.push_back({std::move(done), st});
    if (finished) finished->store(true);
  };
  {
    StateLock lock(mu_);
    if (stop_requested_) return Status::Precondition(stop_reason_.empty() ? "tf_mpi has been shut down" : stop_reason_);
    queue_.push_back(std::move(r));
    if (drive) driving_ = true;
  }
  if (drive) Drive(std::move(turn), *finished);
  else cv_.notify_one();
  return Status::OK();
}

Engine::Completions Engine::TakeCompletions() {
  Completions out;
  out.swap(completions_);
  return out;
}

void Engine::RunCompletions(Completions& list) {
  if (list.empty()) return;
  if (tls_turn || tls_state_locks > 0) stats_.callbacks_under_lock += static_cast<int64_t>(list.size());
  const bool outer = tls_completing;
  tls_completing = true;
  for (Completion& c : list) {
    try {
      c.done(c.status);
    } catch (const std::exception& e) {
      LogError(std::string("a collective's completion callback threw: ") + e.what());
    } catch (...) {
      LogError("a collective's completion callback threw");
    }
  }
  tls_completing = outer;
  list.clear();
}

void Engine::Drive(std::unique_lock<std::mutex> turn, const std::atomic<bool>& finished) {
  Protocol& p = *protocol_;
  tls_turn = true;
  const auto patience = std::chrono::microseconds(config_.inline_wait_us);
  const auto start = Clock::now();
  // However busy the protocol keeps it, a caller's thread is lent for a bounded time.
  const auto give_up = start + std::max<Clock::duration>(10 * patience, std::chrono::milliseconds(1));
  auto last_progress = start;
  bool deferred = false;
  while (!p.done && !finished.load() && !deferred) {
    const bool progressed = SafeStep(p, true, &deferred);
    const auto now = Clock::now();
    if (progressed) last_progress = now;
    else if (now - last_progress > patience) break;
    if (now > give_up) break;
  }
  if (deferred) ++stats_.deferred_batches;
  const bool work_left = !p.in_flight.empty() || !p.ready.empty() || p.done;
  Completions done = TakeCompletions();
  tls_turn = false;
  turn.unlock();
  bool wake;
  {
    StateLock lock(mu_);
    driving_ = false;
    wake = work_left || !queue_.empty() || stop_requested_;
    handoff_ = handoff_ || wake;
  }
  if (wake) cv_.notify_one();
  RunCompletions(done);
}

int64_t Engine::BatchBytes(const Protocol& p, const std::vector<Decision>& batch) const {
  int64_t n = 0;
  for (const Decision& d : batch) {
    const Response* r = d.kind == Decision::Kind::kExecute ? &d.response
                        : d.kind == Decision::Kind::kExecuteCached && p.cache.Has(d.cache_id) ? &p.cache.Get(d.cache_id)
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

void Engine::RunBatch(Protocol& p) {
  // Runs one batch of decisions exactly as rank 0 ran it (fusion plans depend
  // on batch boundaries, so batches are never merged).
  const std::vector<Decision> decisions = std::move(p.ready.front());
  p.ready.pop_front();
  const int rank = mpi_.rank();
  for (const Decision& d : decisions) {
    if (d.kind == Decision::Kind::kCoordinatorGone) p.coordinator_gone = true;
    if (d.kind == Decision::Kind::kShutdownAck && d.rank == rank) p.done = true;
  }
  bool ok = false;
  try {
    ok = p.executor.Run(decisions, &p.in_flight, &p.cache);
  } catch (const std::exception& e) {
    // Nothing checked beforehand failed (limits are checked on every rank
    // alike before any MPI call, executor.cc): e.g. memory ran out on this
    // rank in the middle of a collective. The other ranks are in, or will
    // enter, the same MPI calls and cannot be released from them.
    LogError(std::string("internal error while executing collectives: ") + e.what() +
             "; the other ranks may already be inside the same MPI call, so the job cannot go on: aborting it");
    Abort(1);
  }
  if (!ok) Abort(1);
  for (const Decision& d : decisions) {
    if (d.kind != Decision::Kind::kSettings) continue;
    StateLock lock(mu_);
    tunables_ = d.tunables;
  }
  if (p.coordinator_gone) {
    FailAll(&p.in_flight, Status::Aborted(kCoordinatorGoneError));
    if (p.stop_announced) p.done = true;
  }
}

void Engine::Fail(Protocol& p, const std::string& why) {
  const std::string msg = "tf_mpi: rank 0 stopped coordinating after an internal error: " + why;
  LogError(msg + "; every rank's pending and later collectives fail (shutdown() and init() start again)");
  // The workers execute every batch already sent to them, so rank 0 must too.
  while (!p.ready.empty() && !p.done) RunBatch(p);
  if (!p.gone_sent) {
    Decision gone;
    gone.kind = Decision::Kind::kCoordinatorGone;
    auto encoded = std::make_shared<std::vector<char>>(Encode(std::vector<Decision>{gone}));
    for (int w = 1; w < mpi_.size(); ++w)
      if (!p.departed[w]) p.outbox.Send(mpi_.comm(), w, kTagDecide, encoded);
    p.gone_sent = true;
  }
  p.coordinator_gone = true;
  FailAll(&p.in_flight, Status::Internal(msg));
  p.done = true;
  StateLock lock(mu_);
  stop_reason_ = msg;
}

bool Engine::SafeStep(Protocol& p, bool on_caller, bool* deferred) {
  try {
    return Step(p, on_caller, deferred);
  } catch (const std::exception& e) {
    if (mpi_.rank() != 0) {
      // A worker that cannot read rank 0's decisions no longer knows which
      // collectives the others run; they may be inside one with it already.
      LogError(std::string("internal error in the negotiation with rank 0: ") + e.what() +
               "; this rank can no longer agree with the others on what to run: aborting the job");
      Abort(1);
    }
    // Rank 0 fails while reading announcements or deciding: every decision
    // it sent has been executed here (Fail runs the rest), so the workers
    // wait in no collective and can be told to stop.
    Fail(p, e.what());
    return true;
  }
}

bool Engine::Step(Protocol& p, bool on_caller, bool* deferred) {
  const int rank = mpi_.rank();
  const int size = mpi_.size();
  const MPI_Comm comm = mpi_.comm();
  bool progressed = false;
  std::deque<std::unique_ptr<Request>> fresh;
  bool stop_requested;
  {
    StateLock lock(mu_);
    fresh.swap(queue_);
    stop_requested = stop_requested_;
  }
  const Clock::time_point now = Clock::now();

  // 1. Announce what callers submitted.
  std::vector<Announcement> outgoing;
  for (auto& r : fresh) {
    progressed = true;
    const std::string name = r->meta.name;
    if (p.coordinator_gone) {
      r->done(Status::Aborted(kCoordinatorGoneError));
      continue;
    }
    if (p.in_flight.count(name)) {
      r->done(Status::Invalid("tf_mpi: a collective named '" + name +
                              "' is already in flight on this rank; concurrent collectives need distinct names"));
      continue;
    }
    Announcement a;
    if (auto id = p.cache.Lookup(r->meta, rank)) {
      a.kind = Announcement::Kind::kCached;
      a.cache_id = *id;
    } else {
      a.meta = r->meta;
    }
    p.in_flight.emplace(name, std::move(r));
    if (rank != 0) {
      outgoing.push_back(std::move(a));
    } else if (a.kind == Announcement::Kind::kCached) {
      p.coord->AnnounceCached(0, a.cache_id, now);
    } else {
      p.coord->Announce(0, std::move(a.meta), now);
    }
  }
  if (stop_requested && !p.stop_announced) {
    p.stop_announced = progressed = true;
    if (rank != 0) {
      if (p.coordinator_gone) p.done = true;
      else outgoing.push_back({Announcement::Kind::kShutdown, {}, 0});
    }
  }
  if (!outgoing.empty()) {
    auto bytes = std::make_shared<std::vector<char>>(Encode(outgoing));
    static int64_t sent_by_this_process = 0;  // only the protocol's holder gets here
    if (++sent_by_this_process == p.truncate_announcement) bytes->pop_back();
    p.outbox.Send(comm, 0, kTagAnnounce, bytes);
  }

  // 2. Rank 0 decides; workers receive decisions.
  if (rank == 0) {
    int from = 0;
    std::vector<Announcement> items;
    // Workers may announce by cache ids that the batches still waiting in
    // p.ready create: read announcements only once those have run here.
    while (p.ready.empty() && TryReceive(comm, MPI_ANY_SOURCE, kTagAnnounce, &p.bytes, &from)) {
      progressed = true;
      Decode(p.bytes, &items);
      for (Announcement& a : items) {
        if (a.kind == Announcement::Kind::kFull) p.coord->Announce(from, std::move(a.meta), now);
        else if (a.kind == Announcement::Kind::kCached) p.coord->AnnounceCached(from, a.cache_id, now);
        else p.coord->Departed(from);
      }
    }
    if (now - p.last_stall_check > std::chrono::seconds(1)) {
      p.coord->CheckStalls(now);
      p.last_stall_check = now;
    }
    std::vector<Decision> decisions =
        HoldBackBatch(p.holdback, p.cache, p.coord->TakeDecisions(), now, p.stop_announced, &p.holdback_gave_up_reported);
    stats_.held_back.store(p.holdback.total_held());
    if (p.tuner && !p.tuner->finished()) TuneBatch(*p.tuner, p.holdback, p.cache, now, &decisions);
    if (p.stop_announced && !p.gone_sent) {
      Decision gone;
      gone.kind = Decision::Kind::kCoordinatorGone;
      decisions.push_back(gone);
      p.gone_sent = true;
    }
    if (!decisions.empty()) {
      progressed = true;
      auto encoded = std::make_shared<std::vector<char>>(Encode(decisions));
      for (int w = 1; w < size; ++w)
        if (!p.departed[w]) p.outbox.Send(comm, w, kTagDecide, encoded);
      // A worker whose departure is acknowledged here has stopped receiving.
      for (const Decision& d : decisions)
        if (d.kind == Decision::Kind::kShutdownAck && d.rank > 0) p.departed[d.rank] = true;
      p.ready.push_back(std::move(decisions));
    }
  } else {
    int from = 0;
    while (!p.ack_received && !p.done && TryReceive(comm, 0, kTagDecide, &p.bytes, &from)) {
      progressed = true;
      std::vector<Decision> decisions;
      Decode(p.bytes, &decisions);
      for (const Decision& d : decisions)
        if (d.kind == Decision::Kind::kShutdownAck && d.rank == rank) p.ack_received = true;
      p.ready.push_back(std::move(decisions));
    }
  }

  // 3. Every rank executes the batches in order. A caller's thread runs only
  // batches that fit the inline size; a larger one is left to the engine thread.
  while (!p.ready.empty() && !p.done) {
    if (on_caller) {
      const int64_t bytes = BatchBytes(p, p.ready.front());
      if (bytes > config_.inline_bytes) {
        *deferred = true;
        break;
      }
      ++stats_.inline_batches;
      if (bytes > stats_.inline_max_batch_bytes.load()) stats_.inline_max_batch_bytes.store(bytes);
    }
    RunBatch(p);
    progressed = true;
  }
  p.outbox.Reap();
  return progressed;
}

void Engine::Loop() {
  const int rank = mpi_.rank();
  Clock::time_point last_activity = Clock::now();
  bool stop_seen = false;
  while (true) {
    bool progressed = false, expecting = false, driven = false, ended = false;
    Completions done;
    {
      std::unique_lock<std::mutex> turn(progress_mu_, std::try_to_lock);
      if (turn.owns_lock()) {
        Protocol& p = *protocol_;
        tls_turn = true;
        if (!p.done) {  // else a caller's Drive() ended the protocol
          bool deferred = false;
          progressed = SafeStep(p, false, &deferred);
          expecting = !p.in_flight.empty() || !p.ready.empty() || p.stop_announced;
        }
        ended = p.done;
        done = TakeCompletions();
        tls_turn = false;
      } else {
        driven = true;  // a caller is running the protocol (Drive)
      }
    }
    RunCompletions(done);
    if (ended) break;

    // Wait without a fixed cycle. For spin_us after any activity, spin
    // (yielding the CPU): in a training step the next submission, decision or
    // peer usually comes within microseconds, and a sleeping thread takes tens
    // of microseconds to wake. Then poll in slices of at most poll_us that a
    // new submission cuts short. With nothing in flight on this rank nothing
    // can be decided (every decision needs this rank's own announcement), so
    // a worker sleeps until a submission and rank 0 wakes only every
    // kCoordinatorIdleWake for the stall inspector and departing peers: on a
    // machine where training uses every core, each idle wake-up is CPU taken
    // from backprop (1 ms polling cost rank 0 ~3 % of a core in the LSTM
    // benchmark and made it the slower rank every step). While a caller
    // drives, this thread sleeps until the caller hands over.
    if (progressed) {
      last_activity = Clock::now();
      continue;
    }
    const auto idle = Clock::now() - last_activity;
    if (!driven && idle < std::chrono::microseconds(config_.spin_us)) {
      std::this_thread::yield();
      continue;
    }
    StateLock state(mu_);
    std::unique_lock<std::mutex>& lock = state.lock();
    auto has_news = [&] { return handoff_ || stop_requested_ != stop_seen || (!driving_ && !queue_.empty()); };
    if (!expecting || driven) {
      if (rank != 0) cv_.wait(lock, has_news);
      else cv_.wait_for(lock, kCoordinatorIdleWake, has_news);
    } else {
      const Clock::duration slice = std::chrono::microseconds(config_.poll_us);
      cv_.wait_for(lock, std::min<Clock::duration>(slice, idle / 4 + std::chrono::microseconds(1)), has_news);
    }
    if (handoff_) last_activity = Clock::now();
    handoff_ = false;
    stop_seen = stop_requested_;
  }

  // Take the protocol one last time to fail what is left.
  Completions done;
  {
    std::lock_guard<std::mutex> turn(progress_mu_);
    tls_turn = true;
    Protocol& p = *protocol_;
    FailAll(&p.in_flight, Status::Aborted("tf_mpi: shut down while this collective was pending"));
    {
      StateLock lock(mu_);
      stop_requested_ = true;  // refuse new work until the next init()
      for (auto& r : queue_) r->done(Status::Aborted(stop_reason_.empty() ? "tf_mpi has been shut down" : stop_reason_));
      queue_.clear();
    }
    const Outbox::Undelivered lost = p.outbox.Close(std::chrono::milliseconds(500));
    if (lost.messages > 0) {
      stats_.undelivered_messages += lost.messages;
      stats_.undelivered_bytes += lost.bytes;
      LogWarning("at shutdown " + std::to_string(lost.messages) + " protocol message(s) (" +
                 std::to_string(lost.bytes) + " bytes) to " + RankList(lost.ranks) +
                 " were never received (that rank had stopped its engine); cancelled");
    }
    done = TakeCompletions();
    tls_turn = false;
  }
  RunCompletions(done);
}

}  // namespace tfmpi
