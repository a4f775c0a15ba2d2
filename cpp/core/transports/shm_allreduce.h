// Allreduce among the ranks of one node through shared memory (a segment
// from MPI_Win_allocate_shared, shm_segment.h): MPI provides the memory and
// the process set, this file the reduction schedule.
//
// Pieces. A collective's data is a list of pieces (ShmPiece: one tensor each,
// with its own input, output, prescale and postscale) that together form one
// virtual buffer, their concatenation in order. The schedule below addresses
// that virtual buffer; every copy into or out of the segment, and the reduce,
// goes straight to the piece the elements belong to (a step's sub-chunk may
// span several pieces, a piece several sub-chunks and blocks). So a fused
// bucket of many tensors costs no more copies than one tensor: no fusion
// buffer, inputs -> segment -> reduce -> outputs.
//
// Schedule. The virtual buffer of `count` elements is cut into one
// contiguous block per local rank (block p: elements [offset_p, offset_p +
// count_p)); local rank p reduces block p. Blocks are processed in pipeline
// steps of S elements (S = segment slot, TF_MPI_SHM_CHUNK_BYTES / local
// size): step j handles sub-chunk j of every block. In step j, rank r
//   1. waits until every peer has consumed what r wrote B steps ago into the
//      buffer it is about to reuse (B buffers in a ring; peers' kConsumed);
//   2. copy-in (reduce stages): writes sub-chunk j of every other block p of
//      its input, each piece's elements times its prescale, into its own slot
//      p, then raises kInputs;
//   3. reduce: once every peer's kInputs covers step j, reduces its own
//      sub-chunk: its own input (read where it lies, in r's private memory)
//      combined with slot r of each peer's buffer (read where it lies, in the
//      peer's area: a single copy), in the order own input, then peers by
//      rank; the result lands in r's own slot r (or, reduce-scatter, in the
//      caller's block, postscaled there); raises kResult;
//   4. copy-out (gather stages): copies its own result, then, once peer p's
//      kResult covers step j, p's slot p (p's result), into its outputs,
//      each piece's elements times its postscale; then raises kConsumed.
//      Every rank applies the postscale to the same unscaled bytes, so the
//      results stay identical on every rank.
// Steps are numbered across calls (a counter per rank, identical on every
// rank because every rank runs the same collectives in the same order with
// the same arguments), so nothing is reset between collectives.
//
// Why it is race-free. Rank r writes only its own area. Slot p (p != r) of
// buffer b is read only by rank p in step 3 of the steps that use b; slot r
// only by the peers in step 4 (and by r itself, which wrote it). Before r
// overwrites buffer b in step j (b = j mod B), it waits in step 1 until every
// peer's kConsumed reached step j-B+1, i.e. every peer has finished steps 3
// and 4 of step j-B, the last that used b. A reader reads a slot of step j
// only after acquiring the owner's counter for step j, which the owner
// released after writing it. No rank waits on a step that it has not itself
// reached, so there is no cycle: the pipeline only lets ranks run up to B
// steps apart. The pieces change only where each rank's private reads and
// writes go, not what is read or written in the segment.
//
// Results are identical on every rank: each block is computed once, by its
// owner, and copied (and postscaled alike) by the others. A rank writes an
// output element only in step 4 of the step that read the same element of
// its input (steps 2-3), so a piece may be reduced in place (in == out).
// Integer sums (and Min, Max, integer Product) equal the MPI path bit for
// bit: the same prescale code (scale.h ScaleCopy), wrap-around arithmetic
// and postscale; floating-point sums of more than two ranks may round
// differently from MPI's order.
//
// How a rank writes its slots (SlotWrites). Where the ranks' cores share a
// last-level cache, a slot written through the cache is read by the peers
// from that cache: the fastest way. Where they do not (ranks on different
// sockets or core complexes), every line a peer reads was just written into
// the writer's own cache and has to be fetched from there across the
// interconnect, which measured 2.4x slower than writing the slots with
// non-temporal stores, straight to memory, and having the peers read them
// from there (97.6 MiB, 2 ranks; the other way round, non-temporal slots
// were 1.5x slower with a shared cache). Which case holds is not visible
// from inside a virtual machine, and the scheduler may move a process, and
// the answer also depends on the size (whether the data still fits in a
// cache), so each rank measures, per size class (a power of two): large
// collectives (the ones whose outputs are streamed) time themselves per byte
// after the first pipeline step (earlier waits are mostly ranks arriving at
// different times); a class first alternates the two ways until each has
// two samples (a way's first sample is dropped: fresh buffers and cold
// caches), then uses the faster and tries the other now and then, changing
// only when the other one's score is clearly lower (kSwitchBelow), so that
// collectives keep a steady speed (the overlap probe compares timings).
// A way's score is the best of its last kRecent samples: what happens around
// a collective (cold outputs, other work on the core) only ever slows it,
// and an average kept such a slow sample for long (in a training job's first
// steps every collective is cold, and a class tried once in 16 collectives
// forgot a cold 4x sample only after dozens). A try of the other way costs
// what the two differ by (3x without a shared cache), so the interval
// between tries doubles, from kExploreFirst up to kExploreMost collectives,
// each time a try confirms the way in use, and starts over after a change
// or when the way in use runs clearly slower than its score (kDrift: the
// layout may have changed). A few calibration allreduces at creation fill
// one class. The choice changes only how this rank's writes reach memory, not what is
// written or when a flag is raised (a store fence orders streamed slot
// writes before the flag), so the ranks need not agree on it.
//
// Stages for a hierarchical allreduce: ReduceScatter (steps 1-3, the block's
// result lands in the caller's buffer) and Allgather (steps 1 and 4, each
// rank contributing its block) run the same steps over the same block
// layout, so a node-local reduce-scatter, a cross-node exchange of each
// block, and a node-local allgather compose to an allreduce.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/env.h"
#include "common/types.h"
#include "transports/mpi_context.h"
#include "transports/shm_segment.h"

namespace tfmpi {

// One tensor of a shared-memory allreduce: `count` elements read from `in`
// (times `prescale`) and written to `out` (times `postscale`); in == out
// works in place.
struct ShmPiece {
  const void* in;
  void* out;
  int64_t count;
  double prescale = 1.0, postscale = 1.0;
};

class ShmCollectives {
 public:
  // For the executor: collective over mpi->comm() (every rank calls it at
  // init). Takes rank 0's TF_MPI_SHM* settings on every rank, so that every
  // rank chooses alike; returns nullptr when the path is off (TF_MPI_SHM=0,
  // the ranks span several nodes, one rank, no usable segment, or, for
  // auto only, more ranks than the node has cores; logged when TF_MPI_SHM=1).
  static std::unique_ptr<ShmCollectives> Create(const MpiContext* mpi, const EngineConfig& config);
  // For a node-local stage over `local` (all of it calls this, with the same
  // arguments): nullptr and `*why` when no segment could be set up.
  static std::unique_ptr<ShmCollectives> ForNode(MPI_Comm local, int64_t chunk_bytes, int64_t min_bytes,
                                                 double stall_limit_s, std::string* why);
  // How this rank writes its slots (see above): -1 measured (runs the
  // calibration: collective, with the same value on every rank), 0 cached,
  // 1 streamed.
  Status SetSlotWrites(int how);
  // TF_MPI_SHM_SLOT_WRITES as SetSlotWrites() takes it.
  static int ParseSlotWrites(const std::string& how) { return how == "cached" ? 0 : how == "streamed" ? 1 : -1; }
  // For the node stage of the hierarchical allreduce (node_stage.h): collective
  // over mpi->comm(); rank 0's TF_MPI_SHM* settings on every rank, the same
  // rules as Create except that the job spans several (real or pretend)
  // nodes. nullptr: the node stage keeps MPI.
  static std::unique_ptr<ShmCollectives> ForNodeStage(const MpiContext* mpi, const EngineConfig& config);

  // Whether an allreduce of `bytes` on the host takes this path; the same
  // answer on every rank for the same bytes (see SetPaused).
  bool Chooses(int64_t bytes) const;

  // For every piece: out = op over local ranks of (prescale * in), times
  // postscale. The pieces (one or many tensors of one dtype) are reduced as
  // one buffer; every rank passes the same counts in the same order.
  Status Allreduce(const std::vector<ShmPiece>& pieces, DataType dtype, ReduceOp op);
  // `in` holds sum(counts) elements laid out by block; `out` receives this
  // rank's block (counts[local rank] elements), reduced and scaled.
  Status ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype, ReduceOp op,
                       double prescale, double postscale);
  // `in` holds this rank's block (counts[local rank] elements); `out` receives
  // every block, in rank order. `in` may be this rank's block inside `out`.
  Status Allgather(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype);

  // Nanoseconds the last call waited on peers (beyond a first check).
  int64_t last_wait_ns() const { return last_wait_ns_; }
  // Whether the last call wrote its slots with non-temporal stores (see above).
  bool last_streamed_slots() const { return last_streamed_slots_; }
  int local_size() const { return segment_->size(); }

  // Testing and benchmarking hook (process-wide): while paused, Chooses()
  // returns false. Must change on every rank at the same point, when no
  // collective is in flight (e.g. after a barrier), or ranks disagree.
  static void SetPaused(bool paused);

 private:
  struct Job;
  // `shm` with its slot writes set (SetSlotWrites); collective when `shm` is set.
  static std::unique_ptr<ShmCollectives> Calibrated(std::unique_ptr<ShmCollectives> shm, int slot_writes);
  ShmCollectives(std::unique_ptr<ShmSegment> segment, int64_t min_bytes)
      : segment_(std::move(segment)),
        min_bytes_(min_bytes),
        result_(segment_->slot_bytes()),
        scratch_(segment_->slot_bytes()) {}
  Status Run(const Job& job);

  // The slot-write choice (see "How a rank writes its slots").
  class SlotWrites {
   public:
    // -1 measured, 0 cached, 1 streamed (SetSlotWrites).
    void Fix(int how) { fixed_ = how; }
    // For a large collective of `bytes`: true to stream its slots.
    bool Choose(int64_t bytes);
    // Its time per byte, under the way Choose() returned.
    void Record(int64_t bytes, bool streamed, double ns_per_byte);

   private:
    static constexpr int64_t kExploreFirst = 16;   // collectives between tries of the other way, at first
    static constexpr int64_t kExploreMost = 256;   // ... and at most
    static constexpr double kSwitchBelow = 0.85;  // the other way's score, relative to the current one's
    static constexpr double kDrift = 1.5;         // a sample of the way in use this much above its score
    static constexpr int kRecent = 3;             // samples a way's score is the best of
    static constexpr int kClasses = 8;            // 4 MiB, 8 MiB, ..., 512 MiB and more
    struct SizeClass {
      bool current = false;  // the way in use
      int64_t explore_every = kExploreFirst;
      int64_t since_explore = 0;       // collectives since the other way was last tried
      int64_t samples[2] = {0, 0};     // taken so far: cached, streamed
      double recent[2][kRecent] = {};  // ns per byte, each way's last kept samples (a ring)
      // The best of way `w`'s last kRecent kept samples (its first is a warm-up).
      double Score(int w) const;
    };
    static int ClassOf(int64_t bytes);
    int fixed_ = -1;
    SizeClass classes_[kClasses];
  };

  std::unique_ptr<ShmSegment> segment_;
  int64_t min_bytes_;
  uint64_t step_ = 0;  // pipeline steps done so far (identical on every rank)
  int64_t last_wait_ns_ = 0;
  bool last_streamed_slots_ = false;
  SlotWrites slot_writes_;
  std::vector<char> result_;   // one slot: this rank's result when its slots are streamed
  std::vector<char> scratch_;  // one slot: postscaled results on their way to streamed outputs
};

}  // namespace tfmpi
