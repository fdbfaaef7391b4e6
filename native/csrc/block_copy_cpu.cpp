// CPU kernels of gather_blocks / scatter_blocks (schemas and semantics: ops.cpp).
//
// One memcpy per (layer, block). Large copies are split over a few
// std::threads; never OpenMP or at::parallel_for: the callers are transfer
// threads inside vLLM worker processes whose cores vLLM's own OpenMP team
// busy-polls, and a torch OpenMP team started there took 3.5 s for one block.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

namespace ascendserve {
namespace {

// Each thread beyond the first needs this many bytes of work: below ~16 MiB
// one thread won (cache-resident copies, thread start ~50 us on a shared VM);
// measured with bench/native_ops.py (its second table).
constexpr int64_t kParallelMinBytes = int64_t{8} << 20;
constexpr int64_t kDefaultMaxThreads = 4;
constexpr int64_t kMaxThreads = 64;

struct Pages {
  std::vector<char*> base;     // address of block 0 of each layer
  std::vector<int64_t> stride; // bytes between blocks of each layer
  int64_t page_bytes = 0;
  int64_t num_blocks = 0;
};

Pages check_layers(at::TensorList layers, const char* op) {
  TORCH_CHECK(!layers.empty(), op, ": no layers given");
  Pages p;
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor& t = layers[l];
    TORCH_CHECK(t.defined(), op, ": layer ", l, " is an undefined tensor");
    TORCH_CHECK(t.device().is_cpu(), op, ": layer ", l, " is on ", t.device(), ", this kernel is CPU only");
    TORCH_CHECK(t.dim() >= 1, op, ": layer ", l, " has no block dimension (0-d tensor)");
    // the page (dims 1..) must be one contiguous run of bytes
    int64_t expected = 1;
    for (int64_t d = t.dim() - 1; d >= 1; --d) {
      TORCH_CHECK(t.size(d) == 1 || t.stride(d) == expected, op, ": layer ", l,
                  " pages are not contiguous (sizes ", t.sizes(), ", strides ", t.strides(), ")");
      expected *= t.size(d);
    }
    const int64_t item = static_cast<int64_t>(t.element_size());
    const int64_t page_bytes = expected * item;
    if (l == 0) {
      p.page_bytes = page_bytes;
      p.num_blocks = t.size(0);
    }
    TORCH_CHECK(page_bytes == p.page_bytes, op, ": layer ", l, " has ", page_bytes,
                " bytes per page, layer 0 has ", p.page_bytes);
    TORCH_CHECK(t.size(0) == p.num_blocks, op, ": layer ", l, " has ", t.size(0),
                " blocks, layer 0 has ", p.num_blocks);
    p.base.push_back(static_cast<char*>(t.data_ptr()));
    p.stride.push_back(t.stride(0) * item);
  }
  return p;
}

template <typename T>
void read_ids(const at::Tensor& ids, int64_t num_blocks, std::vector<int64_t>& out, const char* op) {
  const T* data = ids.const_data_ptr<T>();
  const int64_t stride = ids.stride(0);
  for (int64_t i = 0; i < ids.size(0); ++i) {
    const int64_t b = static_cast<int64_t>(data[i * stride]);
    TORCH_CHECK(b >= 0 && b < num_blocks, op, ": block id ", b, " (at index ", i,
                ") out of range 0..", num_blocks - 1);
    out[i] = b;
  }
}

std::vector<int64_t> check_ids(const at::Tensor& ids, int64_t num_blocks, const char* op) {
  TORCH_CHECK(ids.defined(), op, ": block_ids is an undefined tensor");
  TORCH_CHECK(ids.device().is_cpu(), op, ": block_ids must be on the CPU, got ", ids.device());
  TORCH_CHECK(ids.dim() == 1, op, ": block_ids must be 1-D, got ", ids.dim(), "-D");
  std::vector<int64_t> out(static_cast<size_t>(ids.size(0)));
  switch (ids.scalar_type()) {
    case at::kLong: read_ids<int64_t>(ids, num_blocks, out, op); break;
    case at::kInt: read_ids<int32_t>(ids, num_blocks, out, op); break;
    default: TORCH_CHECK(false, op, ": block_ids must be int64 or int32, got ", ids.scalar_type());
  }
  return out;
}

char* check_buffer(const at::Tensor& buf, int64_t nbytes, const char* op, const char* name) {
  TORCH_CHECK(buf.defined(), op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(buf.device().is_cpu(), op, ": ", name, " is on ", buf.device(), ", this kernel is CPU only");
  TORCH_CHECK(buf.is_contiguous(), op, ": ", name, " must be contiguous");
  const int64_t got = buf.numel() * static_cast<int64_t>(buf.element_size());
  TORCH_CHECK(got == nbytes, op, ": ", name, " holds ", got, " bytes, layers x ids x page bytes = ", nbytes);
  return static_cast<char*>(buf.data_ptr());
}

// num_threads > 0: that many (at most one per page); 0: auto, min(4, cores) and one per 8 MiB.
int64_t pick_threads(int64_t requested, int64_t items, int64_t nbytes, const char* op) {
  TORCH_CHECK(requested >= 0, op, ": num_threads must be >= 0, got ", requested);
  TORCH_CHECK(requested <= kMaxThreads, op, ": num_threads must be <= ", kMaxThreads, ", got ", requested);
  if (requested > 0) {
    return std::max<int64_t>(1, std::min(requested, items));
  }
  // hardware_concurrency() reads /sys each time (~7 us): once per process
  static const int64_t cores = static_cast<int64_t>(std::thread::hardware_concurrency());
  return std::max<int64_t>(1, std::min({kDefaultMaxThreads, cores, items, nbytes / kParallelMinBytes}));
}

// Whether two items would write the same page: a repeated id, or two layers on one buffer.
bool writes_overlap(const Pages& p, std::vector<int64_t> ids) {
  std::sort(ids.begin(), ids.end());
  std::vector<char*> base = p.base;
  std::sort(base.begin(), base.end());
  return std::adjacent_find(ids.begin(), ids.end()) != ids.end() ||
         std::adjacent_find(base.begin(), base.end()) != base.end();
}

// Item k = l * n + i is page ids[i] of layer l <-> row k of the flat buffer.
template <bool kGather>
void copy_range(const Pages& p, const std::vector<int64_t>& ids, char* flat, int64_t begin, int64_t end) {
  const int64_t n = static_cast<int64_t>(ids.size());
  const size_t bytes = static_cast<size_t>(p.page_bytes);
  for (int64_t k = begin; k < end; ++k) {
    char* page = p.base[k / n] + ids[k % n] * p.stride[k / n];
    char* row = flat + k * p.page_bytes;
    if (kGather) {
      std::memcpy(row, page, bytes);
    } else {
      std::memcpy(page, row, bytes);
    }
  }
}

template <bool kGather>
void copy_pages(const Pages& p, const std::vector<int64_t>& ids, char* flat, int64_t threads) {
  const int64_t items = static_cast<int64_t>(p.base.size() * ids.size());
  if (threads <= 1) {
    copy_range<kGather>(p, ids, flat, 0, items);
    return;
  }
  const int64_t chunk = (items + threads - 1) / threads;
  std::vector<std::thread> pool;
  int64_t begin = chunk;  // the calling thread takes [0, chunk) last
  try {
    for (; begin < items; begin += chunk) {
      const int64_t end = std::min(items, begin + chunk);
      pool.emplace_back([&p, &ids, flat, begin, end] { copy_range<kGather>(p, ids, flat, begin, end); });
    }
  } catch (const std::system_error&) {
    copy_range<kGather>(p, ids, flat, begin, items);  // no more threads: do the rest here
  }
  copy_range<kGather>(p, ids, flat, 0, std::min(items, chunk));
  for (auto& t : pool) t.join();
}

void gather_blocks_cpu(at::TensorList layers, const at::Tensor& block_ids, const at::Tensor& out,
                       int64_t num_threads) {
  constexpr const char* op = "ascendserve::gather_blocks";
  const Pages p = check_layers(layers, op);
  const std::vector<int64_t> ids = check_ids(block_ids, p.num_blocks, op);
  const int64_t items = static_cast<int64_t>(layers.size() * ids.size());
  char* flat = check_buffer(out, items * p.page_bytes, op, "out");
  copy_pages<true>(p, ids, flat, pick_threads(num_threads, items, items * p.page_bytes, op));
}

void scatter_blocks_cpu(at::TensorList layers, const at::Tensor& block_ids, const at::Tensor& src,
                        int64_t num_threads) {
  constexpr const char* op = "ascendserve::scatter_blocks";
  const Pages p = check_layers(layers, op);
  const std::vector<int64_t> ids = check_ids(block_ids, p.num_blocks, op);
  const int64_t items = static_cast<int64_t>(layers.size() * ids.size());
  char* flat = check_buffer(src, items * p.page_bytes, op, "src");
  int64_t threads = pick_threads(num_threads, items, items * p.page_bytes, op);
  if (threads > 1 && writes_overlap(p, ids)) {
    threads = 1;  // keep "the last write wins": one thread writes each layer's pages in order
  }
  copy_pages<false>(p, ids, flat, threads);
}

}  // namespace

TORCH_LIBRARY_IMPL(ascendserve, CPU, m) {
  m.impl("gather_blocks", &gather_blocks_cpu);
  m.impl("scatter_blocks", &scatter_blocks_cpu);
}

}  // namespace ascendserve
