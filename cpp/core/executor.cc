#include "executor.h"

#include <cstring>

#include "fusion.h"
#include "logging.h"
#include "scale.h"

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

bool Executor::Run(const std::vector<Decision>& decisions, InFlight* in_flight, ResponseCache* cache) {
  decided_ = TClock::now();
  // Responses are copied out of the cache: Put() below may move cache storage.
  std::vector<Response> responses;
  responses.reserve(decisions.size());
  for (const Decision& d : decisions) {
    if (d.kind == Decision::Kind::kError) {
      auto it = in_flight->find(d.response.meta.name);
      if (it != in_flight->end()) {
        it->second->done(Status::Aborted(d.response.error));
        in_flight->erase(it);
        ++stats_->errors;
      }
    } else if (d.kind == Decision::Kind::kExecuteCached) {
      responses.push_back(cache->Get(d.cache_id));
    } else if (d.kind == Decision::Kind::kExecute) {
      cache->Put(d.response);
      responses.push_back(d.response);
    } else if (d.kind == Decision::Kind::kSettings) {
      tunables_ = d.tunables;
      collectives_.set_chunk_bytes(tunables_.chunk_bytes);
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
      Phase(timeline_, {w.request}, names[static_cast<int>(w.response->meta.type)], t0, "");
    }
  }
  for (const Response& r : responses) {
    auto it = in_flight->find(r.meta.name);
    if (it == in_flight->end()) continue;  // a joined rank's stand-in
    it->second->done(Status::OK());
    in_flight->erase(it);
    ++stats_->requests;
  }
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
      items.push_back({m.tensors[t].dtype, m.op, count * static_cast<int64_t>(DataTypeSize(m.tensors[t].dtype))});
    }
  }
  for (const FusionBucket& b : PlanFusion(items, tunables_.fusion_threshold, tunables_.direct_bytes)) {
    ++stats_->allreduce_buckets;
    const Slot& first = slots[b.items[0]];
    std::vector<const Request*> members;
    if (timeline_->active()) {
      for (size_t i : b.items)
        if (members.empty() || members.back() != slots[i].req) members.push_back(slots[i].req);
      Phase(timeline_, members, "QUEUE", decided_, "");
    }
    const std::string args = "{\"bucket\": " + std::to_string(bucket_id_++) + ", \"tensors\": " +
                             std::to_string(b.items.size()) + ", \"bytes\": " + std::to_string(b.bytes) + "}";
    auto t0 = TClock::now();
    const DataType dtype = first.req->meta.tensors[first.t].dtype;
    const ReduceOp op = first.req->meta.op;
    if (b.direct) {
      const RequestMeta& m = first.req->meta;
      const void* in = first.req->inputs[first.t];
      void* out = first.req->outputs[first.t];
      if (m.prescale != 1.0) {
        ScaleCopy(out, in, first.count, dtype, m.prescale);
        in = out;
      }
      collectives_.Allreduce(in, out, first.count, dtype, op);
      const double post = PostScale(m, first.contributors);
      if (post != 1.0) ScaleCopy(out, out, first.count, dtype, post);
      Phase(timeline_, members, "MPI_ALLREDUCE", t0, args);
      continue;
    }
    if (static_cast<int64_t>(fusion_buffer_.size()) < b.bytes) fusion_buffer_.resize(b.bytes);
    char* buf = fusion_buffer_.data();
    int64_t offset = 0;
    for (size_t i : b.items) {
      const Slot& s = slots[i];
      ScaleCopy(buf + offset, s.req->inputs[s.t], s.count, dtype, s.req->meta.prescale);
      offset += items[i].bytes;
    }
    Phase(timeline_, members, "MEMCPY_IN_FUSION_BUFFER", t0, args);
    t0 = TClock::now();
    collectives_.Allreduce(nullptr, buf, b.bytes / DataTypeSize(dtype), dtype, op);
    Phase(timeline_, members, "MPI_ALLREDUCE", t0, args);
    t0 = TClock::now();
    offset = 0;
    for (size_t i : b.items) {
      const Slot& s = slots[i];
      ScaleCopy(s.req->outputs[s.t], buf + offset, s.count, dtype, PostScale(s.req->meta, s.contributors));
      offset += items[i].bytes;
    }
    Phase(timeline_, members, "MEMCPY_OUT_FUSION_BUFFER", t0, args);
  }
}

void Executor::RunAllgather(const Work& w) {
  const RequestMeta& m = w.request->meta;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const Shape& mine = m.tensors[t].shape;
    const std::vector<int64_t>& rows = w.response->dim0[t];
    Shape out_shape = mine;
    out_shape[0] = 0;
    for (int64_t r : rows) out_shape[0] += r;
    void* out = w.request->allocate(t, out_shape);
    const int64_t row_elems = mine[0] == 0 ? NumElements(Shape(mine.begin() + 1, mine.end())) : NumElements(mine) / mine[0];
    collectives_.Allgather(w.request->inputs[t], out, rows, row_elems * DataTypeSize(m.tensors[t].dtype));
  }
}

int64_t RowBytes(const TensorMeta& t) {
  int64_t row = DataTypeSize(t.dtype);
  for (size_t d = 1; d < t.shape.size(); ++d) row *= t.shape[d];
  return row;
}

void Executor::RunAlltoall(const Work& w) {
  const RequestMeta& m = w.request->meta;
  const int me = mpi_->rank();
  std::vector<int64_t> recv(mpi_->size());
  for (int j = 0; j < mpi_->size(); ++j) recv[j] = w.response->splits[j][me];
  Shape out_shape = m.tensors[0].shape;
  out_shape[0] = 0;
  for (int64_t r : recv) out_shape[0] += r;
  void* out = w.request->allocate(0, out_shape);
  auto* received = static_cast<int64_t*>(w.request->allocate(1, Shape{static_cast<int64_t>(recv.size())}));
  std::copy(recv.begin(), recv.end(), received);
  collectives_.Alltoall(w.request->inputs[0], out, m.splits, recv, RowBytes(m.tensors[0]));
}

void Executor::RunReducescatter(const Work& w) {
  const RequestMeta& m = w.request->meta;
  const int n = mpi_->size();
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const TensorMeta& tm = m.tensors[t];
    const int64_t rows = tm.shape[0], row_elems = RowBytes(tm) / DataTypeSize(tm.dtype);
    std::vector<int64_t> counts(n);
    for (int r = 0; r < n; ++r) counts[r] = (rows / n + (r < rows % n ? 1 : 0)) * row_elems;
    const void* in = w.request->inputs[t];
    std::vector<char> scaled;
    if (m.prescale != 1.0) {
      scaled.resize(TensorBytes(tm));
      ScaleCopy(scaled.data(), in, NumElements(tm.shape), tm.dtype, m.prescale);
      in = scaled.data();
    }
    void* out = w.request->outputs[t];
    collectives_.ReduceScatter(in, out, counts, tm.dtype, m.op);
    const double post = PostScale(m, mpi_->size());
    if (post != 1.0) ScaleCopy(out, out, counts[mpi_->rank()], tm.dtype, post);
  }
}

void Executor::RunBroadcast(const Work& w) {
  const RequestMeta& m = w.request->meta;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const int64_t bytes = TensorBytes(m.tensors[t]);
    void* out = w.request->outputs[t];
    if (mpi_->rank() == m.root && out != w.request->inputs[t]) std::memcpy(out, w.request->inputs[t], bytes);
    collectives_.Broadcast(out, bytes, m.root);
  }
}

}  // namespace tfmpi
