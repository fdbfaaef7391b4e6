// The schemas of the `ascendserve` torch ops; one shared library,
// libascendserve_ops.so, loaded by ascendserve/ops.py with
// torch.ops.load_library.
//
// csrc/ layout: this file declares every op once (TORCH_LIBRARY); each
// backend registers its kernels in its own file (TORCH_LIBRARY_IMPL):
//   block_copy_cpu.cpp    CPU, always built
//   block_copy_npu.cpp    Ascend (PrivateUse1), built with -DASCENDSERVE_DEVICE_KERNELS=ON
//                         when CANN is found            -- not written yet
//   block_copy_cuda.cu    CUDA, same option, nvcc + CUDA torch  -- not written yet
// Device tensors meanwhile use the torch reference in ascendserve/ops.py.
//
// Semantics shared by every backend (the tests pin them):
//   gather_blocks:  out  viewed as [L, n, page_bytes]: out[l, i] = layers[l][block_ids[i]]
//   scatter_blocks: src  viewed as [L, n, page_bytes]: layers[l][block_ids[i]] = src[l, i],
//                   in order, so with repeated ids the last one wins.
// Pages are bytes (any dtype); dim 0 of a layer is the block, a block's page
// is contiguous; all layers share page bytes and block count. Everything is
// checked before the first byte moves. num_threads: 0 = auto, min(4, cores)
// threads but at most one per 8 MiB (a copy under 16 MiB runs on the calling
// thread alone); n > 0 = n threads (at most one per page, n <= 64).

#include <torch/library.h>

TORCH_LIBRARY(ascendserve, m) {
  m.def("gather_blocks(Tensor[] layers, Tensor block_ids, Tensor(a!) out, int num_threads=0) -> ()");
  m.def("scatter_blocks(Tensor(a!)[] layers, Tensor block_ids, Tensor src, int num_threads=0) -> ()");
}
