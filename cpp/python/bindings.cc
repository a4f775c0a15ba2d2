// tf_mpi._core: a thin pybind11 binding of the engine: runtime queries and
// numpy-level collectives. Collectives release the GIL while they wait.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <future>
#include <memory>

#include "../core/engine.h"

namespace py = pybind11;
using namespace tfmpi;

namespace {

Engine& E() { return Engine::Get(); }

void Raise(const Status& s) {
  if (s.ok()) return;
  if (s.code == StatusCode::kInvalidArgument) throw py::value_error(s.message);
  throw std::runtime_error(s.message);
}

const MpiContext& Ctx() {
  if (!E().initialized()) throw py::value_error("tf_mpi has not been initialized; call tf_mpi.init() first");
  return E().mpi();
}

DataType ToDataType(const py::dtype& dt) {
  const std::string name = py::str(dt.attr("name"));
  static const std::pair<const char*, DataType> table[] = {
      {"uint8", DataType::kUInt8},     {"int8", DataType::kInt8},         {"int32", DataType::kInt32},
      {"int64", DataType::kInt64},     {"float16", DataType::kFloat16},   {"bfloat16", DataType::kBFloat16},
      {"float32", DataType::kFloat32}, {"float64", DataType::kFloat64},   {"bool", DataType::kBool}};
  for (const auto& [n, t] : table)
    if (name == n) return t;
  throw py::type_error("tf_mpi: unsupported dtype " + name);
}

Shape ShapeOf(const py::array& a) { return Shape(a.shape(), a.shape() + a.ndim()); }

// Submits one request and blocks (without the GIL) until it completes.
void Run(std::unique_ptr<Request> req) {
  auto promise = std::make_shared<std::promise<Status>>();
  auto future = promise->get_future();
  req->done = [promise](const Status& s) { promise->set_value(s); };
  Status s;
  {
    py::gil_scoped_release release;
    s = E().Enqueue(std::move(req));
    if (s.ok()) s = future.get();
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

py::array Allreduce(py::array in, int op, const std::string& name, double prescale, double postscale) {
  in = py::array::ensure(in, py::array::c_style);
  py::array out(in.dtype(), std::vector<py::ssize_t>(in.shape(), in.shape() + in.ndim()));
  auto req = MakeRequest(CollectiveType::kAllreduce, name, in);
  req->meta.op = static_cast<ReduceOp>(op);
  req->meta.prescale = prescale;
  req->meta.postscale = postscale;
  req->outputs.push_back(out.mutable_data());
  Run(std::move(req));
  return out;
}

py::array Allgather(py::array in, const std::string& name) {
  in = py::array::ensure(in, py::array::c_style);
  auto req = MakeRequest(CollectiveType::kAllgather, name, in);
  // The output size is known only after negotiation, on the engine thread,
  // where Python objects must not be touched: gather into a C++ buffer.
  auto buffer = std::make_shared<std::vector<char>>();
  auto shape = std::make_shared<Shape>();
  const size_t elem = in.itemsize();
  req->allocate = [buffer, shape, elem](size_t, const Shape& s) -> void* {
    *shape = s;
    buffer->resize(std::max<int64_t>(1, NumElements(s)) * elem);
    return buffer->data();
  };
  Run(std::move(req));
  py::array out(in.dtype(), std::vector<py::ssize_t>(shape->begin(), shape->end()));
  std::memcpy(out.mutable_data(), buffer->data(), NumElements(*shape) * elem);
  return out;
}

py::array Broadcast(py::array in, int root, const std::string& name) {
  in = py::array::ensure(in, py::array::c_style);
  py::array out(in.dtype(), std::vector<py::ssize_t>(in.shape(), in.shape() + in.ndim()));
  auto req = MakeRequest(CollectiveType::kBroadcast, name, in);
  req->meta.root = root;
  req->outputs.push_back(out.mutable_data());
  Run(std::move(req));
  return out;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "tf_mpi engine binding (runtime and numpy collectives)";
  m.def("init", [](std::optional<int64_t> fortran_comm, std::vector<int> ranks) {
          InitOptions opts;
          if (fortran_comm) { opts.has_comm = true; opts.fortran_comm = static_cast<MPI_Fint>(*fortran_comm); }
          opts.ranks = std::move(ranks);
          Status s;
          { py::gil_scoped_release release; s = E().Init(opts); }
          Raise(s);
          // Shut the engine down (and finalise MPI if we started it) at
          // interpreter exit, before mpi4py's own finaliser runs.
          static bool registered = false;
          if (!registered) {
            py::module_::import("atexit").attr("register")(py::module_::import("tf_mpi._core").attr("finalize"));
            registered = true;
          }
        }, py::arg("fortran_comm") = py::none(), py::arg("ranks") = std::vector<int>{});
  m.def("shutdown", [] { py::gil_scoped_release release; E().Shutdown(); });
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
                    py::arg("allreduce_buckets") = s.allreduce_buckets.load(), py::arg("held_back") = s.held_back.load());
  }, "Counters since process start: completed requests, failed requests, allreduce buckets executed,\n"
     "and (rank 0) allreduces held back to be sent with later ones (TF_MPI_AUTOTUNE).");
  m.def("allreduce", &Allreduce, py::arg("array"), py::arg("op"), py::arg("name"),
        py::arg("prescale_factor") = 1.0, py::arg("postscale_factor") = 1.0);
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
  m.def("allgather", &Allgather, py::arg("array"), py::arg("name"));
  m.def("broadcast", &Broadcast, py::arg("array"), py::arg("root_rank"), py::arg("name"));
}
