#include "engine/engine.h"

#include <cstdio>
#include <cstdlib>
#include <list>
#include <set>

#include "common/logging.h"
#include "execution/hierarchical_timing.h"
#include "transports/link_probe.h"
#include "transports/peer_failure.h"

namespace tfmpi {

namespace {

// How often rank 0 looks at the world when it has nothing in flight (see Loop, step 3).
constexpr auto kCoordinatorIdleWake = std::chrono::milliseconds(20);

// What this thread holds of the engine (the locking rules: engine.h).
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

// Every rank's init() fails if any rank's TF_MPI_* settings could not be
// read (`mine`): that rank with its own message, the others naming the lowest
// such rank and its message. Collective over mpi.comm().
Status AgreeOnSettings(const MpiContext& mpi, const Status& mine) {
  const int candidate = mine.ok() ? mpi.size() : mpi.rank();
  int first_bad = mpi.size();
  MPI_Allreduce(&candidate, &first_bad, 1, MPI_INT, MPI_MIN, mpi.comm());
  if (first_bad == mpi.size()) return Status::OK();
  char text[512] = {};
  if (mpi.rank() == first_bad) std::snprintf(text, sizeof(text), "%s", mine.message.c_str());
  MPI_Bcast(text, sizeof(text), MPI_CHAR, first_bad, mpi.comm());
  if (!mine.ok()) return mine;
  return Status::Invalid("tf_mpi: rank " + std::to_string(first_bad) + " cannot start: " + text +
                         " (set TF_MPI_* variables alike on every rank, e.g. mpirun -x NAME)");
}

// The process-set registry (locking rules: engine.h). A registered id maps to
// its engine on members and to null elsewhere.
std::mutex g_sets_mu;
std::map<int, std::shared_ptr<Engine>> g_sets;

}  // namespace

Engine::Engine() = default;
Engine::~Engine() = default;

std::shared_ptr<Engine> Engine::ForSet(int id, bool* registered) {
  if (id == 0) {
    if (registered) *registered = true;
    return std::shared_ptr<Engine>(&Get(), [](Engine*) {});  // the global engine is never freed
  }
  std::lock_guard<std::mutex> lock(g_sets_mu);
  auto it = g_sets.find(id);
  if (registered) *registered = it != g_sets.end();
  return it == g_sets.end() ? nullptr : it->second;
}

Status Engine::AddSet(int id, const InitOptions& member_comm, bool member) {
  if (id <= 0) return Status::Invalid("tf_mpi: process set ids start at 1");
  if (!Get().initialized()) return Status::Precondition("tf_mpi has not been initialized; call tf_mpi.init() first");
  {
    std::lock_guard<std::mutex> lock(g_sets_mu);
    if (g_sets.count(id)) return Status::Invalid("tf_mpi: process set " + std::to_string(id) + " exists already");
  }
  std::shared_ptr<Engine> engine;
  if (member) {
    engine.reset(new Engine());
    InitOptions opts = member_comm;
    opts.process_set = true;
    if (Status s = engine->Init(opts); !s.ok()) return s;
  }
  std::lock_guard<std::mutex> lock(g_sets_mu);
  g_sets[id] = std::move(engine);
  return Status::OK();
}

bool Engine::RemoveSet(int id) {
  std::shared_ptr<Engine> engine;
  {
    std::lock_guard<std::mutex> lock(g_sets_mu);
    auto it = g_sets.find(id);
    if (id == 0 || it == g_sets.end()) return false;
    engine = std::move(it->second);
    g_sets.erase(it);
  }
  if (engine) engine->Shutdown();
  return true;
}

std::vector<int> Engine::SetIds() {
  std::lock_guard<std::mutex> lock(g_sets_mu);
  std::vector<int> ids{0};
  for (const auto& [id, _] : g_sets) ids.push_back(id);
  return ids;
}

Engine& Engine::Get() {
  // Leaked on purpose: a static destructor would run after MPI_Finalize and
  // while TensorFlow threads may still hold callbacks.
  static Engine* engine = new Engine();
  return *engine;
}

Status Engine::Init(const InitOptions& opts) {
  if (initialized_) return Status::OK();
  Status settings;
  try {
    config_ = EngineConfig::FromEnv();
    tunables_ = config_.tunables;
    watchdog_settings_ = WatchdogSettings::FromEnv();
  } catch (const std::exception& e) {
    settings = Status::Invalid(e.what());
  }
  // A peer lost while starting (elastic mode): init() fails like a collective would.
  try {
    return InitOnMpi(opts, settings);
  } catch (const PeerFailure& e) {
    watchdog_.Stop();
    mpi_.Release();
    return Status::Unavailable(e.what());
  }
}

Status Engine::InitOnMpi(InitOptions opts, const Status& settings) {
  opts.elastic = config_.elastic;
  if (opts.elastic) ResetPeerFailures();
  // MPI starts even when this rank's settings are unreadable: the other ranks
  // are inside collectives of their own init() (MPI_Comm_dup) and would wait
  // for this one forever; instead every rank learns of it below and fails.
  Status s = mpi_.Init(opts);
  if (!s.ok()) return settings.ok() ? s : settings;
  if (!opts.process_set) SetLogRank(mpi_.rank());  // log lines name the global rank
  if (s = AgreeOnSettings(mpi_, settings); !s.ok()) {
    mpi_.Release();
    return s;
  }
  if (!config_.chunk_bytes_set && mpi_.spans_hosts()) {
    config_.tunables.chunk_bytes = kNetworkChunkBytes;  // the same on every rank: spans_hosts() is agreed
    tunables_ = config_.tunables;
  }
  // The start-up measurements across hosts (the link probe, the timing of both allreduce paths)
  // are MPI calls with peers on other hosts: a link cut or a peer frozen meanwhile would leave
  // this rank inside MPI with nothing else watching, so the watchdog covers them as it covers
  // collectives (watchdog.h), with their largest buffer as the batch's bytes.
  watchdog_.Start(watchdog_settings_);
  watchdog_.Begin("start-up probe of the inter-node link", 1, kLinkProbeLargeBytes);
  ApplyInterNodeProbe(&config_.hierarchical, mpi_);  // measured link for auto's model (link_probe.h)
  watchdog_.End();
  hierarchical_ = ChooseHierarchical(config_.hierarchical, mpi_);
  if (s = AgreeOnChoice(mpi_, hierarchical_); !s.ok()) {
    watchdog_.Stop();
    mpi_.Release();
    return s;
  }
  {
    StateLock lock(mu_);
    stop_requested_ = false;
    stop_status_ = Status::OK();
  }
  // Asking the MPI needs no GPU and no CUDA library, so the transport is known
  // (and shown by tf_mpi.gpu_transport()) before any GPU tensor arrives.
  gpu_choice_ = ChooseGpuTransport(config_.cuda_aware);
  protocol_ = std::make_unique<Protocol>(&mpi_, config_, gpu_choice_, hierarchical_, &stats_, &timeline_);
  // Across real hosts auto's window comes from timing both paths, the executor's own
  // (hierarchical_timing.h). A process set's engine keeps the model's, and so does elastic
  // mode: its re-inits follow failures, and a second of busy collectives on shared cores
  // can starve ULFM's heartbeat thread into declaring a live rank failed.
  if (!opts.process_set && !opts.elastic && WantsPathTimings(config_.hierarchical, mpi_, hierarchical_)) {
    watchdog_.Begin("start-up timing of the flat and hierarchical allreduce", 1, kTimingLargestBytes);
    const PathTimings timed = TimeAllreducePaths(mpi_, protocol_->hierarchical_allreduce(), config_.tunables.chunk_bytes);
    watchdog_.End();
    hierarchical_ = ChooseHierarchical(config_.hierarchical, mpi_, &timed);
    if (s = AgreeOnChoice(mpi_, hierarchical_); !s.ok()) {
      watchdog_.Stop();
      protocol_.reset();
      mpi_.Release();
      return s;
    }
    protocol_->set_hierarchical(hierarchical_);
  }
  if (mpi_.rank() == 0) {
    // Said once where it matters: more than one node, or forced on.
    if (hierarchical_.mode == HierarchicalMode::kOn && !hierarchical_.usable) LogWarning(hierarchical_.summary);
    else if (mpi_.cross_size() > 1 && hierarchical_.mode != HierarchicalMode::kOff) LogInfo(hierarchical_.summary);
  }
  protocol_->set_watchdog(&watchdog_);
  if (!opts.elastic && config_.peer_timeout_s > 0 && mpi_.size() > 1) {
    if (MpiContext::ThreadMultiple()) {
      liveness_.Start(mpi_.liveness_comm(), mpi_.rank(), mpi_.size(), config_.peer_timeout_s, [this] {
        {
          StateLock lock(mu_);
          liveness_news_ = true;
        }
        cv_.notify_all();
      });
      protocol_->set_liveness(&liveness_);
    } else if (mpi_.rank() == 0) {
      LogWarning("TF_MPI_PEER_TIMEOUT_SECONDS has no effect: the peer liveness check needs MPI_THREAD_MULTIPLE");
    }
  }
  initialized_ = true;
  if (const char* path = std::getenv("TF_MPI_TIMELINE"); path && *path && !opts.process_set) {
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
  liveness_.Stop();  // after the protocol ended: a worker waiting for rank 0's acknowledgement needs it
  watchdog_.Stop();
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

void Engine::ShutdownAll() {
  for (int id : SetIds())
    if (id != 0) RemoveSet(id);
  Get().Shutdown();
}

void Engine::Finalize() {
  const bool elastic = Get().config().elastic;
  ShutdownAll();
  // Elastic mode leaves MPI up at exit: with ULFM's heartbeat thread running, MPI_Finalize
  // does not return (Open MPI 5.0.11), and after a lost rank it may wait for it. The process
  // exits without it; the launcher counts finished ranks itself (tf_mpi/run.py).
  if (!elastic) MpiContext::FinalizeIfOwned();
}

void Engine::Abort(int code) { AbortJob(code); }

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
  const bool drive = turn.owns_lock() && protocol_ && !protocol_->done();
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
    if (stop_requested_)
      return stop_status_.ok() ? Status::Precondition("tf_mpi has been shut down")
             : stop_status_.code == StatusCode::kUnavailable ? stop_status_
                                                             : Status::Precondition(stop_status_.message);
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
  while (!p.done() && !finished.load() && !deferred) {
    const bool progressed = RunProtocol(true, &deferred);
    // Other requests of this rank in flight: the caller is not running a
    // chain of dependent ops but submitting many (e.g. one op per gradient).
    // Waiting here for its own would hold the caller back from submitting the
    // rest, one round trip per op; the background thread runs them together.
    if (p.in_flight() > 1) break;
    const auto now = Clock::now();
    if (progressed) last_progress = now;
    else if (now - last_progress > patience) break;
    if (now > give_up) break;
  }
  if (deferred) ++stats_.deferred_batches;
  const bool work_left = p.busy() || p.done();
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

bool Engine::RunProtocol(bool on_caller, bool* deferred) {
  std::deque<std::unique_ptr<Request>> fresh;
  bool stop_requested;
  {
    StateLock lock(mu_);
    fresh.swap(queue_);
    stop_requested = stop_requested_;
  }
  const bool progressed = protocol_->Step(std::move(fresh), stop_requested, on_caller, deferred);
  std::optional<Tunables> settings = protocol_->TakeSettings();
  Status stopped = protocol_->TakeStopStatus();
  if (settings || !stopped.ok()) {
    StateLock lock(mu_);
    if (settings) tunables_ = *settings;
    if (!stopped.ok()) stop_status_ = std::move(stopped);
  }
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
        if (!p.done()) {  // else a caller's Drive() ended the protocol
          bool deferred = false;
          progressed = RunProtocol(false, &deferred);
          expecting = p.busy() || p.stop_announced();
        }
        ended = p.done();
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
    // a worker sleeps until a submission (or a declaration of the peer
    // liveness check, which wakes it: liveness.h) and rank 0 wakes only every
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
    auto has_news = [&] {
      return handoff_ || liveness_news_ || stop_requested_ != stop_seen || (!driving_ && !queue_.empty());
    };
    if (!expecting || driven) {
      if (rank != 0) cv_.wait(lock, has_news);
      else cv_.wait_for(lock, kCoordinatorIdleWake, has_news);
    } else {
      const Clock::duration slice = std::chrono::microseconds(config_.poll_us);
      cv_.wait_for(lock, std::min<Clock::duration>(slice, idle / 4 + std::chrono::microseconds(1)), has_news);
    }
    if (handoff_) last_activity = Clock::now();
    handoff_ = false;
    liveness_news_ = false;
    stop_seen = stop_requested_;
  }

  // Take the protocol one last time to fail what is left.
  Completions done;
  {
    std::lock_guard<std::mutex> turn(progress_mu_);
    tls_turn = true;
    Protocol& p = *protocol_;
    const Outbox::Undelivered lost =
        p.Close(Status::Aborted("tf_mpi: shut down while this collective was pending"), std::chrono::milliseconds(500));
    {
      StateLock lock(mu_);
      stop_requested_ = true;  // refuse new work until the next init()
      const Status why = stop_status_.ok() ? Status::Aborted("tf_mpi has been shut down")
                         : stop_status_.code == StatusCode::kUnavailable ? stop_status_
                                                                         : Status::Aborted(stop_status_.message);
      for (auto& r : queue_) r->done(why);
      queue_.clear();
    }
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
