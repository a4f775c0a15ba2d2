// The CUDA part of the engine (libtfmpi_cuda.so): thin runtime-API wrappers
// plus the two kernels the executor needs on device buffers, ScaleCopy and
// FillIdentity. The engine reaches it only through tfmpi_cuda_api()
// (core/transports/cuda_api.h), so nothing here may throw, abort or print.
//
// The kernels must give the same bits as core/common/scale.cc on x86-64, because a
// tensor may be scaled on the host on one rank and on a device on another.
// The GPU differs from x86 where C++ leaves things open (NaN results,
// out-of-range float->int casts), so those cases are emulated explicitly.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "transports/cuda_api.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocksX = 2048;
// Factor-1 copies at least this big go to cudaMemcpyAsync; smaller ones are
// batched into the kernel so that many small tensors cost one launch.
constexpr int64_t kMemcpyBytes = 1 << 20;

// The float factor is converted on the host so it is the engine's own
// (float)factor, NaN payload included.
struct Desc {
  void* dst;
  const void* src;
  int64_t count;
  double factor;
  float ffactor;
};

// Passed by value as the kernel parameter: no device-side descriptor buffer,
// no extra copy, nothing to free. 96 * 40 bytes stays below the 4 KB limit.
constexpr int kBatch = 96;
struct Batch {
  Desc d[kBatch];
};
static_assert(sizeof(Batch) <= 4000, "kernel parameter must stay under 4 KB");

int Err(cudaError_t e) { return static_cast<int>(e); }

// ---- x86-64 arithmetic on the device -------------------------------------
// x86 SSE returns the first NaN operand, quieted, and the negative "default
// NaN" for invalid operations (inf * 0); the GPU returns a canonical NaN.
__device__ __forceinline__ float MulX86(float a, float b) {
  float r = a * b;
  if (r != r) {
    uint32_t bits = isnan(a) ? __float_as_uint(a) : isnan(b) ? __float_as_uint(b) : 0xffc00000u;
    r = __uint_as_float(bits | 0x00400000u);
  }
  return r;
}

__device__ __forceinline__ double MulX86(double a, double b) {
  double r = a * b;
  if (r != r) {
    unsigned long long bits = isnan(a) ? __double_as_longlong(a)
                              : isnan(b) ? __double_as_longlong(b) : 0xfff8000000000000ull;
    r = __longlong_as_double(bits | 0x0008000000000000ull);
  }
  return r;
}

// static_cast<T>(double) as gcc/clang compile it for x86-64: cvttsd2si to
// int32 (or int64) then truncation; NaN and out-of-range give INT_MIN. The
// GPU's conversions saturate instead.
template <typename T>
__device__ __forceinline__ T FromDouble(double v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v != 0.0;
  } else if constexpr (sizeof(T) == 8) {
    return (v >= -9223372036854775808.0 && v < 9223372036854775808.0)
               ? static_cast<T>(static_cast<long long>(v)) : static_cast<T>(INT64_MIN);
  } else {
    int32_t i = (v >= -2147483648.0 && v < 2147483648.0) ? static_cast<int32_t>(v) : INT32_MIN;
    return static_cast<T>(i);
  }
}

// ---- element types -------------------------------------------------------
// Elem<T>: S is the storage type (16-bit floats are moved as raw bits so that
// copies are bitwise), Scale() is one element of ScaleCopy.
template <typename T>
struct Elem {  // integers and bool
  using S = T;
  static __device__ S Scale(S x, const Desc& d) { return FromDouble<T>(MulX86(static_cast<double>(x), d.factor)); }
};

template <>
struct Elem<float> {
  using S = float;
  static __device__ S Scale(S x, const Desc& d) { return MulX86(x, d.ffactor); }
};

template <>
struct Elem<double> {
  using S = double;
  static __device__ S Scale(S x, const Desc& d) { return MulX86(x, d.factor); }
};

struct F16Tag {};
struct BF16Tag {};

template <>
struct Elem<F16Tag> {
  using S = uint16_t;
  static __device__ S Scale(S x, const Desc& d) {
    // The GPU's half->float conversion canonicalises NaNs; the host keeps
    // sign and payload (half.h ToFloat), and the sign survives to the result.
    const float a = (x & 0x7fffu) > 0x7c00u
                        ? __uint_as_float(((x & 0x8000u) << 16) | 0x7f800000u | ((x & 0x3ffu) << 13))
                        : __half2float(__ushort_as_half(x));
    float v = MulX86(a, d.ffactor);
    // half.h ToFloat16 keeps only the sign of a NaN.
    if (v != v) return static_cast<S>(((__float_as_uint(v) >> 16) & 0x8000u) | 0x7e00u);
    return __half_as_ushort(__float2half_rn(v));
  }
};

template <>
struct Elem<BF16Tag> {
  using S = uint16_t;
  static __device__ S Scale(S x, const Desc& d) {
    float v = MulX86(__bfloat162float(__ushort_as_bfloat16(x)), d.ffactor);
    // half.h ToBFloat16 truncates a NaN and sets the quiet bit.
    if (v != v) return static_cast<S>((__float_as_uint(v) >> 16) | 0x40u);
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};

// The one switch from the engine's dtype to an element type.
template <typename Fn>
int DispatchDtype(int dtype, Fn&& fn) {
  switch (dtype) {
    case 0: return fn(Elem<uint8_t>{});
    case 1: return fn(Elem<int8_t>{});
    case 2: return fn(Elem<int32_t>{});
    case 3: return fn(Elem<int64_t>{});
    case 4: return fn(Elem<F16Tag>{});
    case 5: return fn(Elem<BF16Tag>{});
    case 6: return fn(Elem<float>{});
    case 7: return fn(Elem<double>{});
    case 8: return fn(Elem<bool>{});
    case 9: return fn(Elem<int16_t>{});
    case 10: return fn(Elem<uint16_t>{});
    default: return Err(cudaErrorInvalidValue);
  }
}

// ---- kernels -------------------------------------------------------------
// blockIdx.y picks the entry, x is a grid-stride loop over its elements,
// 16 bytes per thread where both pointers allow it (one 2-byte access per
// thread leaves most of the memory bandwidth unused).
template <typename E>
__global__ void __launch_bounds__(kThreads) ScaleCopyKernel(const Batch batch) {
  using S = typename E::S;
  constexpr int kVec = 16 / sizeof(S);
  const Desc d = batch.d[blockIdx.y];
  const S* in = static_cast<const S*>(d.src);
  S* out = static_cast<S*>(d.dst);
  const bool copy = d.factor == 1.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) & 15) == 0) {
    const int64_t nvec = d.count / kVec;
    for (int64_t v = first; v < nvec; v += stride) {
      uint4 w = reinterpret_cast<const uint4*>(in)[v];
      if (!copy) {
        S e[kVec];
        memcpy(e, &w, sizeof(w));
#pragma unroll
        for (int j = 0; j < kVec; ++j) e[j] = E::Scale(e[j], d);
        memcpy(&w, e, sizeof(w));
      }
      reinterpret_cast<uint4*>(out)[v] = w;
    }
    done = nvec * kVec;
  }
  for (int64_t i = done + first; i < d.count; i += stride) out[i] = copy ? in[i] : E::Scale(in[i], d);
}

template <typename S>
__global__ void __launch_bounds__(kThreads) FillKernel(S* dst, int64_t count, S value) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    dst[i] = value;
}

unsigned BlocksFor(int64_t count) {
  int64_t b = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b > kMaxBlocksX ? kMaxBlocksX : b);
}

// ---- identity values (host) ----------------------------------------------
// Same table as FillIdentity in scale.cc; op values from types.h ReduceOp.
constexpr int kOpMin = 2, kOpMax = 3, kOpProduct = 4;

template <typename T>
T Identity(Elem<T>, int op) {
  using L = std::numeric_limits<T>;
  if (op == kOpProduct) return static_cast<T>(1);
  if constexpr (L::has_infinity) {
    if (op == kOpMin) return L::infinity();
    if (op == kOpMax) return -L::infinity();
  } else {
    if (op == kOpMin) return L::max();  // true for bool
    if (op == kOpMax) return L::lowest();
  }
  return static_cast<T>(0);
}

uint16_t Identity(Elem<F16Tag>, int op) {
  return op == kOpProduct ? 0x3c00 : op == kOpMin ? 0x7c00 : op == kOpMax ? 0xfc00 : 0;
}

uint16_t Identity(Elem<BF16Tag>, int op) {
  return op == kOpProduct ? 0x3f80 : op == kOpMin ? 0x7f80 : op == kOpMax ? 0xff80 : 0;
}

// ---- API functions -------------------------------------------------------
const char* ErrorString(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int DeviceCount(int* count) {
  cudaError_t e = cudaGetDeviceCount(count);
  if (e != cudaSuccess) *count = 0;  // the runtime leaves it unset on error
  return Err(e);
}

// The memory type of `ptr`; unregistered host memory is cudaMemoryTypeUnregistered.
int PointerType(const void* ptr, cudaPointerAttributes* attr) {
  cudaError_t e = cudaPointerGetAttributes(attr, ptr);
  if (e == cudaErrorInvalidValue) {
    // Unregistered host memory on old runtimes: an error, and a sticky one.
    cudaGetLastError();
    attr->type = cudaMemoryTypeUnregistered;
    return 0;
  }
  return Err(e);
}

int PointerDevice(const void* ptr, int* device) {
  cudaPointerAttributes attr{};
  if (int e = PointerType(ptr, &attr)) return e;
  const bool on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  *device = on_device ? attr.device : -1;
  return 0;
}

int PointerIsManaged(const void* ptr, int* managed) {
  cudaPointerAttributes attr{};
  if (int e = PointerType(ptr, &attr)) return e;
  *managed = attr.type == cudaMemoryTypeManaged ? 1 : 0;
  return 0;
}

int SetDevice(int device) { return Err(cudaSetDevice(device)); }
int GetDevice(int* device) { return Err(cudaGetDevice(device)); }

int Malloc(void** ptr, size_t bytes, int managed) {
  if (bytes == 0) bytes = 1;  // callers treat null as failure
  return Err(managed ? cudaMallocManaged(ptr, bytes, cudaMemAttachGlobal) : cudaMalloc(ptr, bytes));
}
int Free(void* ptr) { return Err(cudaFree(ptr)); }
int HostAlloc(void** ptr, size_t bytes) {
  return Err(cudaHostAlloc(ptr, bytes == 0 ? 1 : bytes, cudaHostAllocPortable));
}
int HostFree(void* ptr) { return Err(cudaFreeHost(ptr)); }

cudaStream_t AsStream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t AsEvent(void* e) { return static_cast<cudaEvent_t>(e); }

int StreamCreate(void** stream) {
  cudaStream_t s = nullptr;
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  *stream = s;
  return Err(e);
}
int StreamDestroy(void* stream) { return Err(cudaStreamDestroy(AsStream(stream))); }
int StreamSynchronize(void* stream) { return Err(cudaStreamSynchronize(AsStream(stream))); }

int EventCreate(void** event) {
  cudaEvent_t ev = nullptr;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  *event = ev;
  return Err(e);
}
int EventDestroy(void* event) { return Err(cudaEventDestroy(AsEvent(event))); }
int EventRecord(void* event, void* stream) { return Err(cudaEventRecord(AsEvent(event), AsStream(stream))); }
int EventSynchronize(void* event) { return Err(cudaEventSynchronize(AsEvent(event))); }
int StreamWaitEvent(void* stream, void* event) {
  return Err(cudaStreamWaitEvent(AsStream(stream), AsEvent(event), 0));
}

int MemcpyAsync(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return 0;
  return Err(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, AsStream(stream)));
}

int ScaleCopyBatchAsync(const TfMpiScaleCopy* entries, int n, int dtype, void* stream) {
  if (n < 0 || (n > 0 && entries == nullptr)) return Err(cudaErrorInvalidValue);
  return DispatchDtype(dtype, [&](auto elem) -> int {
    using E = decltype(elem);
    using S = typename E::S;
    cudaStream_t s = AsStream(stream);
    Batch batch;
    int used = 0;
    int64_t max_count = 0;
    auto launch = [&]() -> int {
      if (used == 0) return 0;
      const int64_t vecs = (max_count * static_cast<int64_t>(sizeof(S)) + 15) / 16;
      ScaleCopyKernel<E><<<dim3(BlocksFor(vecs), used), kThreads, 0, s>>>(batch);
      used = 0;
      max_count = 0;
      return Err(cudaGetLastError());
    };
    for (int k = 0; k < n; ++k) {
      const TfMpiScaleCopy& e = entries[k];
      if (e.count <= 0) continue;
      if (e.factor == 1.0) {
        if (e.dst == e.src) continue;  // nothing to do in place
        const int64_t bytes = e.count * static_cast<int64_t>(sizeof(S));
        if (bytes >= kMemcpyBytes) {
          cudaError_t err = cudaMemcpyAsync(e.dst, e.src, static_cast<size_t>(bytes), cudaMemcpyDefault, s);
          if (err != cudaSuccess) return Err(err);
          continue;
        }
      }
      batch.d[used++] = Desc{e.dst, e.src, e.count, e.factor, static_cast<float>(e.factor)};
      if (e.count > max_count) max_count = e.count;
      if (used == kBatch) {
        if (int rc = launch()) return rc;
      }
    }
    return launch();
  });
}

int FillIdentityAsync(void* dst, int64_t count, int dtype, int reduce_op, void* stream) {
  if (count < 0) return Err(cudaErrorInvalidValue);
  if (count == 0) return 0;
  return DispatchDtype(dtype, [&](auto elem) -> int {
    using S = typename decltype(elem)::S;
    const S value = Identity(elem, reduce_op);
    FillKernel<S><<<BlocksFor(count), kThreads, 0, AsStream(stream)>>>(static_cast<S*>(dst), count, value);
    return Err(cudaGetLastError());
  });
}

TfMpiCudaApi MakeApi() {
  TfMpiCudaApi a{};
  a.version = TFMPI_CUDA_API_VERSION;
  a.error_string = ErrorString;
  a.device_count = DeviceCount;
  a.pointer_device = PointerDevice;
  a.pointer_is_managed = PointerIsManaged;
  a.set_device = SetDevice;
  a.get_device = GetDevice;
  a.malloc = Malloc;
  a.free = Free;
  a.host_alloc = HostAlloc;
  a.host_free = HostFree;
  a.stream_create = StreamCreate;
  a.stream_destroy = StreamDestroy;
  a.stream_synchronize = StreamSynchronize;
  a.event_create = EventCreate;
  a.event_destroy = EventDestroy;
  a.event_record = EventRecord;
  a.event_synchronize = EventSynchronize;
  a.stream_wait_event = StreamWaitEvent;
  a.memcpy_async = MemcpyAsync;
  a.scale_copy_batch_async = ScaleCopyBatchAsync;
  a.fill_identity_async = FillIdentityAsync;
  return a;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const TfMpiCudaApi* tfmpi_cuda_api(void) {
  static const TfMpiCudaApi api = MakeApi();
  return &api;
}
