// The negotiation messages' transport: non-blocking sends whose buffers
// live until MPI is done with them (Outbox), and a non-blocking receive of
// whatever message has arrived (TryReceive). Used only by whoever runs the
// engine's protocol (engine.h: under progress_mu_).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <set>
#include <vector>

namespace tfmpi {

class Outbox {
 public:
  using Clock = std::chrono::steady_clock;
  void Send(MPI_Comm comm, int dest, int tag, std::shared_ptr<std::vector<char>> bytes);
  // Forgets the sends that have completed.
  void Reap();
  struct Undelivered {
    int64_t messages = 0, bytes = 0;
    std::set<int> ranks;
  };
  // At exit: gives peers `limit` to take our last messages, then cancels the
  // rest. No request is left pending on memory that is freed: a send that MPI
  // cannot cancel (Open MPI does not cancel sends) is released with
  // MPI_Request_free and its buffer kept for the life of the process, since
  // MPI may still read it. Returns what never reached its peer.
  Undelivered Close(Clock::duration limit);

 private:
  struct Msg { std::shared_ptr<std::vector<char>> bytes; MPI_Request req; int dest; };
  static void Count(const Msg& m, Undelivered* lost);
  std::list<Msg> msgs_;
};

// Receives one message with `tag` from `source` (or MPI_ANY_SOURCE) if one
// has arrived; returns false at once otherwise.
bool TryReceive(MPI_Comm comm, int source, int tag, std::vector<char>* bytes, int* from);

}  // namespace tfmpi
