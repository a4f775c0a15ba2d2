// What a lost peer does to the engine's MPI calls in elastic mode.
//
// Without elastic mode MPI's default error handler stands: an error in any
// MPI call ends the job, and a rank that dies takes the job with it (Open MPI
// kills the others). With elastic mode on (TF_MPI_ELASTIC=1, started through
// an Open MPI with ULFM: `python -m tf_mpi.run --min-np ...`), every
// communicator the engine makes gets the handler below. When an MPI call fails
// (a peer died or was declared dead by ULFM's heartbeat detector:
// MPI_ERR_PROC_FAILED; another rank revoked the communicator: MPI_ERR_REVOKED)
// the handler
//   1. revokes every communicator of the engine (MPIX_Comm_revoke), so that
//      each surviving rank's pending and next MPI call on them fails too,
//      wherever that rank is blocked (a rank waiting on a live peer would
//      otherwise wait forever: only the failed rank's direct partners see
//      MPI_ERR_PROC_FAILED);
//   2. switches them to MPI_ERRORS_RETURN, so that tearing the engine down
//      afterwards (cancelling sends, freeing requests) never throws again;
//   3. throws PeerFailure out of the MPI call.
// The protocol (negotiation/protocol.cc) catches PeerFailure, fails every
// pending request with StatusCode::kUnavailable and stops; the engine then
// refuses new work with the same status until shutdown() + init() on a
// shrunk communicator (tf_mpi/elastic.py does that with mpi4py's Shrink).
//
// Throwing through MPI's C frames: Open MPI calls a communicator's error
// handler from the API function's return path, after the operation has left
// its internal locks (its own former C++ binding implemented
// MPI::ERRORS_THROW_EXCEPTIONS the same way). The libraries are built with
// unwind tables (x86-64 and aarch64 defaults). The revoked communicators are
// never used again.
#pragma once

#include <mpi.h>

#include <stdexcept>
#include <string>

namespace tfmpi {

class PeerFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// True where this MPI has ULFM's extension (MPIX_Comm_revoke); elastic mode needs it.
bool PeerFailureSupported();

// Gives `comm` the handler above and remembers it as one of the engine's
// communicators (the ones step 1 revokes). Communicators split or duplicated
// from `comm` inherit the handler (MPI's rule); register them too with
// WatchPeerFailures so that they are revoked alike.
void WatchPeerFailures(MPI_Comm comm);
// Forgets `comm` (when the engine retires it).
void ForgetPeerFailures(MPI_Comm comm);
// True while some engine communicator is watched (elastic mode is on).
bool WatchingPeerFailures();
// Steps 1-3 for a failure found outside MPI (a shared-memory peer whose
// process is gone, shm_segment.h): revokes and throws PeerFailure(why).
[[noreturn]] void RaisePeerFailure(const std::string& why);

// Steps 1-2 without an error of this rank's own: used by the MPI watchdog
// (execution/watchdog.h) when a call has hung past its limit, so that the
// stuck call returns MPI_ERR_REVOKED here and on every rank.
void RevokeEngineCommunicators(const std::string& why);

// ULFM's fault-tolerant agreement (MPIX_Comm_agree) on `comm`: *flag becomes
// the AND of the surviving ranks' flags, the same on every one of them, even
// when ranks fail meanwhile. Returns the MPI error code (MPI_ERR_PROC_FAILED
// where a failure was not acknowledged yet; where ULFM is missing, the
// result of a plain MPI_Allreduce). `comm` should return errors.
int AgreeFlag(MPI_Comm comm, int* flag);

// The first failure this process has seen since the last Reset (empty if none).
std::string FirstPeerFailure();
void ResetPeerFailures();

}  // namespace tfmpi
