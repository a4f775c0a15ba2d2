#include "negotiation/wire.h"

namespace tfmpi {

namespace {

class Writer {
 public:
  std::vector<char> buf;
  template <typename T> void Pod(T v) {
    const char* p = reinterpret_cast<const char*>(&v);
    buf.insert(buf.end(), p, p + sizeof(T));
  }
  void Str(const std::string& s) { Pod<uint32_t>(s.size()); buf.insert(buf.end(), s.begin(), s.end()); }
  void Meta(const RequestMeta& m) {
    Str(m.name);
    Pod(m.type); Pod(m.op); Pod(m.prescale); Pod(m.postscale); Pod(m.root); Pod(m.gpu);
    Pod<uint32_t>(m.tensors.size());
    for (const auto& t : m.tensors) {
      Pod(t.dtype);
      Pod<uint32_t>(t.shape.size());
      for (int64_t d : t.shape) Pod(d);
    }
    Ints(m.splits);
  }
  void Ints(const std::vector<int64_t>& v) {
    Pod<uint32_t>(v.size());
    for (int64_t x : v) Pod(x);
  }
};

class Reader {
 public:
  explicit Reader(const std::vector<char>& b) : buf_(b) {}
  template <typename T> T Pod() {
    if (pos_ + sizeof(T) > buf_.size()) throw std::runtime_error("tf_mpi: truncated negotiation message");
    T v;
    std::memcpy(&v, buf_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string Str() {
    uint32_t n = Pod<uint32_t>();
    if (pos_ + n > buf_.size()) throw std::runtime_error("tf_mpi: truncated negotiation message");
    std::string s(buf_.data() + pos_, n);
    pos_ += n;
    return s;
  }
  RequestMeta Meta() {
    RequestMeta m;
    m.name = Str();
    m.type = Pod<CollectiveType>(); m.op = Pod<ReduceOp>();
    m.prescale = Pod<double>(); m.postscale = Pod<double>(); m.root = Pod<int32_t>(); m.gpu = Pod<bool>();
    m.tensors.resize(Pod<uint32_t>());
    for (auto& t : m.tensors) {
      t.dtype = Pod<DataType>();
      t.shape.resize(Pod<uint32_t>());
      for (auto& d : t.shape) d = Pod<int64_t>();
    }
    m.splits = Ints();
    return m;
  }
  std::vector<int64_t> Ints() {
    std::vector<int64_t> v(Pod<uint32_t>());
    for (auto& x : v) x = Pod<int64_t>();
    return v;
  }
 private:
  const std::vector<char>& buf_;
  size_t pos_ = 0;
};

// One item of each message.
void Put(Writer& w, const Announcement& a) {
  w.Pod(a.kind);
  switch (a.kind) {
    case Announcement::Kind::kFull: w.Meta(a.meta); w.Pod(a.origin); break;
    case Announcement::Kind::kCached: w.Pod(a.cache_id); break;
    case Announcement::Kind::kShutdown: w.Pod(a.origin); break;
    case Announcement::Kind::kCachedRanges:
      w.Pod(a.cache_id);
      w.Pod<uint32_t>(a.ranks.ranges().size());
      for (const auto& [lo, hi] : a.ranks.ranges()) { w.Pod(lo); w.Pod(hi); }
      break;
  }
}

void Get(Reader& r, Announcement* a) {
  a->kind = r.Pod<Announcement::Kind>();
  switch (a->kind) {
    case Announcement::Kind::kFull: a->meta = r.Meta(); a->origin = r.Pod<int32_t>(); break;
    case Announcement::Kind::kCached: a->cache_id = r.Pod<uint32_t>(); break;
    case Announcement::Kind::kShutdown: a->origin = r.Pod<int32_t>(); break;
    case Announcement::Kind::kCachedRanges: {
      a->cache_id = r.Pod<uint32_t>();
      for (uint32_t n = r.Pod<uint32_t>(); n > 0; --n) {
        const int32_t lo = r.Pod<int32_t>();
        a->ranks.Add(lo, r.Pod<int32_t>());
      }
      break;
    }
    default: throw std::runtime_error("tf_mpi: unknown announcement kind in a negotiation message");
  }
}

void Put(Writer& w, const Decision& d) {
  w.Pod(d.kind);
  switch (d.kind) {
    case Decision::Kind::kExecuteCached: w.Pod(d.cache_id); break;
    case Decision::Kind::kExecute:
      w.Meta(d.response.meta);
      w.Pod<uint32_t>(d.response.dim0.size());
      for (const auto& per_rank : d.response.dim0) w.Ints(per_rank);
      w.Pod<uint32_t>(d.response.splits.size());
      for (const auto& row : d.response.splits) w.Ints(row);
      w.Ints(std::vector<int64_t>(d.response.joined.begin(), d.response.joined.end()));
      break;
    case Decision::Kind::kError:
      w.Str(d.response.meta.name);
      w.Str(d.response.error);
      w.Pod(d.error_code);
      break;
    case Decision::Kind::kShutdownAck: w.Pod(d.rank); break;
    case Decision::Kind::kCoordinatorGone: break;
    case Decision::Kind::kSettings:
      w.Pod(d.tunables.fusion_threshold);
      w.Pod(d.tunables.direct_bytes);
      w.Pod(d.tunables.chunk_bytes);
      break;
  }
}

void Get(Reader& r, Decision* out) {
  Decision& d = *out;
  d.kind = r.Pod<Decision::Kind>();
  switch (d.kind) {
    case Decision::Kind::kExecuteCached: d.cache_id = r.Pod<uint32_t>(); break;
    case Decision::Kind::kExecute:
      d.response.kind = Response::Kind::kExecute;
      d.response.meta = r.Meta();
      d.response.dim0.resize(r.Pod<uint32_t>());
      for (auto& per_rank : d.response.dim0) per_rank = r.Ints();
      d.response.splits.resize(r.Pod<uint32_t>());
      for (auto& row : d.response.splits) row = r.Ints();
      for (int64_t j : r.Ints()) d.response.joined.push_back(static_cast<int32_t>(j));
      break;
    case Decision::Kind::kError:
      d.response.kind = Response::Kind::kError;
      d.response.meta.name = r.Str();
      d.response.error = r.Str();
      d.error_code = r.Pod<StatusCode>();
      break;
    case Decision::Kind::kShutdownAck: d.rank = r.Pod<int32_t>(); break;
    case Decision::Kind::kCoordinatorGone: break;
    case Decision::Kind::kSettings:
      d.tunables.fusion_threshold = r.Pod<int64_t>();
      d.tunables.direct_bytes = r.Pod<int64_t>();
      d.tunables.chunk_bytes = r.Pod<int64_t>();
      break;
  }
}

// A message: the item count, then the items.
template <typename Item>
std::vector<char> EncodeList(const std::vector<Item>& items) {
  Writer w;
  w.Pod<uint32_t>(items.size());
  for (const Item& item : items) Put(w, item);
  return std::move(w.buf);
}

template <typename Item>
void DecodeList(const std::vector<char>& bytes, std::vector<Item>* out) {
  Reader r(bytes);
  out->assign(r.Pod<uint32_t>(), Item{});
  for (Item& item : *out) Get(r, &item);
}

}  // namespace

std::vector<char> Encode(const std::vector<Announcement>& items) { return EncodeList(items); }
std::vector<char> Encode(const std::vector<Decision>& items) { return EncodeList(items); }
void Decode(const std::vector<char>& bytes, std::vector<Announcement>* out) { DecodeList(bytes, out); }
void Decode(const std::vector<char>& bytes, std::vector<Decision>* out) { DecodeList(bytes, out); }

}  // namespace tfmpi
