#include "transports/liveness.h"

#include <algorithm>

namespace tfmpi {

namespace {

constexpr int kTagHeartbeat = 7201;
// What a heartbeat carries: nothing but its arrival. Static, so that a send
// MPI cannot cancel may be freed while MPI still reads it (Stop).
const int kBeat = 1;

}  // namespace

void Liveness::Start(MPI_Comm comm, int rank, int size, double timeout_s, std::function<void()> wake) {
  Stop();
  timeout_s_ = timeout_s;
  if (timeout_s <= 0 || size <= 1 || comm == MPI_COMM_NULL) return;
  comm_ = comm;
  rank_ = rank;
  size_ = size;
  wake_ = std::move(wake);
  // Six heartbeats per timeout (at most one a second): a heartbeat late by a
  // scheduler hiccup or two is not taken for a lost peer.
  const double interval_s = std::clamp(timeout_s / 6, 0.01, 1.0);
  interval_ = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(interval_s));
  requests_.assign(size, MPI_REQUEST_NULL);
  last_heard_.assign(size, Clock::now());
  news_ = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = true;
    watched_.assign(size, false);
    declared_.clear();
    if (rank == 0) {
      for (int r = 1; r < size; ++r) watched_[r] = true;
    } else {
      watched_[0] = true;
    }
  }
  thread_ = std::thread([this] { Run(); });
}

void Liveness::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
  }
  cv_.notify_all();
  if (!thread_.joinable()) return;
  thread_.join();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) requests_.clear();  // nothing left to release
  for (MPI_Request& r : requests_) {
    if (r == MPI_REQUEST_NULL) continue;
    int done = 0;
    MPI_Test(&r, &done, MPI_STATUS_IGNORE);
    if (done) continue;
    MPI_Cancel(&r);  // Open MPI does not cancel sends: then freed, kBeat being static
    MPI_Request_free(&r);
  }
  requests_.clear();
}

std::vector<int> Liveness::TakeUnreachable() {
  std::lock_guard<std::mutex> lock(mu_);
  news_ = false;
  std::vector<int> out;
  out.swap(declared_);
  std::sort(out.begin(), out.end());
  return out;
}

void Liveness::Forget(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank >= 0 && rank < static_cast<int>(watched_.size())) watched_[rank] = false;
}

void Liveness::Beat(int peer) {
  MPI_Request& r = requests_[peer];
  if (r != MPI_REQUEST_NULL) {
    int done = 0;
    MPI_Test(&r, &done, MPI_STATUS_IGNORE);
    if (!done) return;  // one heartbeat in flight per peer: an unreachable one does not pile them up
  }
  MPI_Isend(&kBeat, 1, MPI_INT, peer, kTagHeartbeat, comm_, &r);
}

void Liveness::Run() {
  const auto timeout = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
  std::vector<bool> watched;
  Clock::time_point last_round = Clock::now();
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!running_) return;
      watched = watched_;
    }
    Clock::time_point now = Clock::now();
    // This thread did not run for half the timeout (the process was stopped,
    // or its host froze): it saw nothing of its peers meanwhile, so their
    // silence counts from now. A job stopped and resumed as a whole thus
    // declares no one; a rank stopped alone is declared by the others.
    if (now - last_round > timeout / 2) std::fill(last_heard_.begin(), last_heard_.end(), now);
    last_round = now;
    // Whatever arrived counts, from a forgotten peer too (it is ignored then).
    int flag = 1, beat = 0;
    MPI_Status status;
    while (true) {
      MPI_Iprobe(MPI_ANY_SOURCE, kTagHeartbeat, comm_, &flag, &status);
      if (!flag) break;
      MPI_Recv(&beat, 1, MPI_INT, status.MPI_SOURCE, kTagHeartbeat, comm_, MPI_STATUS_IGNORE);
      last_heard_[status.MPI_SOURCE] = now;
    }
    // To the peers still watched: a worker that declared rank 0 unreachable
    // (or learned it stopped) falls silent, so rank 0, if it is alive after
    // all, declares this rank in turn and fails the collectives of the rest.
    for (int r = 0; r < size_; ++r)
      if (watched[r]) Beat(r);
    std::vector<int> late;
    for (int r = 0; r < size_; ++r)
      if (watched[r] && now - last_heard_[r] > timeout) late.push_back(r);
    if (!late.empty()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (int r : late) {
          if (!watched_[r]) continue;  // forgotten meanwhile
          watched_[r] = false;
          declared_.push_back(r);
        }
        news_ = !declared_.empty();
      }
      if (news_ && wake_) wake_();
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, interval_, [this] { return !running_; });
  }
}

}  // namespace tfmpi
