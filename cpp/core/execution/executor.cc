#include "execution/executor.h"

#include <cstring>

#include "common/logging.h"
#include "common/scale.h"
#include "execution/fusion.h"

namespace tfmpi {

double Executor::PostScale(const RequestMeta& m, int contributors) const {
  return m.op == ReduceOp::kAverage ? m.postscale / contributors : m.postscale;
}

std::unique_ptr<Request> Executor::JoinedStandIn(const Response& r) {
  auto req = std::make_unique<Request>();
  req->meta = r.meta;
  auto storage = std::make_shared<std::vector<std::vector<char>>>();
  for (TensorMeta& t : req->meta.tensors) {
    if (r.meta.type == CollectiveType::kAllgather) t.shape[0] = 0;  // contributes no rows
    const int64_t count = NumElements(t.shape);
    storage->emplace_back(std::max<int64_t>(1, count) * DataTypeSize(t.dtype));
    FillIdentity(storage->back().data(), count, t.dtype, r.meta.op);
    req->inputs.push_back(storage->back().data());
    storage->emplace_back(std::max<int64_t>(1, count) * DataTypeSize(t.dtype));
    req->outputs.push_back(storage->back().data());
  }
  auto gathered = std::make_shared<std::vector<std::vector<char>>>();
  req->allocate = [gathered](size_t, const Shape& s) -> void* {
    gathered->emplace_back(std::max<int64_t>(1, NumElements(s)) * 16);
    return gathered->back().data();
  };
  req->done = [storage, gathered](const Status&) {};
  return req;
}

namespace {
using TClock = std::chrono::steady_clock;

// Records one phase of an operation on the track of every request it served.
void Phase(Timeline* tl, const std::vector<const Request*>& reqs, const char* name, TClock::time_point start,
           const std::string& args) {
  if (!tl->active()) return;
  const auto end = TClock::now();
  for (const Request* r : reqs) tl->Span(r->meta.name, name, start, end, args);
}
}  // namespace

Device& Executor::DeviceOf(Request* r) {
  if (r->device < 0) return host_;
  if (!on_gpu_) on_gpu_.emplace(r->device);
  if (!cuda_) {
    // Enqueue admitted the request only after loading the CUDA part.
    cuda_ = std::make_unique<CudaDevice>(CudaApi(nullptr), r->device, managed_scratch_);
  }
  if (r->ready_event) {
    cuda_->WaitAndRelease(r->ready_event);
    r->ready_event = nullptr;
  }
  return *cuda_;
}

void* Executor::Allocate(Device& dev, Request* r, size_t index, const Shape& shape) {
  void* out = r->allocate(index, shape);
  if (!dev.is_host() && r->stream) {
    // A framework's allocator may hand out memory whose last readers are
    // still queued on the producer's stream (TensorFlow frees a tensor when
    // its last reader is queued, relying on stream order): order our writes
    // after them.
    void* event = nullptr;
    Status s = RecordReadyEvent(r->device, r->stream, &event);
    if (s.ok()) static_cast<CudaDevice&>(dev).WaitAndRelease(event);
    else failed_.emplace(r, s);
  }
  return out;
}

void* Executor::Stage(Device& dev, int slot, void* ptr, int64_t bytes, bool copy_in) {
  if (dev.is_host()) return ptr;
  GpuCounters c;
  void* view = gpu_.Stage(static_cast<CudaDevice&>(dev), slot, ptr, bytes, copy_in, &c);
  stats_->gpu_staged_bytes += c.staged_bytes;
  stats_->gpu_direct_bytes += c.direct_bytes;
  return view;
}

void Executor::Unstage(Device& dev, void* ptr, void* view, int64_t bytes) {
  if (dev.is_host()) return;
  GpuCounters c;
  gpu_.Unstage(static_cast<CudaDevice&>(dev), ptr, view, bytes, &c);
  stats_->gpu_staged_bytes += c.staged_bytes;
}

void Executor::HostAllreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op,
                             const std::vector<const Request*>& members, const std::string& args) {
  const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(dtype));
  if (!hierarchical_.Chooses(bytes)) {
    collectives_.Allreduce(in, out, count, dtype, op);
    return;
  }
  ++stats_->hierarchical_allreduces;
  stats_->hierarchical_bytes += bytes;
  hierarchical_.Allreduce(in, out, count, dtype, op, [&](const char* phase, TClock::time_point start) {
    Phase(timeline_, members, phase, start, args);
  });
}

void Executor::ReduceInPlace(Device& dev, void* buf, int64_t count, DataType dtype, ReduceOp op,
                             const std::vector<const Request*>& members, const std::string& args) {
  if (dev.is_host()) {
    HostAllreduce(nullptr, buf, count, dtype, op, members, args);
    return;
  }
  GpuCounters c;
  gpu_.Allreduce(static_cast<CudaDevice&>(dev), buf, count, dtype, op, &c);
  stats_->gpu_staged_bytes += c.staged_bytes;
  stats_->gpu_direct_bytes += c.direct_bytes;
}

std::string Executor::RunShm(const std::vector<Request*>& reqs, const std::vector<ShmPiece>& pieces, DataType dtype,
                             ReduceOp op) {
  const Status s = shm_->Allreduce(pieces, dtype, op);
  ++stats_->shm_allreduces;
  int64_t count = 0;
  for (const ShmPiece& p : pieces) count += p.count;
  stats_->shm_bytes += count * static_cast<int64_t>(DataTypeSize(dtype));
  if (shm_->last_streamed_slots()) ++stats_->shm_streamed_slots;
  if (pieces.size() > 1) {
    ++stats_->shm_fused_buckets;
    stats_->shm_fused_pieces += static_cast<int64_t>(pieces.size());
  }
  if (!s.ok())
    for (const Request* r : reqs) failed_.emplace(r, s);
  return ", \"transport\": \"shm\", \"wait_us\": " + std::to_string(shm_->last_wait_ns() / 1000) +
         ", \"slots\": \"" + (shm_->last_streamed_slots() ? "streamed" : "cached") + "\"";
}

void Executor::Settle(Device& dev, const std::vector<Request*>& reqs) {
  if (dev.is_host()) return;
  dev.Synchronize();  // the callbacks may run only once the results are on the device
  Status s = dev.TakeError();
  if (s.ok()) return;
  for (const Request* r : reqs) failed_.emplace(r, s);
}

bool Executor::Run(const std::vector<Decision>& decisions, InFlight* in_flight, ResponseCache* cache) {
  decided_ = TClock::now();
  // Responses are copied out of the cache: Put() below may move cache storage.
  std::vector<Response> responses;
  responses.reserve(decisions.size());
  for (const Decision& d : decisions) {
    if (d.kind == Decision::Kind::kError) {
      auto it = in_flight->find(d.response.meta.name);
      if (it != in_flight->end()) {
        if (it->second->ready_event) DeviceOf(it->second.get());  // releases the event
        it->second->done(Status{d.error_code, d.response.error});
        in_flight->erase(it);
        ++stats_->errors;
      }
    } else if (d.kind == Decision::Kind::kExecuteCached) {
      if (!cache->Has(d.cache_id)) {
        LogError("rank 0 scheduled cache entry " + std::to_string(d.cache_id) + ", which this rank does not have");
        return false;
      }
      responses.push_back(cache->Get(d.cache_id));
    } else if (d.kind == Decision::Kind::kExecute) {
      cache->Put(d.response);
      responses.push_back(d.response);
    } else if (d.kind == Decision::Kind::kSettings) {
      tunables_ = d.tunables;
      collectives_.set_chunk_bytes(tunables_.chunk_bytes);
      hierarchical_.set_chunk_bytes(tunables_.chunk_bytes);
    }
  }

  std::vector<Work> allreduces, others;
  std::vector<std::unique_ptr<Request>> stand_ins;
  const bool joined = in_flight->count(kJoinName) > 0;
  for (const Response& r : responses) {
    auto it = in_flight->find(r.meta.name);
    Request* req = nullptr;
    if (it != in_flight->end()) {
      req = it->second.get();
    } else if (joined) {
      stand_ins.push_back(JoinedStandIn(r));
      req = stand_ins.back().get();
    } else {
      LogError("rank 0 scheduled '" + r.meta.name + "', which this rank never submitted");
      return false;
    }
    (r.meta.type == CollectiveType::kAllreduce ? allreduces : others).push_back({req, &r});
  }
  RunAllreduces(allreduces);
  for (const Work& w : others) {
    const auto t0 = TClock::now();
    if (timeline_->active()) Phase(timeline_, {w.request}, "QUEUE", decided_, "");
    if (Status s = CheckLimits(w); !s.ok()) {
      if (w.request->ready_event) DeviceOf(w.request);  // releases the event
      failed_.emplace(w.request, s);
      continue;
    }
    switch (w.response->meta.type) {
      case CollectiveType::kAllgather: RunAllgather(w); break;
      case CollectiveType::kBroadcast: RunBroadcast(w); break;
      case CollectiveType::kAlltoall: RunAlltoall(w); break;
      case CollectiveType::kReducescatter: RunReducescatter(w); break;
      case CollectiveType::kJoin: *static_cast<int32_t*>(w.request->outputs[0]) = w.response->meta.root; break;
      default: break;
    }
    if (timeline_->active()) {
      static const char* names[] = {"MPI_ALLREDUCE", "MPI_ALLGATHER", "MPI_BROADCAST", "MPI_ALLTOALL",
                                    "MPI_REDUCESCATTER", "JOIN"};
      Phase(timeline_, {w.request}, names[static_cast<int>(w.response->meta.type)], t0,
            w.request->device >= 0 ? std::string("{\"transport\": \"") + GpuTransportName(gpu_.transport()) + "\"}"
                                   : "");
    }
  }
  for (const Response& r : responses) {
    auto it = in_flight->find(r.meta.name);
    if (it == in_flight->end()) continue;  // a joined rank's stand-in
    if (it->second->device >= 0) ++stats_->gpu_requests;
    auto failed = failed_.find(it->second.get());
    if (failed == failed_.end()) {
      it->second->done(Status::OK());
      ++stats_->requests;
    } else {
      it->second->done(failed->second);
      failed_.erase(failed);
      ++stats_->errors;
    }
    in_flight->erase(it);
  }
  failed_.clear();  // stand-ins' entries
  on_gpu_.reset();
  return true;
}

void Executor::RunAllreduces(const std::vector<Work>& work) {
  struct Slot { Request* req; size_t t; int64_t count; int contributors; };
  std::vector<Slot> slots;
  std::vector<FusionItem> items;
  for (const Work& w : work) {
    const RequestMeta& m = w.request->meta;
    for (size_t t = 0; t < m.tensors.size(); ++t) {
      const int64_t count = NumElements(m.tensors[t].shape);
      if (count == 0) continue;
      slots.push_back({w.request, t, count, mpi_->size() - static_cast<int>(w.response->joined.size())});
      items.push_back({m.tensors[t].dtype, m.op, count * static_cast<int64_t>(DataTypeSize(m.tensors[t].dtype)), m.gpu});
    }
  }
  // Over shared memory a fused bucket costs no copies (its tensors are read
  // and written where they lie, ShmPiece), so tensors that would skip the
  // fusion buffer on the MPI path are fused there too: fewer, longer
  // pipelines. Only when every bucket of such tensors takes shared memory
  // (Chooses: the same answer on every rank), so the plan is alike everywhere.
  const int64_t direct_bytes = shm_ && shm_->Chooses(tunables_.direct_bytes) ? 0 : tunables_.direct_bytes;
  for (const FusionBucket& b : PlanFusion(items, tunables_.fusion_threshold, direct_bytes)) {
    ++stats_->allreduce_buckets;
    stats_->CountPayload(CollectiveType::kAllreduce, b.bytes);
    const Slot& first = slots[b.items[0]];
    std::vector<Request*> served;  // each request once, in order
    for (size_t i : b.items)
      if (served.empty() || served.back() != slots[i].req) served.push_back(slots[i].req);
    const std::vector<const Request*> members(served.begin(), served.end());
    if (timeline_->active()) Phase(timeline_, members, "QUEUE", decided_, "");
    Device& dev = DeviceOf(first.req);
    for (Request* r : served) DeviceOf(r);  // every member's producer has finished
    std::string args = "{\"bucket\": " + std::to_string(bucket_id_++) + ", \"tensors\": " +
                       std::to_string(b.items.size()) + ", \"bytes\": " + std::to_string(b.bytes);
    if (!dev.is_host()) args += std::string(", \"transport\": \"") + GpuTransportName(gpu_.transport()) + "\"";
    args += "}";
    auto t0 = TClock::now();
    const DataType dtype = first.req->meta.tensors[first.t].dtype;
    const ReduceOp op = first.req->meta.op;
    if (UseShm(dev, b.bytes)) {
      // One tensor or many alike: no fusion buffer (shm_allreduce.h, pieces).
      std::vector<ShmPiece> pieces;
      pieces.reserve(b.items.size());
      for (size_t i : b.items) {
        const Slot& s = slots[i];
        pieces.push_back({s.req->inputs[s.t], s.req->outputs[s.t], s.count, s.req->meta.prescale,
                          PostScale(s.req->meta, s.contributors)});
      }
      const std::string more = RunShm(served, pieces, dtype, op);
      Phase(timeline_, members, "SHM_ALLREDUCE", t0, args.substr(0, args.size() - 1) + more + "}");
      continue;
    }
    if (b.direct) {
      const RequestMeta& m = first.req->meta;
      const void* in = first.req->inputs[first.t];
      void* out = first.req->outputs[first.t];
      if (dev.is_host() && m.prescale == 1.0) {
        HostAllreduce(in, out, first.count, dtype, op, members, args);  // MPI copies `in` itself
      } else {
        if (m.prescale != 1.0 || in != out) dev.ScaleCopy({{out, in, first.count, m.prescale}}, dtype);
        ReduceInPlace(dev, out, first.count, dtype, op, members, args);
      }
      const double post = PostScale(m, first.contributors);
      if (post != 1.0) dev.ScaleCopy({{out, out, first.count, post}}, dtype);
      Settle(dev, served);
      Phase(timeline_, members, "MPI_ALLREDUCE", t0, args);
      continue;
    }
    char* buf = static_cast<char*>(dev.Scratch(b.bytes));
    std::vector<ScaleCopyItem> copies;
    copies.reserve(b.items.size());
    int64_t offset = 0;
    for (size_t i : b.items) {
      const Slot& s = slots[i];
      copies.push_back({buf + offset, s.req->inputs[s.t], s.count, s.req->meta.prescale});
      offset += items[i].bytes;
    }
    if (buf) dev.ScaleCopy(copies, dtype);
    Phase(timeline_, members, "MEMCPY_IN_FUSION_BUFFER", t0, args);
    t0 = TClock::now();
    ReduceInPlace(dev, buf, b.bytes / DataTypeSize(dtype), dtype, op, members, args);
    Phase(timeline_, members, "MPI_ALLREDUCE", t0, args);
    t0 = TClock::now();
    for (size_t c = 0; c < b.items.size(); ++c) {
      const Slot& s = slots[b.items[c]];
      copies[c] = {s.req->outputs[s.t], copies[c].dst, s.count, PostScale(s.req->meta, s.contributors)};
    }
    if (buf) dev.ScaleCopy(copies, dtype);
    Settle(dev, served);
    Phase(timeline_, members, "MEMCPY_OUT_FUSION_BUFFER", t0, args);
  }
}

namespace {
int64_t RowBytes(const TensorMeta& t) {
  int64_t row = DataTypeSize(t.dtype);
  for (size_t d = 1; d < t.shape.size(); ++d) row *= t.shape[d];
  return row;
}

// `shape` with its first dimension replaced by the total of `rows`: the
// output of a collective that stacks every rank's rows (allgather, alltoall).
Shape RowsStacked(Shape shape, const std::vector<int64_t>& rows) {
  shape[0] = 0;
  for (int64_t r : rows) shape[0] += r;
  return shape;
}
}  // namespace

Status Executor::CheckLimits(const Work& w) const {
  const RequestMeta& m = w.request->meta;
  Status s;
  // Only what every rank knows alike (the response, the agreed trailing
  // dimensions), so every rank takes the same branch.
  if (m.type == CollectiveType::kAllgather) {
    for (size_t t = 0; t < m.tensors.size() && s.ok(); ++t)
      s = Collectives::CheckAllgather(w.response->dim0[t], RowBytes(m.tensors[t]));
  } else if (m.type == CollectiveType::kAlltoall) {
    s = Collectives::CheckAlltoall(w.response->splits, RowBytes(m.tensors[0]));
  }
  if (!s.ok()) s.message = "tf_mpi: " + std::string(CollectiveName(m.type)) + " '" + m.name + "': " + s.message;
  return s;
}

void Executor::RunAllgather(const Work& w) {
  const RequestMeta& m = w.request->meta;
  Device& dev = DeviceOf(w.request);
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const Shape& mine = m.tensors[t].shape;
    const std::vector<int64_t>& rows = w.response->dim0[t];
    const Shape out_shape = RowsStacked(mine, rows);
    void* out = Allocate(dev, w.request, t, out_shape);
    const int64_t row_bytes = RowBytes(m.tensors[t]);
    void* in = Stage(dev, CudaDevice::kSendSlot, const_cast<void*>(w.request->inputs[t]), mine[0] * row_bytes, true);
    void* view = Stage(dev, CudaDevice::kRecvSlot, out, out_shape[0] * row_bytes, false);
    collectives_.Allgather(in, view, rows, row_bytes);
    stats_->CountPayload(CollectiveType::kAllgather, mine[0] * row_bytes);
    Unstage(dev, out, view, out_shape[0] * row_bytes);
  }
  Settle(dev, {w.request});
}

void Executor::RunAlltoall(const Work& w) {
  const RequestMeta& m = w.request->meta;
  Device& dev = DeviceOf(w.request);
  const int me = mpi_->rank();
  std::vector<int64_t> recv(mpi_->size());
  for (int j = 0; j < mpi_->size(); ++j) recv[j] = w.response->splits[j][me];
  const Shape out_shape = RowsStacked(m.tensors[0].shape, recv);
  void* out = Allocate(dev, w.request, 0, out_shape);
  auto* received = static_cast<int64_t*>(w.request->allocate(1, Shape{static_cast<int64_t>(recv.size())}));
  std::copy(recv.begin(), recv.end(), received);  // host memory on every device
  const int64_t row = RowBytes(m.tensors[0]);
  void* in = Stage(dev, CudaDevice::kSendSlot, const_cast<void*>(w.request->inputs[0]), TensorBytes(m.tensors[0]), true);
  void* view = Stage(dev, CudaDevice::kRecvSlot, out, out_shape[0] * row, false);
  collectives_.Alltoall(in, view, m.splits, recv, row);
  int64_t rows_to_others = 0;
  for (size_t j = 0; j < m.splits.size(); ++j)
    if (static_cast<int>(j) != me) rows_to_others += m.splits[j];
  stats_->CountPayload(CollectiveType::kAlltoall, rows_to_others * row);
  Unstage(dev, out, view, out_shape[0] * row);
  Settle(dev, {w.request});
}

void Executor::RunReducescatter(const Work& w) {
  const RequestMeta& m = w.request->meta;
  Device& dev = DeviceOf(w.request);
  const int n = mpi_->size();
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const TensorMeta& tm = m.tensors[t];
    const int64_t rows = tm.shape[0], row_elems = RowBytes(tm) / DataTypeSize(tm.dtype);
    std::vector<int64_t> counts(n);
    for (int r = 0; r < n; ++r) counts[r] = (rows / n + (r < rows % n ? 1 : 0)) * row_elems;
    void* in = const_cast<void*>(w.request->inputs[t]);
    if (m.prescale != 1.0) {
      void* scaled = dev.Scratch(TensorBytes(tm));
      if (scaled) dev.ScaleCopy({{scaled, in, NumElements(tm.shape), m.prescale}}, tm.dtype);
      in = scaled;
    }
    void* out = w.request->outputs[t];
    const int64_t out_bytes = counts[mpi_->rank()] * static_cast<int64_t>(DataTypeSize(tm.dtype));
    void* in_view = Stage(dev, CudaDevice::kSendSlot, in, TensorBytes(tm), true);
    void* out_view = Stage(dev, CudaDevice::kRecvSlot, out, out_bytes, false);
    collectives_.ReduceScatter(in_view, out_view, counts, tm.dtype, m.op);
    stats_->CountPayload(CollectiveType::kReducescatter, TensorBytes(tm));
    Unstage(dev, out, out_view, out_bytes);
    const double post = PostScale(m, mpi_->size());
    if (post != 1.0) dev.ScaleCopy({{out, out, counts[mpi_->rank()], post}}, tm.dtype);
  }
  Settle(dev, {w.request});
}

void Executor::RunBroadcast(const Work& w) {
  const RequestMeta& m = w.request->meta;
  Device& dev = DeviceOf(w.request);
  const bool root = mpi_->rank() == m.root;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const int64_t bytes = TensorBytes(m.tensors[t]);
    void* out = w.request->outputs[t];
    if (root && out != w.request->inputs[t]) dev.ScaleCopy({{out, w.request->inputs[t], bytes, 1.0}}, DataType::kUInt8);
    void* view = Stage(dev, CudaDevice::kRecvSlot, out, bytes, root);
    collectives_.Broadcast(view, bytes, m.root);
    if (root) stats_->CountPayload(CollectiveType::kBroadcast, bytes);
    if (!root) Unstage(dev, out, view, bytes);
  }
  Settle(dev, {w.request});
}

}  // namespace tfmpi
