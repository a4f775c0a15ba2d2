#include "execution/watchdog.h"

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "common/env.h"
#include "common/logging.h"
#include "transports/mpi_context.h"
#include "transports/peer_failure.h"

namespace tfmpi {

WatchdogSettings WatchdogSettings::FromEnv() {
  WatchdogSettings s;
  s.seconds = EnvDouble("TF_MPI_MPI_TIMEOUT_SECONDS", s.seconds);
  s.mb_per_s = EnvDouble("TF_MPI_MPI_TIMEOUT_MB_PER_S", s.mb_per_s);
  if (s.seconds > 0 && !(s.mb_per_s > 0))
    throw std::invalid_argument("tf_mpi: TF_MPI_MPI_TIMEOUT_MB_PER_S must be positive");
  return s;
}

std::chrono::duration<double> WatchdogSettings::Limit(int64_t bytes) const {
  return std::chrono::duration<double>(seconds + static_cast<double>(bytes) / (mb_per_s * 1e6));
}

void Watchdog::Start(const WatchdogSettings& settings) {
  Stop();
  settings_ = settings;
  if (settings_.seconds <= 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = true;
    in_flight_ = false;
  }
  thread_ = std::thread([this] { Monitor(); });
}

void Watchdog::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::Begin(const std::string& name, size_t count, int64_t bytes) {
  if (settings_.seconds <= 0) return;
  const auto limit = std::chrono::duration_cast<Clock::duration>(settings_.Limit(bytes));
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_ = true;
  started_ = Clock::now();
  limit_ = limit;
  name_.assign(name, 0, std::min<size_t>(name.size(), 200));
  count_ = count;
  bytes_ = bytes;
}

void Watchdog::End() {
  if (settings_.seconds <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_ = false;
}

void Watchdog::Monitor() {
  // Checked a few times per base timeout (at most every second, at least every
  // 50 ms): detection comes at most one period after the limit, and the
  // thread wakes at most 20 times a second however many collectives run.
  const auto period = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::clamp(settings_.seconds / 4, 0.05, 1.0)));
  std::unique_lock<std::mutex> lock(mu_);
  while (running_) {
    cv_.wait_for(lock, period, [this] { return !running_; });
    if (!running_ || !in_flight_) continue;
    const auto waited = Clock::now() - started_;
    if (waited <= limit_) continue;
    std::string what = "'" + name_ + "'";
    if (count_ > 1) what += " and " + std::to_string(count_ - 1) + " more collective(s)";
    what += " (" + std::to_string(bytes_) + " bytes)";
    const double waited_s = std::chrono::duration<double>(waited).count();
    const double limit_s = std::chrono::duration<double>(limit_).count();
    in_flight_ = false;  // once per batch
    lock.unlock();
    Expire(what, waited_s, limit_s);
    lock.lock();
  }
}

void Watchdog::Expire(const std::string& what, double waited_s, double limit_s) {
  char text[640];
  std::snprintf(text, sizeof(text),
                "collective %s has been inside MPI for %.3g s without completing (limit %.3g s: "
                "TF_MPI_MPI_TIMEOUT_SECONDS=%g + bytes / TF_MPI_MPI_TIMEOUT_MB_PER_S=%g MB/s). Every rank had "
                "submitted it, so a peer or the network between the ranks stopped responding (a cut link, a "
                "frozen host or process)",
                what.c_str(), waited_s, limit_s, settings_.seconds, settings_.mb_per_s);
  if (WatchingPeerFailures()) {
    RevokeEngineCommunicators(text);
    return;
  }
  LogError(std::string(text) + "; aborting the job");
  AbortJob(1);
  std::abort();  // not reached: AbortJob ends the process
}

}  // namespace tfmpi
