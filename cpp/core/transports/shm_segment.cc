#include "transports/shm_segment.h"

#include "transports/peer_failure.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

namespace tfmpi {

namespace {

using Clock = std::chrono::steady_clock;

// Two lines, so that the adjacent-line prefetcher does not couple neighbours.
constexpr size_t kLine = 128;
// The wait policy (see the header): spin, then yield, then nap.
constexpr auto kSpinFor = std::chrono::microseconds(10);
constexpr auto kYieldFor = std::chrono::milliseconds(5);
constexpr auto kNap = std::chrono::microseconds(50);
constexpr auto kCheckEvery = std::chrono::milliseconds(5);

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory flags need lock-free 64-bit atomics");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared-memory flags need lock-free 32-bit atomics");

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Whether process `pid` exists and has not exited (a zombie has exited).
bool Alive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return true;  // no /proc: trust kill()
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  // "pid (comm) S ...": the state follows the last ')'.
  const char* close = std::strrchr(buf, ')');
  if (!close || close + 2 >= buf + n) return true;
  return close[2] != 'Z' && close[2] != 'X';
}

// Runs `fn` with stderr (fd 2) captured, then writes back what it printed
// except lines containing `drop`. Open MPI 5 builds with UCX but no UCX
// transport for one-sided communication print a bogus "OSC UCX component
// priority set inside component query failed" error for every window they
// create (open-mpi/ompi#14086; the window then uses osc/sm, as intended).
// Anything else printed meanwhile, from any thread, comes out unchanged.
template <typename Fn>
void FilterStderr(const char* drop, Fn fn) {
  std::fflush(stderr);
  FILE* capture = std::tmpfile();
  const int saved = capture ? dup(2) : -1;
  if (saved < 0 || dup2(fileno(capture), 2) < 0) {
    if (saved >= 0) close(saved);
    if (capture) std::fclose(capture);
    fn();
    return;
  }
  fn();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::rewind(capture);
  char line[4096];
  while (std::fgets(line, sizeof(line), capture)) {
    // The message is followed by a line holding a single space.
    if (std::strstr(line, drop) || std::strcmp(line, " \n") == 0) continue;
    std::fputs(line, stderr);
  }
  std::fclose(capture);
}

}  // namespace

struct ShmSegment::Control {
  struct alignas(kLine) Counter { std::atomic<uint64_t> value{0}; };
  Counter counters[3];
  alignas(kLine) std::atomic<int64_t> pid{0};
  std::atomic<uint32_t> aborted{0};
  char reason[512] = {};  // written before `aborted` is raised
};

std::unique_ptr<ShmSegment> ShmSegment::Create(MPI_Comm local, int64_t slot_bytes, int buffers, double stall_limit_s,
                                               std::string* why) {
  std::unique_ptr<ShmSegment> s(new ShmSegment());
  s->local_ = local;
  MPI_Comm_rank(local, &s->rank_);
  MPI_Comm_size(local, &s->size_);
  s->buffers_ = buffers;
  s->slot_bytes_ = slot_bytes;
  s->stall_limit_s_ = stall_limit_s;
  const int64_t control_bytes = RoundUp(sizeof(Control), 4096);
  const int64_t area = control_bytes + static_cast<int64_t>(buffers) * s->size_ * slot_bytes;

  // An allocation failure is returned, not fatal, and then agreed below.
  MPI_Errhandler previous;
  MPI_Comm_get_errhandler(local, &previous);
  MPI_Comm_set_errhandler(local, MPI_ERRORS_RETURN);
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");  // each area on its own pages, first touched by its owner
  char* base = nullptr;
  int rc = MPI_ERR_OTHER;
  FilterStderr("OSC UCX component priority set inside component query failed",
               [&] { rc = MPI_Win_allocate_shared(area, 1, info, local, &base, &s->win_); });
  MPI_Info_free(&info);
  MPI_Comm_set_errhandler(local, previous);
  MPI_Errhandler_free(&previous);

  int ok = rc == MPI_SUCCESS ? 1 : 0;
  std::string reason = ok ? "" : "MPI_Win_allocate_shared failed";
  if (ok) {
    int* model = nullptr;
    int found = 0;
    MPI_Win_get_attr(s->win_, MPI_WIN_MODEL, &model, &found);
    if (!found || *model != MPI_WIN_UNIFIED) {
      ok = 0;
      reason = "the MPI's shared window is not in the unified memory model";
    }
  }
  int all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_LAND, local);
  if (!all_ok) {
    *why = reason.empty() ? "another rank of this node could not set up its shared memory" : reason;
    return nullptr;  // a window that was allocated is kept, like the others (see the header)
  }
  MPI_Win_lock_all(MPI_MODE_NOCHECK, s->win_);

  Control* mine = new (base) Control();
  mine->pid.store(getpid(), std::memory_order_relaxed);
  MPI_Win_sync(s->win_);
  MPI_Barrier(local);  // every control block is initialised
  MPI_Win_sync(s->win_);
  for (int p = 0; p < s->size_; ++p) {
    MPI_Aint size = 0;
    int disp = 0;
    char* ptr = nullptr;
    MPI_Win_shared_query(s->win_, p, &size, &disp, &ptr);
    s->controls_.push_back(reinterpret_cast<Control*>(ptr));
    s->data_.push_back(ptr + control_bytes);
    const int64_t pid = s->controls_.back()->pid.load(std::memory_order_acquire);
    s->pids_.push_back(pid);
    s->pid_visible_.push_back(p == s->rank_ || Alive(pid));
  }
  return s;
}

ShmSegment::~ShmSegment() = default;  // the window is kept (see the header)

void ShmSegment::Publish(Flag f, uint64_t value) {
  control(rank_)->counters[f].value.store(value, std::memory_order_release);
}

void ShmSegment::ProgressMpi() const {
  int flag = 0;
  MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, local_, &flag, MPI_STATUS_IGNORE);  // nothing is ever sent on it
}

Status ShmSegment::CheckPeers() const {
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Control* c = control(p);
    if (c->aborted.load(std::memory_order_acquire))
      return Status::Aborted("tf_mpi: shared-memory collective: local rank " + std::to_string(p) +
                             " gave up: " + std::string(c->reason, strnlen(c->reason, sizeof(c->reason))));
    if (pid_visible_[p] && !Alive(pids_[p]))
      return Status::Aborted("tf_mpi: shared-memory collective: local rank " + std::to_string(p) + " (pid " +
                             std::to_string(pids_[p]) + ") exited while this rank waited for it");
  }
  return Status::OK();
}

Status ShmSegment::WaitFor(int peer, Flag f, uint64_t value) {
  if (!broken_.ok()) return broken_;
  const std::atomic<uint64_t>& flag = control(peer)->counters[f].value;
  if (flag.load(std::memory_order_acquire) >= value) return Status::OK();
  const auto start = Clock::now();
  auto now = start;
  for (int i = 1;; ++i) {
    CpuRelax();
    if (flag.load(std::memory_order_acquire) >= value) {
      wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
      return Status::OK();
    }
    if ((i & 63) == 0 && (now = Clock::now()) - start > kSpinFor) break;
  }
  auto next_check = start + kCheckEvery;
  for (;;) {
    ProgressMpi();
    if (now - start < kYieldFor) sched_yield();
    else std::this_thread::sleep_for(kNap);
    if (flag.load(std::memory_order_acquire) >= value) break;
    now = Clock::now();
    if (now < next_check) continue;
    next_check = now + kCheckEvery;
    Status s = CheckPeers();
    if (s.ok() && stall_limit_s_ > 0 && std::chrono::duration<double>(now - start).count() > stall_limit_s_)
      s = Status::Aborted("tf_mpi: shared-memory collective: local rank " + std::to_string(peer) +
                          " made no progress for " + std::to_string(stall_limit_s_) +
                          " s (TF_MPI_STALL_SHUTDOWN_TIME_SECONDS)");
    if (!s.ok()) {
      Break(s);
      // Elastic mode: the same failure as an MPI call's, so that every rank recovers alike.
      if (WatchingPeerFailures()) RaisePeerFailure(s.message);
      return s;
    }
  }
  wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  return Status::OK();
}

void ShmSegment::Break(const Status& why) {
  if (!broken_.ok()) return;
  broken_ = why;
  Control* mine = control(rank_);
  std::strncpy(mine->reason, why.message.c_str(), sizeof(mine->reason) - 1);
  mine->aborted.store(1, std::memory_order_release);
}

}  // namespace tfmpi
