#include "negotiation/outbox.h"

#include <thread>

namespace tfmpi {

void Outbox::Send(MPI_Comm comm, int dest, int tag, std::shared_ptr<std::vector<char>> bytes) {
  msgs_.push_back({std::move(bytes), MPI_REQUEST_NULL, dest});
  auto& m = msgs_.back();
  MPI_Isend(m.bytes->data(), static_cast<int>(m.bytes->size()), MPI_BYTE, dest, tag, comm, &m.req);
}

void Outbox::Reap() {
  for (auto it = msgs_.begin(); it != msgs_.end();) {
    int done = 0;
    MPI_Test(&it->req, &done, MPI_STATUS_IGNORE);
    it = done ? msgs_.erase(it) : std::next(it);
  }
}

Outbox::Undelivered Outbox::Close(Clock::duration limit) {
  const auto deadline = Clock::now() + limit;
  while (!msgs_.empty() && Clock::now() < deadline) {
    Reap();
    std::this_thread::yield();
  }
  Undelivered lost;
  if (msgs_.empty()) return lost;
  for (Msg& m : msgs_) MPI_Cancel(&m.req);
  const auto cancel_deadline = Clock::now() + std::chrono::milliseconds(100);
  do {
    for (auto it = msgs_.begin(); it != msgs_.end();) {
      int done = 0, cancelled = 0;
      MPI_Status st;
      MPI_Test(&it->req, &done, &st);
      if (!done) { ++it; continue; }
      MPI_Test_cancelled(&st, &cancelled);
      if (cancelled) Count(*it, &lost);
      it = msgs_.erase(it);
    }
    std::this_thread::yield();
  } while (!msgs_.empty() && Clock::now() < cancel_deadline);
  static auto* kept = new std::vector<std::shared_ptr<std::vector<char>>>();  // leaked on purpose
  for (Msg& m : msgs_) {
    Count(m, &lost);
    MPI_Request_free(&m.req);
    kept->push_back(std::move(m.bytes));
  }
  msgs_.clear();
  return lost;
}

void Outbox::Count(const Msg& m, Undelivered* lost) {
  ++lost->messages;
  lost->bytes += static_cast<int64_t>(m.bytes->size());
  lost->ranks.insert(m.dest);
}

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

}  // namespace tfmpi
