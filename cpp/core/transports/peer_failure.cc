#include "transports/peer_failure.h"

#include <algorithm>
#include <mutex>
#include <vector>

#if defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#endif

#include "common/logging.h"

namespace tfmpi {

namespace {

#if defined(MPIX_ERR_REVOKED) && defined(OMPI_HAVE_MPI_EXT_FTMPI)
constexpr bool kHaveUlfm = true;
int Revoke(MPI_Comm comm) { return MPIX_Comm_revoke(comm); }
int Agree(MPI_Comm comm, int* flag) { return MPIX_Comm_agree(comm, flag); }
#else
constexpr bool kHaveUlfm = false;
int Revoke(MPI_Comm) { return MPI_ERR_OTHER; }
int Agree(MPI_Comm comm, int* flag) {
  int mine = *flag;
  return MPI_Allreduce(&mine, flag, 1, MPI_INT, MPI_BAND, comm);
}
#endif

// The registry: the engine communicators to revoke, and the first failure
// seen. g_mu is held only to read or change them, never across an MPI call
// other than the revokes themselves (MPIX_Comm_revoke does not block).
std::mutex g_mu;
std::vector<MPI_Comm> g_comms;
std::string g_first_failure;

std::string ErrorText(int code) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, msg, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(msg, len);
}

// Steps 1 and 2 (peer_failure.h); returns the failure to report.
std::string RevokeAll(const std::string& why) {
  std::vector<MPI_Comm> comms;
  std::string first;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_first_failure.empty()) g_first_failure = why;
    first = g_first_failure;
    comms = g_comms;
  }
  for (MPI_Comm c : comms) {
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    Revoke(c);
  }
  return first;
}

[[noreturn]] void Throw(const std::string& why) {
  const std::string first = RevokeAll(why);
  throw PeerFailure("tf_mpi: a rank of this job failed or stopped responding (" + first +
                    "); every rank's pending collectives fail until the job continues on the ranks that remain "
                    "(tf_mpi.elastic.run does that)");
}

void OnMpiError(MPI_Comm* comm, int* code, ...) {
  if (comm) MPI_Comm_set_errhandler(*comm, MPI_ERRORS_RETURN);
  Throw(ErrorText(*code));
}

}  // namespace

bool PeerFailureSupported() { return kHaveUlfm; }

void WatchPeerFailures(MPI_Comm comm) {
  static MPI_Errhandler handler = [] {
    MPI_Errhandler h;
    MPI_Comm_create_errhandler(&OnMpiError, &h);
    return h;
  }();
  MPI_Comm_set_errhandler(comm, handler);
  std::lock_guard<std::mutex> lock(g_mu);
  g_comms.push_back(comm);
}

void ForgetPeerFailures(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_comms.erase(std::remove(g_comms.begin(), g_comms.end(), comm), g_comms.end());
}

bool WatchingPeerFailures() {
  std::lock_guard<std::mutex> lock(g_mu);
  return !g_comms.empty();
}

void RaisePeerFailure(const std::string& why) { Throw(why); }

int AgreeFlag(MPI_Comm comm, int* flag) { return Agree(comm, flag); }

void RevokeEngineCommunicators(const std::string& why) {
  LogError("revoking the engine's communicators: " + why);
  RevokeAll(why);
}

std::string FirstPeerFailure() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_first_failure;
}

void ResetPeerFailures() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_first_failure.clear();
}

}  // namespace tfmpi
