// tf_mpi._core: a thin pybind11 binding of the engine: runtime queries and
// array-level collectives. Collectives take numpy arrays (host memory) or any
// object with __cuda_array_interface__ (v3: CuPy, PyTorch, Numba, ...; GPU
// memory, results returned as DeviceArray), and release the GIL while they wait.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <condition_variable>
#include <limits>
#include <memory>
#include <mutex>

#include "common/logging.h"
#include "engine/engine.h"
#include "transports/cuda_device.h"
#include "transports/link_probe.h"

namespace py = pybind11;
using namespace tfmpi;

namespace {

Engine& E() { return Engine::Get(); }

// The engine of process set `id` (0: the global set), with Horovod's errors where there is none.
std::shared_ptr<Engine> SetEngine(int id) {
  if (!E().initialized()) throw py::value_error("tf_mpi has not been initialized; call tf_mpi.init() first");
  bool registered = false;
  std::shared_ptr<Engine> e = Engine::ForSet(id, &registered);
  if (!registered) throw py::value_error("Process set does not exist or has not been registered.");
  if (!e) throw py::value_error("Process is not part of provided process set.");
  return e;
}

// A rank of the job was lost (elastic mode): tf_mpi._core.PeerLostError, a RuntimeError.
class PeerLostError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void Raise(const Status& s) {
  if (s.ok()) return;
  if (s.code == StatusCode::kInvalidArgument) throw py::value_error(s.message);
  if (s.code == StatusCode::kUnavailable) throw PeerLostError(s.message);
  throw std::runtime_error(s.message);
}

const MpiContext& Ctx() {
  if (!E().initialized()) throw py::value_error("tf_mpi has not been initialized; call tf_mpi.init() first");
  return E().mpi();
}

DataType ToDataType(const py::dtype& dt) {
  // By kind and size, read from the descriptor in C (numpy's dtype.name is
  // Python code, ~1.5 us: a third of a small collective's cost).
  static const struct { char kind; py::ssize_t size; DataType type; } by_kind[] = {
      {'u', 1, DataType::kUInt8},   {'i', 1, DataType::kInt8},    {'i', 2, DataType::kInt16},
      {'u', 2, DataType::kUInt16},  {'i', 4, DataType::kInt32},   {'i', 8, DataType::kInt64},
      {'f', 2, DataType::kFloat16}, {'f', 4, DataType::kFloat32}, {'f', 8, DataType::kFloat64},
      {'b', 1, DataType::kBool}};
  const char kind = dt.kind();
  const py::ssize_t size = dt.itemsize();
  for (const auto& k : by_kind)
    if (k.kind == kind && k.size == size) return k.type;
  // ml_dtypes' bfloat16 is a user type (kind 'V'): known by its name only.
  const std::string name = py::str(dt.attr("name"));
  if (name == "bfloat16") return DataType::kBFloat16;
  throw py::type_error("tf_mpi: unsupported dtype " + name);
}

// Whether an array's bytes are in the other byte order than this machine's
// ('=' native and '|' no order are not).
bool SwappedByteOrder(const py::dtype& dt) {
  static const bool little = [] {
    const uint16_t one = 1;
    return *reinterpret_cast<const uint8_t*>(&one) == 1;
  }();
  return dt.byteorder() == (little ? '>' : '<');
}

Shape ShapeOf(const py::array& a) { return Shape(a.shape(), a.shape() + a.ndim()); }

// ---- GPU arrays ---------------------------------------------------------

// A CUDA array as the engine needs it, read from __cuda_array_interface__.
// Plain C++ only: copies of it travel to the engine thread, where Python
// objects must not be touched.
struct CudaArrayView {
  void* ptr = nullptr;
  DataType dtype = DataType::kFloat32;
  std::string typestr;  // numpy's spelling, e.g. "<f4"
  size_t itemsize = 0;
  Shape shape;
  int device = -1;
  void* stream = nullptr;  // the producer's stream; nullptr: no ordering needed
};

bool IsCudaArray(const py::handle& obj) { return py::hasattr(obj, "__cuda_array_interface__"); }

CudaArrayView ParseCudaArray(const py::handle& obj) {
  py::dict cai = obj.attr("__cuda_array_interface__");
  CudaArrayView v;
  for (py::handle d : cai["shape"].cast<py::tuple>()) v.shape.push_back(d.cast<int64_t>());
  const py::dtype dtype(cai["typestr"].cast<std::string>());
  v.dtype = ToDataType(dtype);
  v.typestr = py::str(dtype.attr("str"));
  v.itemsize = dtype.itemsize();
  v.ptr = reinterpret_cast<void*>(cai["data"].cast<py::tuple>()[0].cast<uintptr_t>());
  if (cai.contains("strides") && !cai["strides"].is_none()) {
    // Accept explicit strides only when they describe a C-contiguous array.
    int64_t expect = static_cast<int64_t>(v.itemsize);
    auto strides = cai["strides"].cast<std::vector<int64_t>>();
    for (int i = static_cast<int>(v.shape.size()) - 1; i >= 0; --i) {
      if (v.shape[i] > 1 && strides.at(i) != expect)
        throw py::value_error("tf_mpi: CUDA arrays must be C-contiguous (make a contiguous copy first)");
      expect *= v.shape[i];
    }
  }
  if (cai.contains("stream") && !cai["stream"].is_none()) {
    const auto stream = cai["stream"].cast<uintptr_t>();
    // 0 is disallowed by the interface (ambiguous); 1 and 2 are the legacy and
    // per-thread default streams, which CUDA accepts as handles as they are.
    if (stream == 0) throw py::value_error("tf_mpi: __cuda_array_interface__ stream 0 is not allowed (v3)");
    v.stream = reinterpret_cast<void*>(stream);
  }
  if (NumElements(v.shape) > 0) {
    Raise(PointerDevice(v.ptr, &v.device));
    if (v.device < 0) throw py::value_error("tf_mpi: __cuda_array_interface__ points at host memory");
  } else {
    int dev = 0;
    const TfMpiCudaApi* api = CudaApi(nullptr);
    if (api && api->get_device(&dev) == 0) v.device = dev;
  }
  return v;
}

// GPU memory allocated by the engine for a result; hands itself to CuPy,
// PyTorch, Numba, ... through __cuda_array_interface__ (cupy.asarray(a)).
// Managed memory in gives managed memory out.
class DeviceArray {
 public:
  // Runs on the engine thread for allgather results: no Python objects here.
  DeviceArray(int device, Shape shape, std::string typestr, size_t itemsize, bool managed)
      : device_(device), shape_(std::move(shape)), typestr_(std::move(typestr)) {
    std::string why;
    api_ = CudaApi(&why);
    if (!api_) throw std::runtime_error(why);
    const size_t bytes = std::max<int64_t>(1, NumElements(shape_)) * itemsize;
    ScopedCudaDevice on(device_);
    if (int err = api_->malloc(&ptr_, bytes, managed ? 1 : 0))
      throw std::runtime_error(std::string("tf_mpi: cannot allocate a GPU result: ") + api_->error_string(err));
  }
  ~DeviceArray() {
    if (ptr_) api_->free(ptr_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  void* data() const { return ptr_; }
  int device() const { return device_; }
  const Shape& shape() const { return shape_; }
  py::dict Interface() const {
    py::tuple shape(shape_.size());
    for (size_t i = 0; i < shape_.size(); ++i) shape[i] = shape_[i];
    // The engine finished writing before the call returned: no stream to order after.
    return py::dict(py::arg("shape") = shape, py::arg("typestr") = typestr_,
                    py::arg("data") = py::make_tuple(reinterpret_cast<uintptr_t>(ptr_), false),
                    py::arg("strides") = py::none(), py::arg("stream") = py::none(), py::arg("version") = 3);
  }

 private:
  const TfMpiCudaApi* api_ = nullptr;
  void* ptr_ = nullptr;
  int device_;
  Shape shape_;
  std::string typestr_;
};

bool IsManaged(const void* ptr) {
  const TfMpiCudaApi* api = CudaApi(nullptr);
  int managed = 0;
  return api && ptr && api->pointer_is_managed(ptr, &managed) == 0 && managed;
}

std::unique_ptr<Request> MakeGpuRequest(CollectiveType type, const std::string& name, const CudaArrayView& v) {
  auto req = std::make_unique<Request>();
  req->meta.name = name;
  req->meta.type = type;
  req->meta.gpu = true;
  req->meta.tensors.push_back({v.dtype, v.shape});
  req->inputs.push_back(v.ptr);
  req->device = v.device;
  req->stream = v.stream;
  return req;
}

// One request's completion, waited for by the thread that submitted it. Not std::promise: its
// set_value runs std::call_once, whose glibc implementation makes a futex system call on every
// use even with no one waiting, and a small request is usually completed by the submitting thread
// itself (the engine runs it inline) before anyone waits.
class Completion {
 public:
  void Set(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = s;
    done_ = true;
    cv_.notify_one();  // under the lock: the waiter may destroy *this as soon as it sees done_
  }
  Status Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

// Submits one request to process set `set` and blocks (without the GIL) until it completes.
void Run(std::unique_ptr<Request> req, int set = 0) {
  std::shared_ptr<Engine> engine = SetEngine(set);
  auto completion = std::make_shared<Completion>();
  req->done = [completion](const Status& s) { completion->Set(s); };
  Status s;
  {
    py::gil_scoped_release release;
    s = engine->Enqueue(std::move(req));
    if (s.ok()) s = completion->Wait();
  }
  Raise(s);
}

std::unique_ptr<Request> MakeRequest(CollectiveType type, const std::string& name, const py::array& in) {
  auto req = std::make_unique<Request>();
  req->meta.name = name;
  req->meta.type = type;
  req->meta.tensors.push_back({ToDataType(in.dtype()), ShapeOf(in)});
  req->inputs.push_back(in.data());
  return req;
}

// The output of a collective whose output shape is known before it runs:
// a numpy array for host input, a DeviceArray on the input's GPU for CUDA input.
struct Output {
  py::object array;
  void* data;
};

Output MakeOutput(const py::object& in, const CudaArrayView* gpu, const Shape& shape) {
  if (gpu) {
    auto out = std::make_shared<DeviceArray>(gpu->device, shape, gpu->typestr, gpu->itemsize, IsManaged(gpu->ptr));
    return {py::cast(out), out->data()};
  }
  py::array a(py::array(in).dtype(), std::vector<py::ssize_t>(shape.begin(), shape.end()));
  return {a, a.mutable_data()};
}

// Builds the request for `in` (numpy or CUDA array); `view` is filled for CUDA input.
std::unique_ptr<Request> Prepare(CollectiveType type, const std::string& name, py::object& in,
                                 std::optional<CudaArrayView>* view) {
  if (IsCudaArray(in)) {
    *view = ParseCudaArray(in);
    return MakeGpuRequest(type, name, **view);
  }
  in = py::array::ensure(in, py::array::c_style);
  if (!in) throw py::type_error("tf_mpi: expected a numpy array or an object with __cuda_array_interface__");
  // The engine reduces in this machine's byte order: a swapped array ('>f4' on
  // x86) is converted (and its result comes back in the native order).
  const py::dtype dt = py::array(in).dtype();
  if (SwappedByteOrder(dt)) in = in.attr("astype")(dt.attr("newbyteorder")("="));
  return MakeRequest(type, name, in.cast<py::array>());
}

// Allreduce or reducescatter of one array.
py::object Reduce(CollectiveType type, py::object in, int op, const std::string& name, double prescale,
                  double postscale, int set) {
  std::optional<CudaArrayView> gpu;
  auto req = Prepare(type, name, in, &gpu);
  req->meta.op = static_cast<ReduceOp>(op);
  req->meta.prescale = prescale;
  req->meta.postscale = postscale;
  Shape shape = req->meta.tensors[0].shape;
  if (type == CollectiveType::kReducescatter) {
    if (shape.empty()) throw py::value_error("tf_mpi: reducescatter needs an array with at least one dimension");
    // Rank r keeps rows [r * q + min(r, rem), ...): the first `rem` ranks get one more.
    const MpiContext& ctx = SetEngine(set)->mpi();
    const int n = ctx.size(), r = ctx.rank();
    shape[0] = shape[0] / n + (r < shape[0] % n ? 1 : 0);
  }
  Output out = MakeOutput(in, gpu ? &*gpu : nullptr, shape);
  req->outputs.push_back(out.data);
  Run(std::move(req), set);
  return out.array;
}

py::object Allreduce(py::object in, int op, const std::string& name, double prescale, double postscale, int set) {
  return Reduce(CollectiveType::kAllreduce, std::move(in), op, name, prescale, postscale, set);
}

py::object Reducescatter(py::object in, int op, const std::string& name, double prescale, double postscale,
                         int set) {
  return Reduce(CollectiveType::kReducescatter, std::move(in), op, name, prescale, postscale, set);
}

// One request for several arrays (all numpy, or all CUDA arrays on one GPU):
// negotiated and fused as a unit, like TensorFlow's grouped allreduce.
py::list GroupedAllreduce(py::list arrays, int op, const std::string& name, double prescale, double postscale,
                         int set) {
  if (arrays.size() == 0) throw py::value_error("tf_mpi: grouped_allreduce needs at least one array");
  std::unique_ptr<Request> req;
  py::list outs, inputs;  // `inputs` keeps contiguous copies alive until the collective ends
  for (size_t i = 0; i < arrays.size(); ++i) {
    py::object in = arrays[i];
    std::optional<CudaArrayView> gpu;
    auto one = Prepare(CollectiveType::kAllreduce, name, in, &gpu);
    inputs.append(in);
    if (!req) {
      req = std::move(one);
    } else {
      if (req->meta.gpu != one->meta.gpu || req->device != one->device)
        throw py::value_error("tf_mpi: grouped_allreduce arrays must all be numpy arrays or all on one GPU");
      req->meta.tensors.push_back(one->meta.tensors[0]);
      req->inputs.push_back(one->inputs[0]);
      // Ordered after the first array's stream: CuPy, for one, reports the
      // current stream for every array.
      if (!req->stream) req->stream = one->stream;
    }
    Output out = MakeOutput(in, gpu ? &*gpu : nullptr, req->meta.tensors.back().shape);
    req->outputs.push_back(out.data);
    outs.append(out.array);
  }
  req->meta.op = static_cast<ReduceOp>(op);
  req->meta.prescale = prescale;
  req->meta.postscale = postscale;
  Run(std::move(req), set);
  return outs;
}

// `root` is relative to the set (the Python API translates Horovod's global root rank).
py::object Broadcast(py::object in, int root, const std::string& name, int set) {
  std::optional<CudaArrayView> gpu;
  auto req = Prepare(CollectiveType::kBroadcast, name, in, &gpu);
  req->meta.root = root;
  Output out = MakeOutput(in, gpu ? &*gpu : nullptr, req->meta.tensors[0].shape);
  req->outputs.push_back(out.data);
  Run(std::move(req), set);
  return out.array;
}

py::object Allgather(py::object in, const std::string& name, int set) {
  std::optional<CudaArrayView> gpu;
  auto req = Prepare(CollectiveType::kAllgather, name, in, &gpu);
  // The output size is known only after negotiation, on the engine thread,
  // where Python objects must not be touched: gather into a C++ buffer
  // (host) or a DeviceArray created there (GPU).
  auto buffer = std::make_shared<std::vector<char>>();
  auto shape = std::make_shared<Shape>();
  if (gpu) {
    auto holder = std::make_shared<std::shared_ptr<DeviceArray>>();
    const CudaArrayView v = *gpu;
    const bool managed = IsManaged(v.ptr);
    req->allocate = [holder, v, managed](size_t, const Shape& s) -> void* {
      try {
        *holder = std::make_shared<DeviceArray>(v.device, s, v.typestr, v.itemsize, managed);
      } catch (const std::exception& e) {
        // The other ranks are already in the collective: end the job clearly.
        LogError(std::string("cannot allocate an allgather result: ") + e.what());
        Engine::Abort(1);
      }
      return (*holder)->data();
    };
    Run(std::move(req), set);
    return py::cast(*holder);
  }
  const size_t elem = py::array(in).itemsize();
  req->allocate = [buffer, shape, elem](size_t, const Shape& s) -> void* {
    *shape = s;
    buffer->resize(std::max<int64_t>(1, NumElements(s)) * elem);
    return buffer->data();
  };
  Run(std::move(req), set);
  py::array out(py::array(in).dtype(), std::vector<py::ssize_t>(shape->begin(), shape->end()));
  std::memcpy(out.mutable_data(), buffer->data(), NumElements(*shape) * elem);
  return out;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "tf_mpi engine binding (runtime and numpy collectives)";
  py::register_exception<PeerLostError>(m, "PeerLostError", PyExc_RuntimeError);
  m.def("init", [](std::optional<int64_t> fortran_comm, std::vector<int> ranks) {
          InitOptions opts;
          if (fortran_comm) { opts.has_comm = true; opts.fortran_comm = static_cast<MPI_Fint>(*fortran_comm); }
          opts.ranks = std::move(ranks);
          Status s;
          { py::gil_scoped_release release; s = E().Init(opts); }
          // Shut the engine down (and finalise MPI if we started it) at
          // interpreter exit, before mpi4py's own finaliser runs; also after
          // a failed init(), which may have started MPI (Engine::Init).
          static bool registered = false;
          if (!registered) {
            py::module_::import("atexit").attr("register")(py::module_::import("tf_mpi._core").attr("finalize"));
            registered = true;
          }
          Raise(s);
        }, py::arg("fortran_comm") = py::none(), py::arg("ranks") = std::vector<int>{});
  m.def("shutdown", [] { py::gil_scoped_release release; Engine::ShutdownAll(); });
  m.def("add_process_set", [](int id, std::optional<int64_t> fortran_comm) {
          InitOptions opts;
          if (fortran_comm) { opts.has_comm = true; opts.fortran_comm = static_cast<MPI_Fint>(*fortran_comm); }
          Status s;
          { py::gil_scoped_release release; s = Engine::AddSet(id, opts, fortran_comm.has_value()); }
          Raise(s);
        }, py::arg("process_set_id"), py::arg("fortran_comm") = py::none(),
        "Registers process set `process_set_id`; members pass the set's communicator (collective over them).");
  m.def("remove_process_set", [](int id) { py::gil_scoped_release release; return Engine::RemoveSet(id); },
        py::arg("process_set_id"));
  m.def("process_set_ids", [] { return Engine::SetIds(); });
  m.def("process_set_rank", [](int id) { return SetEngine(id)->mpi().rank(); }, py::arg("process_set_id"));
  m.def("process_set_size", [](int id) { return SetEngine(id)->mpi().size(); }, py::arg("process_set_id"));
  m.def("finalize", [] { py::gil_scoped_release release; Engine::Finalize(); });
  m.def("abort", [](int code) { Engine::Abort(code); });
  m.def("is_initialized", [] { return E().initialized(); });
  m.def("rank", [] { return Ctx().rank(); });
  m.def("size", [] { return Ctx().size(); });
  m.def("local_rank", [] { return Ctx().local_rank(); });
  m.def("local_size", [] { return Ctx().local_size(); });
  m.def("cross_rank", [] { return Ctx().cross_rank(); });
  m.def("cross_size", [] { return Ctx().cross_size(); });
  m.def("mpi_threads_supported", [] { Ctx(); return MpiContext::ThreadMultiple(); });
  m.def("config", [] {
    EngineConfig c = E().config();
    c.tunables = E().tunables();  // as the autotuner left them
    return c.ToString();
  });
  m.def("start_timeline", [](const std::string& path) { Raise(E().StartTimeline(path)); });
  m.def("stop_timeline", [] { E().StopTimeline(); });
  m.def("stats", [] {
    const ExecutorStats& s = E().stats();
    return py::dict(py::arg("requests") = s.requests.load(), py::arg("errors") = s.errors.load(),
                    py::arg("allreduce_buckets") = s.allreduce_buckets.load(), py::arg("held_back") = s.held_back.load(),
                    py::arg("gpu_requests") = s.gpu_requests.load(),
                    py::arg("gpu_staged_bytes") = s.gpu_staged_bytes.load(),
                    py::arg("gpu_direct_bytes") = s.gpu_direct_bytes.load(),
                    py::arg("inline_batches") = s.inline_batches.load(),
                    py::arg("inline_max_batch_bytes") = s.inline_max_batch_bytes.load(),
                    py::arg("deferred_batches") = s.deferred_batches.load(),
                    py::arg("callbacks_under_lock") = s.callbacks_under_lock.load(),
                    py::arg("undelivered_messages") = s.undelivered_messages.load(),
                    py::arg("undelivered_bytes") = s.undelivered_bytes.load(),
                    // hierarchical allreduce (hierarchical.h)
                    py::arg("hierarchical_allreduces") = s.hierarchical_allreduces.load(),
                    py::arg("hierarchical_bytes") = s.hierarchical_bytes.load(),
                    // the negotiation's own messages (not the collectives' payloads)
                    py::arg("negotiation_msgs_sent") = s.negotiation_msgs_sent.load(),
                    py::arg("negotiation_bytes_sent") = s.negotiation_bytes_sent.load(),
                    py::arg("negotiation_msgs_received") = s.negotiation_msgs_received.load(),
                    py::arg("negotiation_bytes_received") = s.negotiation_bytes_received.load(),
                    // Payload bytes handed to MPI collectives (ExecutorStats::CountPayload).
                    py::arg("payload_bytes_sent") = s.payload_bytes_sent.load(),
                    py::arg("payload_bytes_allreduce") = s.payload_bytes_by_type[0].load(),
                    py::arg("payload_bytes_allgather") = s.payload_bytes_by_type[1].load(),
                    py::arg("payload_bytes_broadcast") = s.payload_bytes_by_type[2].load(),
                    py::arg("payload_bytes_alltoall") = s.payload_bytes_by_type[3].load(),
                    py::arg("payload_bytes_reducescatter") = s.payload_bytes_by_type[4].load(),
                    // shared-memory allreduce (shm_allreduce.h)
                    py::arg("shm_allreduces") = s.shm_allreduces.load(), py::arg("shm_bytes") = s.shm_bytes.load(),
                    // shared-memory buckets of several tensors, no fusion buffer (ShmPiece)
                    py::arg("shm_fused_buckets") = s.shm_fused_buckets.load(),
                    py::arg("shm_fused_pieces") = s.shm_fused_pieces.load(),
                    // ... and those whose slots this rank streamed to memory (SlotWrites)
                    py::arg("shm_streamed_slots") = s.shm_streamed_slots.load());
  }, "Counters since process start: completed requests, failed requests, allreduce buckets executed,\n"
     "(rank 0) allreduces held back to be sent with later ones (TF_MPI_AUTOTUNE), GPU requests, and bytes\n"
     "the GPU transports moved: staged (device<->host copies) and direct (device memory handed to MPI);\n"
     "batches a caller's thread executed inline (and the largest, in bytes), batches it left to the engine\n"
     "thread, completion callbacks run under an engine lock (a bug if not 0), and protocol messages (and\n"
     "bytes) that never reached their peer at shutdown; allreduce buffers (and bytes) reduced hierarchically;\n"
     "the negotiation's own messages and bytes this rank sent and received (announcements and decisions, not\n"
     "the collectives' data); payload bytes this rank handed to MPI collectives (payload_bytes_sent, and per\n"
     "collective: allreduce and reducescatter their input, allgather this rank's rows, broadcast the root's\n"
     "buffer, alltoall the rows sent to other ranks); allreduce buckets (and bytes) that ran over shared memory,\n"
     "those fused from several tensors (and their tensors), and those whose slots this rank streamed to memory.");
  m.def("set_shm_paused", [](bool paused) { ShmCollectives::SetPaused(paused); },
        "Testing/benchmark hook: while paused, allreduces take the MPI path instead of shared memory. Call it on\n"
        "every rank at the same point with no collective in flight (e.g. after a barrier), or ranks disagree.");
  m.def("hierarchical", [] {
    Ctx();
    const HierarchicalChoice& c = E().hierarchical();
    const int64_t any = std::numeric_limits<int64_t>::max();
    return py::dict(py::arg("mode") = HierarchicalModeName(c.mode), py::arg("usable") = c.usable,
                    py::arg("min_bytes") = c.window.min_bytes,
                    py::arg("max_bytes") = c.window.max_bytes == any ? py::object(py::none())
                                                                     : py::object(py::int_(c.window.max_bytes)),
                    py::arg("homogeneous") = Ctx().homogeneous(), py::arg("summary") = c.summary,
                    py::arg("intra_alpha_s") = c.intra.alpha_s, py::arg("intra_beta_s") = c.intra.beta_s,
                    py::arg("inter_alpha_s") = c.inter.alpha_s, py::arg("inter_beta_s") = c.inter.beta_s,
                    py::arg("timed") = py::dict(py::arg("bytes") = c.timed.bytes, py::arg("flat_s") = c.timed.flat_s,
                                                py::arg("hierarchical_s") = c.timed.hierarchical_s,
                                                py::arg("seconds") = c.timed.seconds));
  }, "Where allreduces of host memory use the hierarchical scheme (TF_MPI_HIERARCHICAL): the mode, whether the\n"
     "topology allows it, the buffer sizes [min_bytes, max_bytes) that use it (max_bytes None: no upper end;\n"
     "min == max: none), whether all nodes have the same number of ranks, a one-line summary, the model's\n"
     "links (seconds per message step and per byte; the inter-node one measured at start-up unless set), and\n"
     "`timed`: across real hosts under auto, the start-up timings the window came from (sizes in bytes, fastest\n"
     "seconds of the flat and the hierarchical path, the slowest rank's; empty lists where not timed).");
  m.def("hierarchical_model", [](double bytes, int nodes, int ranks_per_node, py::object intra_alpha_s,
                                  py::object intra_beta_s, py::object inter_alpha_s, py::object inter_beta_s,
                                  const std::string& flat_name) {
    if (flat_name != "node-aware" && flat_name != "single-level")
      throw py::value_error("flat='" + flat_name + "': expected 'node-aware' or 'single-level'");
    const FlatModel flat = flat_name == "node-aware" ? FlatModel::kNodeAware : FlatModel::kSingleLevel;
    HierarchicalSettings s = HierarchicalSettings::FromEnv();
    if (!intra_alpha_s.is_none()) s.intra.alpha_s = intra_alpha_s.cast<double>();
    if (!intra_beta_s.is_none()) s.intra.beta_s = intra_beta_s.cast<double>();
    if (!inter_alpha_s.is_none()) s.inter.alpha_s = inter_alpha_s.cast<double>();
    if (!inter_beta_s.is_none()) s.inter.beta_s = inter_beta_s.cast<double>();
    const SizeWindow w = HierarchicalWindow(nodes, ranks_per_node, s.intra, s.inter, flat);
    const int64_t any = std::numeric_limits<int64_t>::max();
    return py::dict(
        py::arg("flat_s") = FlatAllreduceSeconds(bytes, nodes, ranks_per_node, s.intra, s.inter, flat),
        py::arg("hierarchical_s") = HierarchicalAllreduceSeconds(bytes, nodes, ranks_per_node, s.intra, s.inter),
        py::arg("auto_min_bytes") = w.min_bytes,
        py::arg("auto_max_bytes") = w.max_bytes == any ? py::object(py::none()) : py::object(py::int_(w.max_bytes)));
  }, py::arg("bytes"), py::arg("nodes"), py::arg("ranks_per_node"), py::arg("intra_alpha_s") = py::none(),
     py::arg("intra_beta_s") = py::none(), py::arg("inter_alpha_s") = py::none(), py::arg("inter_beta_s") = py::none(),
     py::arg("flat") = "node-aware",
     "The alpha-beta model behind TF_MPI_HIERARCHICAL=auto: modelled seconds of one allreduce of `bytes`, flat and\n"
     "hierarchical, on nodes x ranks_per_node ranks, and the sizes auto would use there. Links: the arguments\n"
     "given (seconds per message step, seconds per byte; e.g. those of hierarchical()), else\n"
     "TF_MPI_INTRA_NODE_LINK / TF_MPI_INTER_NODE_LINK, else the defaults. flat: how MPI's own allreduce crosses\n"
     "nodes, 'node-aware' (real hosts) or 'single-level' (TF_MPI_TOPOLOGY's nodes on one host). Needs no init().");
  m.def("hierarchical_window_from_timings", [](std::vector<int64_t> bytes, std::vector<double> flat_s,
                                               std::vector<double> hierarchical_s) {
    if (bytes.size() != flat_s.size() || bytes.size() != hierarchical_s.size())
      throw py::value_error("bytes, flat_s and hierarchical_s must have the same length");
    const SizeWindow w = WindowFromTimings(PathTimings{std::move(bytes), std::move(flat_s), std::move(hierarchical_s)});
    const int64_t any = std::numeric_limits<int64_t>::max();
    return py::make_tuple(w.min_bytes, w.max_bytes == any ? py::object(py::none()) : py::object(py::int_(w.max_bytes)));
  }, py::arg("bytes"), py::arg("flat_s"), py::arg("hierarchical_s"),
     "auto's window across real hosts from start-up timings (hierarchical_timing.h): (min_bytes, max_bytes or\n"
     "None) for timed sizes and the two paths' seconds; min == max: nowhere. Needs no init().");
  m.def("link_from_ping_pong", [](double small_s, int64_t small_bytes, double large_s, int64_t large_bytes,
                                  int streams) {
    const Link l = LinkFromPingPong(small_s, small_bytes, large_s, large_bytes, streams);
    return py::make_tuple(l.alpha_s, l.beta_s);
  }, py::arg("small_one_way_s"), py::arg("small_bytes"), py::arg("large_one_way_s"), py::arg("large_bytes"),
     py::arg("streams"),
     "The start-up probe's arithmetic (link_probe.h): (alpha_s, beta_s) from median one-way times of a small\n"
     "and a large message, `streams` ranks of a node sending the large one at once.");
  py::class_<DeviceArray, std::shared_ptr<DeviceArray>>(
      m, "DeviceArray",
      "GPU memory holding a collective's result; use it through __cuda_array_interface__, e.g. cupy.asarray(a).")
      .def_property_readonly("__cuda_array_interface__", &DeviceArray::Interface)
      .def_property_readonly("shape", [](const DeviceArray& a) { return a.shape(); })
      .def_property_readonly("device", &DeviceArray::device);
  m.def("cuda_built", [] { return CudaPartInstalled(); },
        "Whether tf_mpi's CUDA part (libtfmpi_cuda.so) was built and installed.");
  m.def("gpu_transport", [] {
    Ctx();
    const GpuTransportChoice& c = E().gpu_transport();
    return py::dict(py::arg("transport") = GpuTransportName(c.transport),
                    py::arg("mpi_cuda_aware") = c.mpi_cuda_aware, py::arg("reason") = c.reason);
  }, "How GPU tensors reach MPI in this process: 'direct' (device pointers to a CUDA-aware MPI) or 'staged'\n"
     "(pinned host buffers, pipelined), the MPI's own answer (1, 0, -1: no query) and why.");
  m.def("allreduce", &Allreduce, py::arg("array"), py::arg("op"), py::arg("name"),
        py::arg("prescale_factor") = 1.0, py::arg("postscale_factor") = 1.0, py::arg("process_set_id") = 0);
  m.def("grouped_allreduce", &GroupedAllreduce, py::arg("arrays"), py::arg("op"), py::arg("name"),
        py::arg("prescale_factor") = 1.0, py::arg("postscale_factor") = 1.0, py::arg("process_set_id") = 0,
        "Allreduces several arrays as one negotiated, fused unit; returns the results in order.");
  m.def("reducescatter", &Reducescatter, py::arg("array"), py::arg("op"), py::arg("name"),
        py::arg("prescale_factor") = 1.0, py::arg("postscale_factor") = 1.0, py::arg("process_set_id") = 0);
  m.def("join", [] {
    auto req = std::make_unique<Request>();
    req->meta.name = kJoinName;
    req->meta.type = CollectiveType::kJoin;
    auto last = std::make_shared<int32_t>(-1);
    req->outputs.push_back(last.get());
    Run(std::move(req));
    return *last;
  }, "Blocks until every rank has called join(); meanwhile this rank contributes zeros to the others' "
     "allreduces (and no rows to allgathers). Returns the last rank to join.");
  m.def("allgather", &Allgather, py::arg("array"), py::arg("name"), py::arg("process_set_id") = 0);
  m.def("broadcast", &Broadcast, py::arg("array"), py::arg("root_rank"), py::arg("name"),
        py::arg("process_set_id") = 0, "root_rank is the set's own rank of the root.");
}
