#include "transports/shm_allreduce.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>

#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/logging.h"
#include "common/scale.h"

namespace tfmpi {

namespace {

// Buffers in the ring: ranks may run this many steps apart.
constexpr int kBuffers = 4;
std::atomic<bool> g_paused{false};

enum class Mode : int64_t { kOff = 0, kOn = 1, kAuto = 2 };

// Collectives of at least this many bytes write their outputs with
// non-temporal stores (StreamCopy): outputs this large leave the caches
// before anyone reads them, and a normal store first reads every line it
// writes (a third more memory traffic on the output side).
constexpr int64_t kStreamBytes = 4ll << 20;

// memcpy with non-temporal stores where the CPU has them (x86-64 always).
// StreamFence() must follow before another thread may read `dst`.
void StreamCopy(char* dst, const char* src, int64_t bytes) {
#if defined(__SSE2__)
  const int64_t head = std::min<int64_t>(bytes, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
  for (; bytes >= 64; dst += 64, src += 64, bytes -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Orders the non-temporal stores before every later store (the completion
// that hands the outputs to the caller's thread).
void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

Mode ParseMode(const std::string& s) { return s == "0" ? Mode::kOff : s == "1" ? Mode::kOn : Mode::kAuto; }

// The TF_MPI_SHM* settings as rank 0 has them, on every rank (collective over
// mpi->comm()): every rank must choose alike.
struct Settings {
  Mode mode;
  int64_t min_bytes, chunk_bytes;
  int slot_writes;  // as ShmCollectives::SetSlotWrites takes it
};

Settings RankZeroSettings(const MpiContext* mpi, const EngineConfig& config, int slot_writes) {
  int64_t v[4] = {static_cast<int64_t>(ParseMode(config.shm)), config.shm_min_bytes, config.shm_chunk_bytes,
                  slot_writes};
  MPI_Bcast(v, 4, MPI_INT64_T, 0, mpi->comm());
  return {static_cast<Mode>(v[0]), v[1], v[2], static_cast<int>(v[3])};
}

// `count` elements cut into `n` blocks that differ by at most one element.
std::vector<int64_t> EvenBlocks(int64_t count, int n) {
  std::vector<int64_t> counts(n);
  for (int p = 0; p < n; ++p) counts[p] = count / n + (p < count % n ? 1 : 0);
  return counts;
}

int64_t Total(const std::vector<int64_t>& counts) { return std::accumulate(counts.begin(), counts.end(), int64_t{0}); }

}  // namespace

// One collective: which stages run, on which memory.
struct ShmCollectives::Job {
  // The virtual buffer (shm_allreduce.h): reduce stages read the pieces'
  // inputs, gather stages write their outputs.
  std::vector<ShmPiece> pieces;
  std::vector<int64_t> starts;  // element offset of each piece in the virtual buffer
  const char* own_in = nullptr;  // gather only: this rank's block, its contribution
  char* own_out = nullptr;       // reduce only: receives this rank's reduced block
  std::vector<int64_t> counts;   // elements per block
  DataType dtype;
  ReduceOp op;
  bool reduce, gather;

  Job(std::vector<ShmPiece> p, std::vector<int64_t> c, DataType t, ReduceOp o, bool r, bool g)
      : pieces(std::move(p)), counts(std::move(c)), dtype(t), op(o), reduce(r), gather(g) {
    int64_t start = 0;
    for (const ShmPiece& piece : pieces) {
      starts.push_back(start);
      start += piece.count;
    }
  }
  int64_t total() const { return starts.empty() ? 0 : starts.back() + pieces.back().count; }

  // Calls f(piece, element offset in the piece, element offset in the range,
  // elements) for each run of the range [begin, begin + len) of the virtual
  // buffer that lies in one piece, in order.
  template <typename F>
  void ForEachSpan(int64_t begin, int64_t len, F&& f) const {
    if (len <= 0) return;
    // The last piece that starts at or before `begin`.
    size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (int64_t done = 0; done < len && i < pieces.size(); ++i) {
      const int64_t offset = begin + done - starts[i];
      const int64_t n = std::min(pieces[i].count - offset, len - done);
      if (n <= 0) continue;  // an empty piece
      f(pieces[i], offset, done, n);
      done += n;
    }
  }
};

int ShmCollectives::SlotWrites::ClassOf(int64_t bytes) {
  int c = 0;
  for (int64_t b = kStreamBytes * 2; b <= bytes && c + 1 < kClasses; b *= 2) ++c;
  return c;
}

double ShmCollectives::SlotWrites::SizeClass::Score(int w) const {
  const int64_t kept = std::clamp<int64_t>(samples[w] - 1, 1, kRecent);
  return *std::min_element(recent[w], recent[w] + kept);
}

bool ShmCollectives::SlotWrites::Choose(int64_t bytes) {
  if (fixed_ >= 0) return fixed_ == 1;
  SizeClass& k = classes_[ClassOf(bytes)];
  if (k.samples[0] < 2 || k.samples[1] < 2) return k.samples[1] < k.samples[0];
  if (k.Score(!k.current) < kSwitchBelow * k.Score(k.current)) {
    k.current = !k.current;
    k.explore_every = kExploreFirst;
    k.since_explore = 0;
  }
  if (++k.since_explore < k.explore_every) return k.current;
  k.since_explore = 0;
  return !k.current;
}

void ShmCollectives::SlotWrites::Record(int64_t bytes, bool streamed, double ns_per_byte) {
  SizeClass& k = classes_[ClassOf(bytes)];
  const int64_t n = k.samples[streamed]++;
  if (n == 0) return;  // a way's first sample is a warm-up
  if (k.samples[0] >= 2 && k.samples[1] >= 2) {  // both ways scored: the class is past its first comparisons
    if (streamed != k.current) {
      // A try of the other way that does not beat the way in use: try less often.
      if (ns_per_byte >= kSwitchBelow * k.Score(k.current))
        k.explore_every = std::min(2 * k.explore_every, kExploreMost);
    } else if (ns_per_byte > kDrift * k.Score(k.current)) {
      k.explore_every = kExploreFirst;
    }
  }
  k.recent[streamed][(n - 1) % kRecent] = ns_per_byte;
}

Status ShmCollectives::SetSlotWrites(int how) {
  if (how >= 0) {
    slot_writes_.Fix(how);
    return Status::OK();
  }
  // Calibration: three rounds of one allreduce each way (each way's first is
  // its warm-up), of a size whose outputs are streamed; every rank runs the
  // same collectives.
  constexpr int kRounds = 3;
  const int64_t count = kStreamBytes / 4 * 2;
  std::vector<float> in(count, 1.0f), out(count);
  for (int round = 0; round < kRounds; ++round)
    for (int streamed = 0; streamed < 2; ++streamed) {
      slot_writes_.Fix(streamed);
      Status s = Allreduce({{in.data(), out.data(), count}}, DataType::kFloat32, ReduceOp::kSum);
      if (!s.ok()) return s;
    }
  slot_writes_.Fix(-1);
  return Status::OK();
}

void ShmCollectives::SetPaused(bool paused) { g_paused.store(paused, std::memory_order_relaxed); }

bool ShmCollectives::Chooses(int64_t bytes) const {
  // A broken segment is still chosen, so that the collective fails at once
  // with the reason instead of waiting for a dead peer inside MPI.
  return bytes >= min_bytes_ && !g_paused.load(std::memory_order_relaxed);
}

std::unique_ptr<ShmCollectives> ShmCollectives::ForNode(MPI_Comm local, int64_t chunk_bytes, int64_t min_bytes,
                                                        double stall_limit_s, std::string* why) {
  int n = 1;
  MPI_Comm_size(local, &n);
  // A slot is a cache-line multiple, so every rank's slots start on their own lines.
  const int64_t slot = std::max<int64_t>(64, chunk_bytes / n / 64 * 64);
  auto segment = ShmSegment::Create(local, slot, kBuffers, stall_limit_s, why);
  if (!segment) return nullptr;
  return std::unique_ptr<ShmCollectives>(new ShmCollectives(std::move(segment), min_bytes));
}

std::unique_ptr<ShmCollectives> ShmCollectives::Calibrated(std::unique_ptr<ShmCollectives> shm, int slot_writes) {
  if (!shm) return nullptr;
  // Every rank of the node has a segment here (ShmSegment::Create agrees) and
  // the same setting (rank 0's), so every rank runs the same calibration.
  const Status s = shm->SetSlotWrites(slot_writes);
  if (s.ok()) return shm;
  // A peer failed in the middle of it: the segment reports it on every later
  // collective as well, so keep it and let the first collective fail with the reason.
  LogWarning("the shared-memory allreduce's calibration failed: " + s.message);
  return shm;
}

std::unique_ptr<ShmCollectives> ShmCollectives::ForNodeStage(const MpiContext* mpi, const EngineConfig& config) {
  const Settings settings = RankZeroSettings(mpi, config, ParseSlotWrites(config.shm_slot_writes));
  const Mode mode = settings.mode;
  // Every node has local_size() ranks (the hierarchical path needs it) and
  // the machines of a job have the same core count, so every rank decides alike.
  if (mode == Mode::kOff || mpi->local_size() < 2) return nullptr;
  if (mode == Mode::kAuto && mpi->local_size() > sysconf(_SC_NPROCESSORS_ONLN)) return nullptr;
  std::string why;
  auto shm = ForNode(mpi->node_comm(), settings.chunk_bytes, 0, config.stall_shutdown_s, &why);
  if (!shm && mpi->rank() == 0) LogWarning("the hierarchical allreduce's node stage keeps MPI: " + why);
  return Calibrated(std::move(shm), settings.slot_writes);
}

std::unique_ptr<ShmCollectives> ShmCollectives::Create(const MpiContext* mpi, const EngineConfig& config) {
  // Rank 0's settings everywhere: the choice must be the same on every rank.
  const Settings settings = RankZeroSettings(mpi, config, ParseSlotWrites(config.shm_slot_writes));
  const Mode mode = settings.mode;
  if (mode == Mode::kOff) return nullptr;
  // Every rank sees the same sizes, so every rank returns here alike.
  std::string why;
  if (mpi->size() < 2) why = "there is one rank";
  else if (mpi->local_size() != mpi->size())
    why = "the ranks span several nodes (" + std::to_string(mpi->local_size()) + " of " +
          std::to_string(mpi->size()) + " share this one)";
  else if (mode == Mode::kAuto && mpi->local_size() > sysconf(_SC_NPROCESSORS_ONLN))
    // More ranks than cores: a rank waiting on shared memory for a
    // descheduled peer measured no faster than the MPI path (3 ranks on 2
    // cores), so auto leaves it to MPI. The node's core count is the same on
    // every rank, so every rank decides alike.
    why = std::to_string(mpi->local_size()) + " ranks share " + std::to_string(sysconf(_SC_NPROCESSORS_ONLN)) +
          " cores (TF_MPI_SHM=1 uses shared memory anyway)";
  std::unique_ptr<ShmCollectives> shm;
  if (why.empty()) shm = ForNode(mpi->node_comm(), settings.chunk_bytes, settings.min_bytes, config.stall_shutdown_s, &why);
  if (!shm && mode == Mode::kOn && mpi->rank() == 0)
    LogWarning("TF_MPI_SHM=1, but the shared-memory allreduce is not used: " + why);
  return Calibrated(std::move(shm), settings.slot_writes);
}

Status ShmCollectives::Allreduce(const std::vector<ShmPiece>& pieces, DataType dtype, ReduceOp op) {
  Job job(pieces, {}, dtype, op, true, true);
  job.counts = EvenBlocks(job.total(), segment_->size());
  return Run(job);
}

Status ShmCollectives::ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                                     ReduceOp op, double prescale, double postscale) {
  Job job({{in, nullptr, Total(counts), prescale, postscale}}, counts, dtype, op, true, false);
  job.own_out = static_cast<char*>(out);
  return Run(job);
}

Status ShmCollectives::Allgather(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype) {
  Job job({{nullptr, out, Total(counts), 1.0, 1.0}}, counts, dtype, ReduceOp::kSum, false, true);
  job.own_in = static_cast<const char*>(in);
  return Run(job);
}

Status ShmCollectives::Run(const Job& job) {
  ShmSegment& seg = *segment_;
  last_wait_ns_ = 0;
  if (!seg.broken().ok()) return seg.broken();
  const int n = seg.size(), me = seg.rank();
  if (static_cast<int>(job.counts.size()) != n)
    return Status::Internal("tf_mpi: shared-memory collective given " + std::to_string(job.counts.size()) +
                            " blocks for " + std::to_string(n) + " local ranks");
  const int64_t elem = DataTypeSize(job.dtype);
  const int64_t per_step = seg.slot_bytes() / elem;
  std::vector<int64_t> offset(n, 0);
  for (int p = 1; p < n; ++p) offset[p] = offset[p - 1] + job.counts[p - 1];
  const int64_t longest = *std::max_element(job.counts.begin(), job.counts.end());
  const int64_t steps = (longest + per_step - 1) / per_step;

  // Byte address of element `i` of a piece's input or output.
  auto in_at = [&](const ShmPiece& piece, int64_t i) { return static_cast<const char*>(piece.in) + i * elem; };
  auto out_at = [&](const ShmPiece& piece, int64_t i) { return static_cast<char*>(piece.out) + i * elem; };

  const bool stream = job.total() * elem >= kStreamBytes;
  // Slots written with non-temporal stores, or through the cache (see
  // SlotWrites); streamed slots need a store fence before each flag.
  const bool stream_slots = stream && slot_writes_.Choose(job.total() * elem);
  last_streamed_slots_ = stream_slots;
  const auto started = std::chrono::steady_clock::now();
  int64_t arrival_wait_ns = 0;  // waited in the first step: ranks arriving at different times

  Status s;
  for (int64_t j = 0; j < steps && s.ok(); ++j) {
    const uint64_t k = step_++;  // global step number
    const int b = static_cast<int>(k % seg.buffers());
    const int64_t first = j * per_step;  // within each block
    auto len = [&](int p) { return std::clamp<int64_t>(job.counts[p] - first, 0, per_step); };
    // The virtual buffer's elements of block p that this step handles.
    auto for_each_span = [&](int p, auto&& f) { job.ForEachSpan(offset[p] + first, len(p), f); };
    // Step 4 for block p: its result (in `from`, laid out as the sub-chunk)
    // into the pieces' outputs, postscaled.
    auto copy_out = [&](int p, const char* from) {
      for_each_span(p, [&](const ShmPiece& piece, int64_t o, int64_t r, int64_t cnt) {
        char* to = out_at(piece, o);
        const char* src = from + r * elem;
        if (to == src) return;
        if (!stream) return ScaleCopy(to, src, cnt, job.dtype, piece.postscale);
        if (piece.postscale != 1.0) {
          // Scaled in a cache-resident scratch (the slot itself is read by peers), then streamed.
          ScaleCopy(scratch_.data(), src, cnt, job.dtype, piece.postscale);
          src = scratch_.data();
        }
        StreamCopy(to, src, cnt * elem);
      });
    };

    // 1. The buffer about to be reused has been consumed by every peer.
    if (k >= static_cast<uint64_t>(seg.buffers()))
      for (int p = 0; p < n && s.ok(); ++p)
        if (p != me) s = seg.WaitFor(p, ShmSegment::kConsumed, k + 1 - seg.buffers());
    if (!s.ok()) break;

    char* result = seg.Slot(me, b, me);
    const int64_t mine = len(me);
    if (job.reduce) {
      // 2. Copy-in: what each peer reduces, prescaled.
      for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        char* slot = seg.Slot(me, b, p);
        for_each_span(p, [&](const ShmPiece& piece, int64_t o, int64_t r, int64_t cnt) {
          if (stream_slots && piece.prescale == 1.0)
            StreamCopy(slot + r * elem, in_at(piece, o), cnt * elem);
          else
            ScaleCopy(slot + r * elem, in_at(piece, o), cnt, job.dtype, piece.prescale);
        });
      }
      if (stream_slots) StreamFence();
      seg.Publish(ShmSegment::kInputs, k + 1);
      // 3. Reduce this rank's sub-chunk, reading the peers' copies where they lie.
      for (int p = 0; p < n && s.ok(); ++p)
        if (p != me) s = seg.WaitFor(p, ShmSegment::kInputs, k + 1);
      if (!s.ok()) break;
      // Streamed slots: the result is made in a cached buffer and streamed to the slot below.
      char* dst = job.gather ? (stream_slots ? result_.data() : result) : job.own_out + first * elem;
      for_each_span(me, [&](const ShmPiece& piece, int64_t o, int64_t r, int64_t cnt) {
        char* d = dst + r * elem;
        const char* acc = in_at(piece, o);
        if (piece.prescale != 1.0) {
          ScaleCopy(d, acc, cnt, job.dtype, piece.prescale);
          acc = d;
        }
        for (int p = 0; p < n; ++p) {
          if (p == me) continue;
          ReduceInto(d, acc, seg.Slot(p, b, me) + r * elem, cnt, job.dtype, job.op);
          acc = d;
        }
        // Gather stages postscale on the way out (step 4), on every rank alike.
        if (!job.gather && piece.postscale != 1.0) ScaleCopy(d, d, cnt, job.dtype, piece.postscale);
      });
    } else if (mine > 0) {
      // Gather only: this rank's block is its contribution.
      if (stream_slots) {
        StreamCopy(result, job.own_in + first * elem, mine * elem);
        StreamFence();
      } else {
        std::memcpy(result, job.own_in + first * elem, mine * elem);
      }
    }
    if (job.gather) {
      // 4. Copy-out: this rank's result, then every peer's, from where it lies.
      const char* own = job.reduce ? result : job.own_in + first * elem;
      if (stream_slots && job.reduce) {
        StreamCopy(result, result_.data(), mine * elem);
        StreamFence();
        own = result_.data();
      }
      seg.Publish(ShmSegment::kResult, k + 1);
      copy_out(me, own);
      for (int p = 0; p < n && s.ok(); ++p) {
        if (p == me) continue;
        s = seg.WaitFor(p, ShmSegment::kResult, k + 1);
        if (s.ok()) copy_out(p, seg.Slot(p, b, p));
      }
      if (!s.ok()) break;
    }
    // Every counter reaches k + 1 in every step, whichever stages ran.
    seg.Publish(ShmSegment::kInputs, k + 1);
    seg.Publish(ShmSegment::kResult, k + 1);
    seg.Publish(ShmSegment::kConsumed, k + 1);
    if (j == 0) arrival_wait_ns = seg.TakeWaitNanos();
  }
  if (stream) StreamFence();
  last_wait_ns_ = arrival_wait_ns + seg.TakeWaitNanos();
  if (stream && s.ok()) {
    // Time per byte after the first step: waits in the first step are mostly
    // ranks arriving at different times, later ones part of the pipeline's cost.
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - started).count();
    slot_writes_.Record(job.total() * elem, stream_slots,
                        std::max(0.0, ns - arrival_wait_ns) / static_cast<double>(job.total() * elem));
  }
  return s;
}

}  // namespace tfmpi
