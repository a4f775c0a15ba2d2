// The C interface between the engine (libtfmpi_core.so, built without CUDA
// headers) and its CUDA part (libtfmpi_cuda.so, built by nvcc when a CUDA
// compiler is found). The engine loads the CUDA part with dlopen on the first
// GPU request (cuda_device.cc), so a CPU-only install never needs a CUDA
// library. Plain C types only: the two libraries may be built by different
// compilers and the table is versioned.
//
// Conventions: every function returns 0 on success or a CUDA error code that
// error_string() turns into text. Streams and events are opaque handles
// (cudaStream_t / cudaEvent_t). `dtype` is the engine's DataType wire value
// and `reduce_op` its ReduceOp value (types.h).
#pragma once

#include <stddef.h>
#include <stdint.h>

#define TFMPI_CUDA_API_VERSION 1

extern "C" {

// One element-wise copy of a batch: dst[i] = src[i] * factor for i < count
// (no multiplication when factor == 1; dst == src scales in place).
typedef struct TfMpiScaleCopy {
  void* dst;
  const void* src;
  int64_t count;
  double factor;
} TfMpiScaleCopy;

typedef struct TfMpiCudaApi {
  int version;  // TFMPI_CUDA_API_VERSION
  const char* (*error_string)(int code);

  int (*device_count)(int* count);
  // The device ordinal that owns `ptr`, or -1 for host (including pinned) memory.
  int (*pointer_device)(const void* ptr, int* device);
  // Whether `ptr` is managed (cudaMallocManaged) memory: 1 or 0.
  int (*pointer_is_managed)(const void* ptr, int* managed);
  int (*set_device)(int device);
  int (*get_device)(int* device);

  // Device memory: cudaMalloc, or cudaMallocManaged when `managed` is set
  // (CPU-accessible; lets a non-CUDA-aware MPI run the direct transport in tests).
  int (*malloc)(void** ptr, size_t bytes, int managed);
  int (*free)(void* ptr);
  // Page-locked host memory (cudaHostAlloc, portable).
  int (*host_alloc)(void** ptr, size_t bytes);
  int (*host_free)(void* ptr);

  // A stream that does not synchronise with the legacy default stream.
  int (*stream_create)(void** stream);
  int (*stream_destroy)(void* stream);
  int (*stream_synchronize)(void* stream);
  // Events with timing disabled.
  int (*event_create)(void** event);
  int (*event_destroy)(void* event);
  int (*event_record)(void* event, void* stream);
  int (*event_synchronize)(void* event);
  // Work queued on `stream` after this call waits for `event`.
  int (*stream_wait_event)(void* stream, void* event);

  // Asynchronous copy in any direction (cudaMemcpyDefault).
  int (*memcpy_async)(void* dst, const void* src, size_t bytes, void* stream);
  // Runs every entry of `entries` (host memory, read during the call) with
  // as few kernel launches as possible (one per ~100 entries). Scaling follows
  // the host engine bit for bit: 16-bit floats and float32 multiply in float,
  // float64 in double, integers convert through double and truncate.
  int (*scale_copy_batch_async)(const TfMpiScaleCopy* entries, int n, int dtype, void* stream);
  // Fills `count` elements with the identity of `reduce_op` (0 for sum/avg,
  // 1 for product, +max/+inf for min, lowest/-inf for max).
  int (*fill_identity_async)(void* dst, int64_t count, int dtype, int reduce_op, void* stream);
} TfMpiCudaApi;

// The CUDA part's only exported symbol.
const TfMpiCudaApi* tfmpi_cuda_api(void);

}  // extern "C"
