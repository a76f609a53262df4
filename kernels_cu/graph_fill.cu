// A captured graph's small memset nodes, re-issued as kernel nodes (cukernels/graph.py,
// ck.settings.graph_memset_nodes).
//
// Semantics: those of a memset node (CUDA_MEMSET_NODE_PARAMS): `height` rows of `width` elements, each row
// `pitch` bytes after the previous one, every element set to the low `elsize` bytes of `value` (elsize 1, 2
// or 4). The host turns 1- and 2-byte fills whose rows, pitch and address are 4-byte aligned into 4-byte
// fills of the replicated value before it gets here, so the common case stores 32-bit words.
//
// Why a kernel: cuBLAS issues a small workspace memset before most of its GEMMs (168 in a LLaMA-3.2-1B
// B8xT1024 step, 0.74 us each). In the replayed graph each one sat between two gaps (session 15's timeline:
// ~1.4 us before it, ~2.8 us after it before the GEMM, against ~0.4 us between two kernel nodes), ~5 us a
// memset and ~0.8 ms a step. A kernel node of the same few bytes runs in the graph's kernel stream like its
// neighbours. Only fills up to graph.MEMSET_KERNEL_MAX_BYTES become kernels: a large memset (a gradient
// buffer zeroed by cudaMemsetAsync) stays a memset node, where the driver's own fill is at copy speed.
//
// One thread an element, grid-stride (the fills converted are at most a few hundred KB).
#include "common/entry.cuh"

CK_ENTRY(__launch_bounds__(256), graph_fill)(unsigned char* dst, unsigned long long pitch,
                                             unsigned int value, unsigned int elsize,
                                             unsigned long long width,
                                             unsigned long long height) {
  const unsigned long long n = width * height;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const unsigned long long r = i / width, c = i - r * width;
    unsigned char* p = dst + r * pitch + c * elsize;
    if (elsize == 4) *reinterpret_cast<unsigned int*>(p) = value;
    else if (elsize == 2) *reinterpret_cast<unsigned short*>(p) = (unsigned short)value;
    else *p = (unsigned char)value;
  }
}
