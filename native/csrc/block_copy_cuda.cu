// libascendserve_cuda.so: CUDA kernels that copy KV-cache pages between a
// paged device cache and a contiguous device staging buffer.
//
// A plain C ABI, no torch: ascendserve/ops_cuda.py calls it through ctypes with raw
// device pointers and a cudaStream_t, so one build serves any CUDA build of
// torch (and builds where torch is CPU-only). native/build.sh compiles it with
// nvcc and links the CUDA runtime statically: at run time the library needs
// only the driver's libcuda.so, which the runtime opens on first use (so
// loading it on a host without a driver works; the calls then fail cleanly).
// The static runtime's symbols are hidden (--exclude-libs): the runtime torch
// loaded is never mixed with ours; both use the device's primary context, so
// torch's pointers and streams are valid here.
//
// Semantics ("strided runs"). A layer's pages are viewed as bytes
// [num_blocks, A, B, run_bytes] with byte strides (block_stride, stride_a,
// stride_b, 1): each page (one block of one layer) is A*B runs of run_bytes
// contiguous bytes. bases[l] is the device address of block 0 of layer l's
// view; buf is contiguous, [L, n, A, B, run_bytes], no padding.
//   gather:  buf[l][i][a][b][:] = run (a, b) of block ids[i] of layer l
//   scatter: the reverse.
// Positions whose id is outside [0, num_blocks) are skipped: ops_cuda.py
// range-checks ids before calling (an out-of-range id raises there), and marks
// with -1 each scatter position that a later repeat of the same id overrides,
// so "the last occurrence wins" costs the kernel one compare and keeps it
// free of write races (GPU threads write in no order).
//
// Contract: these functions trust their pointers (device addresses on
// `device`, bases/ids readable by the kernel, buf and every run in bounds),
// check only the scalar arguments, and never synchronize: the copy is queued
// on `stream` (0 = the legacy default stream) and its errors surface later.
// Return 0 or a cudaError_t code (asv_cuda_error_string says what it is).
//
// Work split: a work item is one chunk (<= 4 KiB) of one run; a group of
// 1..32 threads (about one per 16 bytes of a chunk) copies an item, so small
// runs do not idle a warp and long ones spread over many warps. A group copies
// with the widest width (16, 8, 4, 2 or 1 bytes) on which source and
// destination agree modulo that width: a byte head up to alignment, vectors
// (kUnroll in flight per thread), a byte tail. Index math is 32-bit with
// multiply-shift division: at most 2^32 - 1 items per call (never reached with
// runs of 33 bytes or more on a 141 GB GPU).

#include <cuda_runtime.h>

#include <cstdint>

#define ASV_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kAbiVersion = 1;
constexpr int kThreads = 256;             // per CTA
constexpr int64_t kChunkBytes = 4096;     // the most one work item copies
constexpr int kUnroll = 4;                // vector loads in flight per thread
constexpr int kMaxGroupShift = 5;         // groups of at most 32 threads (a warp)
constexpr uint32_t kMaxCtas = 1u << 16;   // more items: the CTAs loop (grid-stride)
constexpr uint64_t kMaxItems = UINT32_MAX;

// n / d for any 32-bit n by a fixed d >= 1: one high multiply, an add and a
// shift (Granlund & Montgomery 1994, figure 4.1). 64-bit division costs ~20x
// more, and every item decodes four quotients.
struct Divider {
  uint32_t d;
  uint32_t magic;
  uint32_t shift;
};

Divider make_divider(uint32_t d) {
  uint32_t shift = 0;
  while (shift < 32 && (uint64_t{1} << shift) < d) ++shift;  // ceil(log2(d))
  const uint64_t magic = ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1;
  return Divider{d, static_cast<uint32_t>(magic), shift};  // magic < 2^32 for every d
}

__host__ __device__ inline uint32_t mul_hi(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

__host__ __device__ inline uint32_t quotient(const Divider& v, uint32_t n) {
  // the sum may pass 2^32: add in 64 bits
  return static_cast<uint32_t>((static_cast<uint64_t>(mul_hi(n, v.magic)) + n) >> v.shift);
}

struct RunsArgs {
  const uint64_t* bases;  // [num_layers] address of block 0 of each layer's view
  const int64_t* ids;     // [n] block ids; outside [0, num_blocks): skip the position
  char* buf;              // [num_layers, n, A, B, run_bytes]
  int64_t num_blocks;
  int64_t block_stride;
  int64_t stride_a;
  int64_t stride_b;
  int64_t run_bytes;
  int64_t chunk_bytes;    // min(run_bytes, kChunkBytes)
  Divider chunks;         // chunks per run
  Divider b_extent;
  Divider a_extent;
  Divider n;
  uint32_t items;         // num_layers * n * A * B * chunks
  uint32_t group_shift;   // log2(threads per item)
};

// Copies len bytes as T words, every group-th one from `lane` on; dst and src
// agree modulo sizeof(T), so after the same head both are aligned.
template <typename T>
__host__ __device__ inline void copy_words(char* dst, const char* src, int len, int lane, int group) {
  constexpr int kWidth = static_cast<int>(sizeof(T));
  int head = static_cast<int>((kWidth - (reinterpret_cast<uintptr_t>(dst) & (kWidth - 1))) & (kWidth - 1));
  head = head < len ? head : len;
  const int words = (len - head) / kWidth;
  for (int k = lane; k < head; k += group) dst[k] = src[k];
  T* d = reinterpret_cast<T*>(dst + head);
  const T* s = reinterpret_cast<const T*>(src + head);
  int k = lane;
  for (; k + (kUnroll - 1) * group < words; k += kUnroll * group) {
    T v[kUnroll];  // all loads first: kUnroll requests in flight per thread
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = s[k + u * group];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[k + u * group] = v[u];
  }
  for (; k < words; k += group) d[k] = s[k];
  for (int t = head + words * kWidth + lane; t < len; t += group) dst[t] = src[t];
}

__host__ __device__ inline void copy_bytes(char* dst, const char* src, int len, int lane, int group) {
  const uintptr_t apart = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if ((apart & 15) == 0) {
    copy_words<uint4>(dst, src, len, lane, group);
  } else if ((apart & 7) == 0) {
    copy_words<uint2>(dst, src, len, lane, group);
  } else if ((apart & 3) == 0) {
    copy_words<uint32_t>(dst, src, len, lane, group);
  } else if ((apart & 1) == 0) {
    copy_words<uint16_t>(dst, src, len, lane, group);
  } else {
    copy_words<uint8_t>(dst, src, len, lane, group);
  }
}

// Item -> (layer, position i, a, b, chunk); buf's order makes the run index
// ((layer * n + i) * A + a) * B + b, so the item is run * chunks + chunk.
template <bool kScatter>
__host__ __device__ inline void copy_item(const RunsArgs& p, uint32_t item, int lane, int group) {
  const uint32_t run = quotient(p.chunks, item);
  const uint32_t chunk = item - run * p.chunks.d;
  const uint32_t ab = quotient(p.b_extent, run);
  const uint32_t b = run - ab * p.b_extent.d;
  const uint32_t li = quotient(p.a_extent, ab);
  const uint32_t a = ab - li * p.a_extent.d;
  const uint32_t layer = quotient(p.n, li);
  const uint32_t i = li - layer * p.n.d;
  const int64_t id = p.ids[i];
  if (id < 0 || id >= p.num_blocks) return;
  const int64_t offset = static_cast<int64_t>(chunk) * p.chunk_bytes;
  const int64_t left = p.run_bytes - offset;
  const int len = static_cast<int>(left < p.chunk_bytes ? left : p.chunk_bytes);
  char* page = reinterpret_cast<char*>(p.bases[layer]) + id * p.block_stride + a * p.stride_a +
               b * p.stride_b + offset;
  char* flat = p.buf + static_cast<int64_t>(run) * p.run_bytes + offset;
  if (kScatter) {
    copy_bytes(page, flat, len, lane, group);
  } else {
    copy_bytes(flat, page, len, lane, group);
  }
}

// One thread's share of the launch; the kernel and the host emulation both run it.
template <bool kScatter>
__host__ __device__ inline void thread_body(const RunsArgs& p, uint32_t cta, uint32_t thread, uint32_t ctas) {
  const uint32_t group = 1u << p.group_shift;
  const uint32_t groups_per_cta = kThreads >> p.group_shift;
  const int lane = static_cast<int>(thread & (group - 1));
  const uint64_t step = static_cast<uint64_t>(ctas) * groups_per_cta;
  for (uint64_t item = static_cast<uint64_t>(cta) * groups_per_cta + (thread >> p.group_shift);
       item < p.items; item += step) {
    copy_item<kScatter>(p, static_cast<uint32_t>(item), lane, static_cast<int>(group));
  }
}

template <bool kScatter>
__global__ void __launch_bounds__(kThreads) runs_kernel(RunsArgs p) {
  thread_body<kScatter>(p, blockIdx.x, threadIdx.x, gridDim.x);
}

struct Launch {
  RunsArgs args;
  uint32_t ctas;  // 0: nothing to copy
};

// Checks the scalars and sizes the launch; cudaErrorInvalidValue for negative
// extents, null pointers or more than kMaxItems items.
cudaError_t plan(const uint64_t* bases, int64_t num_layers, const int64_t* ids, int64_t n, int64_t num_blocks,
                 void* buf, int64_t block_stride, int64_t a_extent, int64_t stride_a, int64_t b_extent,
                 int64_t stride_b, int64_t run_bytes, Launch* out) {
  *out = Launch{};
  if (num_layers < 0 || n < 0 || num_blocks < 0 || a_extent < 0 || b_extent < 0 || run_bytes < 0) {
    return cudaErrorInvalidValue;
  }
  if (num_layers == 0 || n == 0 || a_extent == 0 || b_extent == 0 || run_bytes == 0) return cudaSuccess;
  if (bases == nullptr || ids == nullptr || buf == nullptr) return cudaErrorInvalidValue;
  const int64_t chunk_bytes = run_bytes < kChunkBytes ? run_bytes : kChunkBytes;
  const int64_t chunks = (run_bytes + chunk_bytes - 1) / chunk_bytes;
  uint64_t items = static_cast<uint64_t>(chunks);
  for (const int64_t factor : {b_extent, a_extent, n, num_layers}) {
    if (items > kMaxItems / static_cast<uint64_t>(factor)) return cudaErrorInvalidValue;
    items *= static_cast<uint64_t>(factor);
  }
  uint32_t shift = 0;  // threads per item: ceil(chunk / 16) rounded up to a power of two, at most a warp
  while (shift < kMaxGroupShift && (int64_t{16} << shift) < chunk_bytes) ++shift;
  const uint64_t groups_per_cta = static_cast<uint64_t>(kThreads >> shift);
  const uint64_t ctas = (items + groups_per_cta - 1) / groups_per_cta;

  RunsArgs& p = out->args;
  p.bases = bases;
  p.ids = ids;
  p.buf = static_cast<char*>(buf);
  p.num_blocks = num_blocks;
  p.block_stride = block_stride;
  p.stride_a = stride_a;
  p.stride_b = stride_b;
  p.run_bytes = run_bytes;
  p.chunk_bytes = chunk_bytes;
  p.chunks = make_divider(static_cast<uint32_t>(chunks));
  p.b_extent = make_divider(static_cast<uint32_t>(b_extent));
  p.a_extent = make_divider(static_cast<uint32_t>(a_extent));
  p.n = make_divider(static_cast<uint32_t>(n));
  p.items = static_cast<uint32_t>(items);
  p.group_shift = shift;
  out->ctas = static_cast<uint32_t>(ctas < kMaxCtas ? ctas : kMaxCtas);
  return cudaSuccess;
}

// This library's runtime keeps its own current device (per thread), apart
// from torch's: set it to the tensors' device, or the launch would go to
// device 0's context.
cudaError_t use_device(int device) {
  int current = -1;
  const cudaError_t rc = cudaGetDevice(&current);
  if (rc != cudaSuccess) return rc;
  return current == device ? cudaSuccess : cudaSetDevice(device);
}

template <bool kScatter>
int launch_runs(const uint64_t* bases, int64_t num_layers, const int64_t* ids, int64_t n, int64_t num_blocks,
                void* buf, int64_t block_stride, int64_t a_extent, int64_t stride_a, int64_t b_extent,
                int64_t stride_b, int64_t run_bytes, int device, void* stream) {
  Launch launch;
  cudaError_t rc = plan(bases, num_layers, ids, n, num_blocks, buf, block_stride, a_extent, stride_a, b_extent,
                        stride_b, run_bytes, &launch);
  if (rc != cudaSuccess || launch.ctas == 0) return rc;
  rc = use_device(device);
  if (rc != cudaSuccess) return rc;
  runs_kernel<kScatter><<<launch.ctas, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(launch.args);
  return cudaGetLastError();  // a launch error; the copy's own errors come at the next sync
}

}  // namespace

ASV_EXPORT int asv_cuda_abi_version(void) { return kAbiVersion; }

// The number of CUDA devices, or -(cudaError_t) when there is none to count
// (no driver: cudaErrorInsufficientDriver; no GPU: cudaErrorNoDevice).
ASV_EXPORT int asv_cuda_device_count(void) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  return rc == cudaSuccess ? count : -static_cast<int>(rc);
}

ASV_EXPORT const char* asv_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

ASV_EXPORT int asv_cuda_gather_runs(const uint64_t* bases_dev, int64_t num_layers, const int64_t* ids_dev, int64_t n,
                                    int64_t num_blocks, void* buf, int64_t block_stride, int64_t a_extent,
                                    int64_t stride_a, int64_t b_extent, int64_t stride_b, int64_t run_bytes,
                                    int device, void* stream) {
  return launch_runs<false>(bases_dev, num_layers, ids_dev, n, num_blocks, buf, block_stride, a_extent, stride_a,
                            b_extent, stride_b, run_bytes, device, stream);
}

ASV_EXPORT int asv_cuda_scatter_runs(const uint64_t* bases_dev, int64_t num_layers, const int64_t* ids_dev, int64_t n,
                                     int64_t num_blocks, void* buf, int64_t block_stride, int64_t a_extent,
                                     int64_t stride_a, int64_t b_extent, int64_t stride_b, int64_t run_bytes,
                                     int device, void* stream) {
  return launch_runs<true>(bases_dev, num_layers, ids_dev, n, num_blocks, buf, block_stride, a_extent, stride_a,
                           b_extent, stride_b, run_bytes, device, stream);
}

// For tests on hosts without a GPU: the same launch plan and per-thread code
// as the kernels, run on the CPU thread by thread (CTA by CTA) over host
// memory. Slow; small copies only. scatter: 0 = gather, else scatter.
ASV_EXPORT int asv_cuda_emulate_runs(int scatter, const uint64_t* bases, int64_t num_layers, const int64_t* ids,
                                     int64_t n, int64_t num_blocks, void* buf, int64_t block_stride, int64_t a_extent,
                                     int64_t stride_a, int64_t b_extent, int64_t stride_b, int64_t run_bytes) {
  Launch launch;
  const cudaError_t rc = plan(bases, num_layers, ids, n, num_blocks, buf, block_stride, a_extent, stride_a,
                              b_extent, stride_b, run_bytes, &launch);
  if (rc != cudaSuccess) return rc;
  for (uint32_t cta = 0; cta < launch.ctas; ++cta) {
    for (uint32_t thread = 0; thread < static_cast<uint32_t>(kThreads); ++thread) {
      if (scatter) {
        thread_body<true>(launch.args, cta, thread, launch.ctas);
      } else {
        thread_body<false>(launch.args, cta, thread, launch.ctas);
      }
    }
  }
  return cudaSuccess;
}
