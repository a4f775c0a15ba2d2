#include "transports/cuda_device.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <mutex>

#include "common/logging.h"

namespace tfmpi {

namespace {

// libtfmpi_cuda.so sits beside this library (both installed in tf_mpi/).
std::string CudaPartPath() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&CudaPartPath), &info) || !info.dli_fname) return "libtfmpi_cuda.so";
  std::string self = info.dli_fname;
  const auto slash = self.rfind('/');
  return (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/libtfmpi_cuda.so";
}

const char* kHowToBuild =
    "tf_mpi's CUDA part (libtfmpi_cuda.so) is needed for GPU tensors. Rebuild tf_mpi on a machine with a CUDA "
    "compiler: put nvcc on PATH (or set TF_MPI_NVCC=/path/to/nvcc; `pip install nvidia-cuda-nvcc-cu12` provides "
    "one) and run `pip install --no-build-isolation .` again; see README, \"GPUs\".";

struct Loaded {
  const TfMpiCudaApi* api = nullptr;
  std::string why;
};

const Loaded& Load() {
  static Loaded loaded;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string path = CudaPartPath();
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      loaded.why = std::string("tf_mpi: cannot load ") + path + " (" + dlerror() + "). " + kHowToBuild;
      return;
    }
    using Entry = const TfMpiCudaApi* (*)();
    auto entry = reinterpret_cast<Entry>(dlsym(handle, "tfmpi_cuda_api"));
    const TfMpiCudaApi* api = entry ? entry() : nullptr;
    if (!api || api->version != TFMPI_CUDA_API_VERSION) {
      loaded.why = "tf_mpi: " + path + " does not match this build of tf_mpi (rebuild both). " + kHowToBuild;
      return;
    }
    int count = 0;
    if (int err = api->device_count(&count)) {
      loaded.why = std::string("tf_mpi: CUDA is not usable: ") + api->error_string(err);
      return;
    }
    loaded.api = api;
  });
  return loaded;
}

}  // namespace

bool CudaPartInstalled() {
  struct stat st{};
  return stat(CudaPartPath().c_str(), &st) == 0;
}

const TfMpiCudaApi* CudaApi(std::string* why) {
  const Loaded& l = Load();
  if (!l.api && why) *why = l.why;
  return l.api;
}

Status PointerDevice(const void* ptr, int* device) {
  std::string why;
  const TfMpiCudaApi* api = CudaApi(&why);
  if (!api) return Status::Precondition(why);
  if (int err = api->pointer_device(ptr, device))
    return Status::Invalid(std::string("tf_mpi: cannot tell where a CUDA array lives: ") + api->error_string(err));
  return Status::OK();
}

ScopedCudaDevice::ScopedCudaDevice(int device) {
  const TfMpiCudaApi* api = CudaApi(nullptr);
  if (!api || api->get_device(&previous_) != 0) previous_ = -1;
  if (api && previous_ != device) api->set_device(device);
  else previous_ = -1;  // nothing to restore
}

ScopedCudaDevice::~ScopedCudaDevice() {
  if (previous_ >= 0) CudaApi(nullptr)->set_device(previous_);
}

Status RecordReadyEvent(int device, void* stream, void** event) {
  std::string why;
  const TfMpiCudaApi* api = CudaApi(&why);
  if (!api) return Status::Precondition(why);
  ScopedCudaDevice on(device);
  if (int err = api->event_create(event))
    return Status::Internal(std::string("tf_mpi: cudaEventCreate failed: ") + api->error_string(err));
  if (int err = api->event_record(*event, stream)) {
    api->event_destroy(*event);
    *event = nullptr;
    return Status::Internal(std::string("tf_mpi: cannot record an event on the caller's CUDA stream: ") +
                            api->error_string(err));
  }
  return Status::OK();
}

CudaDevice::CudaDevice(const TfMpiCudaApi* api, int ordinal, bool managed_scratch)
    : api_(api), ordinal_(ordinal), managed_scratch_(managed_scratch) {
  ScopedCudaDevice on(ordinal_);
  for (void*& s : streams_) Check(api_->stream_create(&s), "cudaStreamCreate");
  for (void*& e : events_) Check(api_->event_create(&e), "cudaEventCreate");
}

CudaDevice::~CudaDevice() {
  ScopedCudaDevice on(ordinal_);
  for (void* s : streams_) if (s) api_->stream_synchronize(s);
  for (void* e : events_) if (e) api_->event_destroy(e);
  for (void* s : streams_) if (s) api_->stream_destroy(s);
  if (scratch_.ptr) api_->free(scratch_.ptr);
  for (Buffer& b : pinned_) if (b.ptr) api_->host_free(b.ptr);
}

bool CudaDevice::Check(int code, const char* what) {
  if (code == 0) return true;
  if (error_.ok())
    error_ = Status::Internal(std::string("tf_mpi: ") + what + " failed on GPU " + std::to_string(ordinal_) + ": " +
                              api_->error_string(code));
  return false;
}

Status CudaDevice::TakeError() {
  Status s = error_;
  error_ = Status::OK();
  return s;
}

void* CudaDevice::Scratch(int64_t bytes) {
  if (scratch_.bytes < bytes) {
    if (scratch_.ptr) {
      Synchronize();  // queued work may still use the old buffer
      api_->free(scratch_.ptr);
      scratch_ = {};
    }
    if (Check(api_->malloc(&scratch_.ptr, bytes, managed_scratch_ ? 1 : 0), "cudaMalloc (fusion buffer)"))
      scratch_.bytes = bytes;
    else scratch_.ptr = nullptr;
  }
  return scratch_.ptr;
}

void* CudaDevice::Pinned(int slot, int64_t bytes) {
  Buffer& b = pinned_.at(slot);
  if (b.bytes < bytes) {
    if (b.ptr) {
      Synchronize();
      api_->host_free(b.ptr);
      b = {};
    }
    if (Check(api_->host_alloc(&b.ptr, bytes), "cudaHostAlloc (staging buffer)")) b.bytes = bytes;
    else b.ptr = nullptr;
  }
  return b.ptr;
}

void CudaDevice::ScaleCopy(const std::vector<ScaleCopyItem>& items, DataType dtype) {
  if (failed() || items.empty()) return;
  std::vector<TfMpiScaleCopy> entries;
  entries.reserve(items.size());
  for (const ScaleCopyItem& it : items) entries.push_back({it.dst, it.src, it.count, it.factor});
  Check(api_->scale_copy_batch_async(entries.data(), static_cast<int>(entries.size()), static_cast<int>(dtype),
                                     streams_[kEngine]),
        "scaled copy kernel");
}

void CudaDevice::FillIdentity(void* dst, int64_t count, DataType dtype, ReduceOp op) {
  if (failed()) return;
  Check(api_->fill_identity_async(dst, count, static_cast<int>(dtype), static_cast<int>(op), streams_[kEngine]),
        "fill kernel");
}

void CudaDevice::Synchronize() {
  for (void* s : streams_) if (s) Check(api_->stream_synchronize(s), "cudaStreamSynchronize");
}

void CudaDevice::WaitAndRelease(void* event) {
  if (!event) return;
  if (!failed()) Check(api_->stream_wait_event(streams_[kEngine], event), "waiting for the producer's stream");
  api_->event_destroy(event);  // released once the wait is satisfied
}

void CudaDevice::Copy(StreamId stream, void* dst, const void* src, int64_t bytes) {
  if (failed() || bytes == 0) return;
  Check(api_->memcpy_async(dst, src, static_cast<size_t>(bytes), streams_[stream]), "cudaMemcpyAsync");
}

void CudaDevice::Record(StreamId stream, int slot) {
  if (!failed()) Check(api_->event_record(events_.at(slot), streams_[stream]), "cudaEventRecord");
}

void CudaDevice::HostWait(int slot) {
  if (!failed()) Check(api_->event_synchronize(events_.at(slot)), "cudaEventSynchronize");
}

void CudaDevice::StreamWait(StreamId stream, int slot) {
  if (!failed()) Check(api_->stream_wait_event(streams_[stream], events_.at(slot)), "cudaStreamWaitEvent");
}

}  // namespace tfmpi
