#include "engine.h"

#include <cstdlib>
#include <list>

#include "autotune.h"
#include "coordinator.h"
#include "executor.h"
#include "logging.h"
#include "response_cache.h"
#include "wire.h"

namespace tfmpi {

namespace {

constexpr int kTagAnnounce = 7101;
constexpr int kTagDecide = 7102;
// How often rank 0 looks at the world when it has nothing in flight (see Loop, step 3).
constexpr auto kCoordinatorIdleWake = std::chrono::milliseconds(20);

// Keeps non-blocking sends' buffers alive until MPI has finished with them.
class Outbox {
 public:
  void Send(MPI_Comm comm, int dest, int tag, std::shared_ptr<std::vector<char>> bytes) {
    msgs_.push_back({std::move(bytes), MPI_REQUEST_NULL});
    auto& m = msgs_.back();
    MPI_Isend(m.bytes->data(), static_cast<int>(m.bytes->size()), MPI_BYTE, dest, tag, comm, &m.req);
  }
  void Reap() {
    for (auto it = msgs_.begin(); it != msgs_.end();) {
      int done = 0;
      MPI_Test(&it->req, &done, MPI_STATUS_IGNORE);
      it = done ? msgs_.erase(it) : std::next(it);
    }
  }
  // At exit: give peers a moment to take our last messages, never forever.
  void Drain(Clock::duration limit) {
    const auto deadline = Clock::now() + limit;
    while (!msgs_.empty() && Clock::now() < deadline) {
      Reap();
      std::this_thread::yield();
    }
  }
 private:
  struct Msg { std::shared_ptr<std::vector<char>> bytes; MPI_Request req; };
  std::list<Msg> msgs_;
};

bool TryReceive(MPI_Comm comm, int source, int tag, std::vector<char>* bytes, int* from) {
  int flag = 0;
  MPI_Status st;
  MPI_Iprobe(source, tag, comm, &flag, &st);
  if (!flag) return false;
  int n = 0;
  MPI_Get_count(&st, MPI_BYTE, &n);
  bytes->resize(n);
  MPI_Recv(bytes->data(), n, MPI_BYTE, st.MPI_SOURCE, tag, comm, MPI_STATUS_IGNORE);
  *from = st.MPI_SOURCE;
  return true;
}

void FailAll(InFlight* in_flight, const std::string& why) {
  for (auto& [name, r] : *in_flight) r->done(Status::Aborted(why));
  in_flight->clear();
}

}  // namespace

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
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_requested_ = false;
  }
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
    std::lock_guard<std::mutex> lock(mu_);
    stop_requested_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
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
  const RequestMeta& m = r.meta;
  const std::string what = std::string(CollectiveName(m.type)) + " '" + m.name + "'";
  if (m.name.empty()) return Status::Invalid("tf_mpi: every collective needs a name");
  if (m.type == CollectiveType::kJoin) {
    if (m.name != kJoinName || r.outputs.size() != 1) return Status::Invalid("tf_mpi: malformed join request");
    return Status::OK();
  }
  if (m.tensors.empty()) return Status::Invalid("tf_mpi: " + what + " has no tensors");
  if (r.inputs.size() != m.tensors.size())
    return Status::Invalid("tf_mpi: " + what + ": inputs do not match tensors");
  for (const TensorMeta& t : m.tensors) {
    if (t.dtype >= DataType::kNumTypes) return Status::Invalid("tf_mpi: " + what + ": unsupported dtype");
    const bool reduces = m.type == CollectiveType::kAllreduce || m.type == CollectiveType::kReducescatter;
    if (reduces && t.dtype == DataType::kBool)
      return Status::Invalid("tf_mpi: " + what + ": " + CollectiveName(m.type) + " does not support bool tensors");
    if (m.type != CollectiveType::kAllreduce && m.type != CollectiveType::kBroadcast && t.shape.empty())
      return Status::Invalid("tf_mpi: " + what + ": " + CollectiveName(m.type) +
                             " needs tensors with at least one dimension (got a scalar)");
  }
  const bool sized_later = m.type == CollectiveType::kAllgather || m.type == CollectiveType::kAlltoall;
  if ((m.type == CollectiveType::kAllreduce || m.type == CollectiveType::kReducescatter) && m.op == ReduceOp::kAdasum)
    return Status::Invalid("tf_mpi: Adasum is not implemented yet; use Average or Sum");
  if (!sized_later && r.outputs.size() != m.tensors.size())
    return Status::Invalid("tf_mpi: " + what + ": outputs do not match tensors");
  if (sized_later && !r.allocate)
    return Status::Invalid("tf_mpi: " + what + ": no output allocator");
  if (m.type == CollectiveType::kAlltoall) {
    if (m.tensors.size() != 1) return Status::Invalid("tf_mpi: " + what + ": alltoall takes one tensor");
    if (static_cast<int>(m.splits.size()) != mpi_.size())
      return Status::Invalid("tf_mpi: " + what + ": splits has " + std::to_string(m.splits.size()) +
                             " entries but there are " + std::to_string(mpi_.size()) + " ranks");
    int64_t total = 0;
    for (int64_t s : m.splits) {
      if (s < 0) return Status::Invalid("tf_mpi: " + what + ": negative split");
      total += s;
    }
    if (total != m.tensors[0].shape[0])
      return Status::Invalid("tf_mpi: " + what + ": splits sum to " + std::to_string(total) +
                             " but the tensor's first dimension is " + std::to_string(m.tensors[0].shape[0]));
  }
  if (m.type == CollectiveType::kBroadcast && (m.root < 0 || m.root >= mpi_.size()))
    return Status::Invalid("tf_mpi: " + what + ": root rank " + std::to_string(m.root) + " is out of range for " +
                           std::to_string(mpi_.size()) + " ranks");
  return Status::OK();
}

Status Engine::Enqueue(std::unique_ptr<Request> r) {
  if (!initialized_)
    return Status::Precondition("tf_mpi has not been initialized; call tf_mpi.init() first");
  Status s = Validate(*r);
  if (!s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_requested_) return Status::Precondition("tf_mpi has been shut down");
    queue_.push_back(std::move(r));
  }
  cv_.notify_one();
  return Status::OK();
}

void Engine::Autotune(Autotuner* tuner, const ResponseCache& cache, std::chrono::steady_clock::time_point now,
                      std::vector<Decision>* decisions) {
  std::optional<Tunables> change;
  for (const Decision& d : *decisions) {
    const std::string* name = d.kind == Decision::Kind::kExecute         ? &d.response.meta.name
                              : d.kind == Decision::Kind::kExecuteCached ? &cache.Get(d.cache_id).meta.name
                                                                         : nullptr;
    if (name)
      if (auto t = tuner->Observe(*name, now)) change = t;
  }
  if (!change) return;
  Decision settings;
  settings.kind = Decision::Kind::kSettings;
  settings.tunables = *change;
  decisions->push_back(settings);
  if (tuner->finished()) LogInfo("autotune finished (TF_MPI_AUTOTUNE=1), median step time per setting:" + tuner->Report());
}

void Engine::Loop() {
  const int rank = mpi_.rank();
  const int size = mpi_.size();
  const MPI_Comm comm = mpi_.comm();
  ResponseCache cache(static_cast<size_t>(config_.cache_capacity));
  std::unique_ptr<Coordinator> coord;
  if (rank == 0) coord = std::make_unique<Coordinator>(size, &cache, config_.stall_check_s, config_.stall_shutdown_s, &timeline_);
  Executor executor(&mpi_, config_, &stats_, &timeline_);
  std::unique_ptr<Autotuner> tuner;
  if (rank == 0 && config_.autotune) tuner = std::make_unique<Autotuner>(config_.tunables, config_.autotune_steps);
  InFlight in_flight;
  Outbox outbox;
  bool stop_announced = false;   // this rank told rank 0 (or, on rank 0, the workers) it is leaving
  bool coordinator_gone = false;
  bool done = false;
  Clock::time_point last_activity = Clock::now();
  Clock::time_point last_stall_check = last_activity;
  std::vector<char> bytes;

  // Runs one batch of decisions exactly as rank 0 ran it (fusion plans depend
  // on batch boundaries, so batches are never merged).
  auto run_batch = [&](const std::vector<Decision>& decisions) {
    for (const Decision& d : decisions) {
      if (d.kind == Decision::Kind::kCoordinatorGone) coordinator_gone = true;
      if (d.kind == Decision::Kind::kShutdownAck && d.rank == rank) done = true;
    }
    if (!executor.Run(decisions, &in_flight, &cache)) Abort(1);
    for (const Decision& d : decisions) {
      if (d.kind != Decision::Kind::kSettings) continue;
      std::lock_guard<std::mutex> lock(mu_);
      tunables_ = d.tunables;
    }
    if (coordinator_gone) {
      FailAll(&in_flight, "tf_mpi: rank 0 called shutdown(); no more collectives can run");
      if (stop_announced) done = true;
    }
  };

  while (!done) {
    bool progressed = false;
    std::deque<std::unique_ptr<Request>> fresh;
    bool stop_requested;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fresh.swap(queue_);
      stop_requested = stop_requested_;
    }
    const Clock::time_point now = Clock::now();

    // 1. Announce what callers submitted.
    std::vector<Announcement> outgoing;
    for (auto& r : fresh) {
      progressed = true;
      const std::string name = r->meta.name;
      if (coordinator_gone) {
        r->done(Status::Aborted("tf_mpi: rank 0 called shutdown(); no more collectives can run"));
        continue;
      }
      if (in_flight.count(name)) {
        r->done(Status::Invalid("tf_mpi: a collective named '" + name +
                                "' is already in flight on this rank; concurrent collectives need distinct names"));
        continue;
      }
      Announcement a;
      if (auto id = cache.Lookup(r->meta, rank)) {
        a.kind = Announcement::Kind::kCached;
        a.cache_id = *id;
      } else {
        a.meta = r->meta;
      }
      in_flight.emplace(name, std::move(r));
      if (rank != 0) {
        outgoing.push_back(std::move(a));
      } else if (a.kind == Announcement::Kind::kCached) {
        coord->AnnounceCached(0, a.cache_id, now);
      } else {
        coord->Announce(0, std::move(a.meta), now);
      }
    }
    if (stop_requested && !stop_announced) {
      stop_announced = progressed = true;
      if (rank != 0) {
        if (coordinator_gone) done = true;
        else outgoing.push_back({Announcement::Kind::kShutdown, {}, 0});
      }
    }
    if (!outgoing.empty())
      outbox.Send(comm, 0, kTagAnnounce, std::make_shared<std::vector<char>>(Encode(outgoing)));

    // 2. Rank 0 decides; workers receive decisions. Everyone executes them.
    if (rank == 0) {
      int from = 0;
      std::vector<Announcement> items;
      while (TryReceive(comm, MPI_ANY_SOURCE, kTagAnnounce, &bytes, &from)) {
        progressed = true;
        Decode(bytes, &items);
        for (Announcement& a : items) {
          if (a.kind == Announcement::Kind::kFull) coord->Announce(from, std::move(a.meta), now);
          else if (a.kind == Announcement::Kind::kCached) coord->AnnounceCached(from, a.cache_id, now);
          else coord->Departed(from);
        }
      }
      if (now - last_stall_check > std::chrono::seconds(1)) {
        coord->CheckStalls(now);
        last_stall_check = now;
      }
      std::vector<Decision> decisions = coord->TakeDecisions();
      if (tuner && !tuner->finished()) Autotune(tuner.get(), cache, now, &decisions);
      if (stop_announced) decisions.push_back({Decision::Kind::kCoordinatorGone, 0, {}, -1});
      if (!decisions.empty()) {
        progressed = true;
        auto encoded = std::make_shared<std::vector<char>>(Encode(decisions));
        for (int w = 1; w < size; ++w) outbox.Send(comm, w, kTagDecide, encoded);
        run_batch(decisions);
        if (stop_announced) done = true;
      }
    } else {
      int from = 0;
      std::vector<Decision> decisions;
      while (!done && TryReceive(comm, 0, kTagDecide, &bytes, &from)) {
        progressed = true;
        Decode(bytes, &decisions);
        run_batch(decisions);
      }
    }
    outbox.Reap();
    if (done) break;

    // 3. Wait without a fixed cycle. For spin_us after any activity, spin
    // (yielding the CPU): in a training step the next submission, decision or
    // peer usually comes within microseconds, and a sleeping thread takes tens
    // of microseconds to wake. Then poll in slices of at most poll_us that a
    // new submission cuts short. With nothing in flight on this rank nothing
    // can be decided (every decision needs this rank's own announcement), so
    // a worker sleeps until a submission and rank 0 wakes only every
    // kCoordinatorIdleWake for the stall inspector and departing peers: on a
    // machine where training uses every core, each idle wake-up is CPU taken
    // from backprop (1 ms polling cost rank 0 ~3 % of a core in the LSTM
    // benchmark and made it the slower rank every step).
    if (progressed) {
      last_activity = Clock::now();
      continue;
    }
    const bool expecting = !in_flight.empty() || stop_announced;
    const auto idle = Clock::now() - last_activity;
    if (idle < std::chrono::microseconds(config_.spin_us)) {
      std::this_thread::yield();
      continue;
    }
    std::unique_lock<std::mutex> lock(mu_);
    auto has_news = [&] { return !queue_.empty() || stop_requested_ != stop_requested; };
    if (!expecting) {
      if (rank != 0) cv_.wait(lock, has_news);
      else cv_.wait_for(lock, kCoordinatorIdleWake, has_news);
    } else {
      const Clock::duration slice = std::chrono::microseconds(config_.poll_us);
      cv_.wait_for(lock, std::min<Clock::duration>(slice, idle / 4 + std::chrono::microseconds(1)), has_news);
    }
  }

  FailAll(&in_flight, "tf_mpi: shut down while this collective was pending");
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_requested_ = true;  // refuse new work until the next init()
    for (auto& r : queue_) r->done(Status::Aborted("tf_mpi has been shut down"));
    queue_.clear();
  }
  outbox.Drain(std::chrono::milliseconds(500));
}

}  // namespace tfmpi
