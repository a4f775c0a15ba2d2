// Runs rank 0's decisions on this rank: updates the response cache, performs
// the MPI collectives (fused where possible) and completes the callers'
// requests. Every rank runs the same decisions in the same order.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/env.h"
#include "common/request.h"
#include "common/timeline.h"
#include "execution/decision.h"
#include "execution/hierarchical.h"
#include "execution/response_cache.h"
#include "transports/collectives.h"
#include "transports/cuda_device.h"
#include "transports/device.h"
#include "transports/gpu_transport.h"
#include "transports/shm_allreduce.h"

namespace tfmpi {

using InFlight = std::unordered_map<std::string, std::unique_ptr<Request>>;

// Counters since process start, read from other threads: requests completed,
// requests failed, allreduce buckets (one fused buffer or direct tensor each),
// on rank 0 allreduces held back to go with later ones (holdback.h), and for
// GPU requests the bytes each transport moved (gpu_transport.h). The engine
// adds what shows how it treats callers' threads and shutdown (engine.h):
// batches a caller executed inline and the largest of them in bytes, batches
// a caller left to the engine thread, completion callbacks that found an
// engine lock held (always 0 unless a bug), and protocol messages that never
// reached their peer at shutdown.
struct ExecutorStats {
  std::atomic<int64_t> requests{0}, errors{0}, allreduce_buckets{0}, held_back{0};
  std::atomic<int64_t> gpu_requests{0}, gpu_staged_bytes{0}, gpu_direct_bytes{0};
  std::atomic<int64_t> inline_batches{0}, inline_max_batch_bytes{0}, deferred_batches{0};
  std::atomic<int64_t> callbacks_under_lock{0}, undelivered_messages{0}, undelivered_bytes{0};
  // Host allreduces (buffers: fused or direct) run by the hierarchical
  // scheme (hierarchical.h), and their bytes.
  std::atomic<int64_t> hierarchical_allreduces{0}, hierarchical_bytes{0};
  // The negotiation's own messages (announcements, reports, decisions; not
  // the collectives' payloads) this rank sent and received, and their bytes
  // (protocol.h): what the negotiation tree keeps at O(log N) per step.
  std::atomic<int64_t> negotiation_msgs_sent{0}, negotiation_bytes_sent{0};
  std::atomic<int64_t> negotiation_msgs_received{0}, negotiation_bytes_received{0};
  // Payload bytes this rank handed to MPI collectives (what gradient
  // compression saves), in total and per CollectiveType (indexed by its
  // value; kJoin moves no payload). Allreduce and reducescatter: the whole
  // input buffer; allgather: this rank's rows; broadcast: the root's buffer
  // (0 elsewhere); alltoall: the rows sent to other ranks. Negotiation
  // messages are not counted.
  std::atomic<int64_t> payload_bytes_sent{0};
  std::atomic<int64_t> payload_bytes_by_type[5] = {};
  void CountPayload(CollectiveType type, int64_t bytes) {
    payload_bytes_sent += bytes;
    payload_bytes_by_type[static_cast<int>(type)] += bytes;
  }
  // Allreduce buckets (and their bytes) that ran over shared memory (shm_allreduce.h).
  std::atomic<int64_t> shm_allreduces{0}, shm_bytes{0};
  // Shared-memory buckets of several tensors, and their tensors, reduced
  // from and into the tensors' own buffers (no fusion buffer: ShmPiece).
  std::atomic<int64_t> shm_fused_buckets{0}, shm_fused_pieces{0};
  // Shared-memory allreduces whose slots this rank wrote with non-temporal stores (SlotWrites).
  std::atomic<int64_t> shm_streamed_slots{0};
};

class Executor {
 public:
  Executor(const MpiContext* mpi, const EngineConfig& config, const GpuTransportChoice& gpu,
           const HierarchicalChoice& hierarchical, ExecutorStats* stats, Timeline* timeline)
      : mpi_(mpi), collectives_(mpi, config.tunables.chunk_bytes),
        hierarchical_(mpi, hierarchical, config),
        gpu_(&collectives_, gpu.transport, config.gpu_chunk_bytes),
        managed_scratch_(gpu.transport == GpuTransport::kDirect && gpu.mpi_cuda_aware != 1), tunables_(config.tunables),
        stats_(stats), timeline_(timeline), shm_(ShmCollectives::Create(mpi, config)) {}
  HierarchicalAllreduce& hierarchical_allreduce() { return hierarchical_; }

  // Executes `decisions`; requests they name are completed and removed from
  // `in_flight`. Returns false if a decision names a request this rank does
  // not have (a protocol error: the caller must abort rather than hang).
  bool Run(const std::vector<Decision>& decisions, InFlight* in_flight, ResponseCache* cache);
  const Tunables& tunables() const { return tunables_; }
  // Whether Tunables::direct_bytes can change nothing: every host allreduce
  // goes over shared memory, which reduces tensors where they lie (no fusion
  // buffer to skip), and GPU tensors never skip it. The autotuner then leaves
  // that setting alone.
  bool direct_bytes_inert() const { return shm_ && shm_->Chooses(0); }


 private:
  struct Work { Request* request; const Response* response; };
  // A stand-in for a collective this rank did not submit because it called
  // join(): zeros (the reduce op's identity) in, results discarded.
  static std::unique_ptr<Request> JoinedStandIn(const Response& r);
  void RunAllreduces(const std::vector<Work>& work);
  void RunAllgather(const Work& w);
  void RunBroadcast(const Work& w);
  void RunAlltoall(const Work& w);
  void RunReducescatter(const Work& w);
  // Whether MPI can move `w` (counts are ints); checked from what every rank
  // knows alike, so a collective past a limit fails everywhere before any MPI call.
  Status CheckLimits(const Work& w) const;
  // Average divides by the ranks that contributed (not those that joined).
  double PostScale(const RequestMeta& m, int contributors) const;

  // The memory a request's buffers live in: the host, or the GPU it names
  // (whose stream is then made to wait for the request's producer).
  Device& DeviceOf(Request* r);
  // Output `index` of `r`, allocated now that its shape is known.
  void* Allocate(Device& dev, Request* r, size_t index, const Shape& shape);
  // Where MPI reads and writes `bytes` at `ptr` of `dev` (gpu_transport.h);
  // the identity on the host.
  void* Stage(Device& dev, int slot, void* ptr, int64_t bytes, bool copy_in);
  void Unstage(Device& dev, void* ptr, void* view, int64_t bytes);
  // Reduces `buf` in place on `dev`; `members` and `args` as for HostAllreduce.
  void ReduceInPlace(Device& dev, void* buf, int64_t count, DataType dtype, ReduceOp op,
                     const std::vector<const Request*>& members, const std::string& args);
  // Allreduce of host memory (in == nullptr: in place): the one place that
  // picks flat or hierarchical (hierarchical.h) by the buffer's size, alike on
  // every rank. The hierarchical phases go on `members`' timeline tracks.
  void HostAllreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op,
                     const std::vector<const Request*>& members, const std::string& args);
  // The one place that picks the transport of a host allreduce: shared
  // memory (shm_allreduce.h) when it is set up and chooses `bytes`, which
  // every rank answers alike.
  bool UseShm(const Device& dev, int64_t bytes) const { return shm_ && dev.is_host() && shm_->Chooses(bytes); }
  // The shared-memory allreduce of `pieces` (one or more tensors); fails
  // `reqs` if it fails. Returns timeline args to add.
  std::string RunShm(const std::vector<Request*>& reqs, const std::vector<ShmPiece>& pieces, DataType dtype,
                     ReduceOp op);
  // Waits for `dev`, and fails `reqs` with its error if it had one.
  void Settle(Device& dev, const std::vector<Request*>& reqs);

  const MpiContext* mpi_;
  Collectives collectives_;
  HierarchicalAllreduce hierarchical_;
  GpuCollectives gpu_;
  // The direct transport was forced on an MPI that does not report CUDA
  // support: the engine's own GPU buffers are then managed (CPU-accessible)
  // memory, so such an MPI can still read them (with managed-memory tensors).
  bool managed_scratch_;
  Tunables tunables_;  // changed only by kSettings decisions, so identical on all ranks
  HostDevice host_;
  // One GPU per rank (as in Horovod): created for the first GPU request.
  std::unique_ptr<CudaDevice> cuda_;
  // The GPU is current on the executing thread (which may be a caller that
  // drives the protocol) from the first GPU request of a Run() to its end.
  std::optional<ScopedCudaDevice> on_gpu_;
  // Requests whose device work failed; completed with that error.
  std::unordered_map<const Request*, Status> failed_;
  ExecutorStats* stats_;
  Timeline* timeline_;
  std::chrono::steady_clock::time_point decided_;  // when the running batch was decided/received
  int64_t bucket_id_ = 0;
  std::unique_ptr<ShmCollectives> shm_;  // null: every allreduce takes the MPI path
};

}  // namespace tfmpi
