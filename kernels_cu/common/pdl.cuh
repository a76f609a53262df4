// Programmatic dependent launch (PDL, sm_90+). A kernel launched with the PDL attribute (ops/_launch.py:
// launch(..., pdl=True)) may start while the kernel before it in the stream is still running; in a captured
// graph the edge between the two becomes a programmatic one. The rules for such a kernel:
//   * pdl_wait() before it reads anything an earlier kernel wrote, and before it writes anything an earlier
//     kernel may still read (out, residual, caches, workspaces): griddepcontrol.wait returns once every
//     prerequisite grid has completed and its memory is visible.
//   * Before pdl_wait() it may only read what no kernel of the step writes (weights, tables): those loads are
//     what overlaps the previous kernel's tail -- a decode GEMV's first weight chunk, ~1-2 us a launch. L2
//     prefetch hints (prefetch_l2 below) may touch anything in the allocations: they change no value read.
//   * pdl_trigger() lets the next PDL kernel be scheduled; called right after pdl_wait(), so at most one grid
//     waits ahead of the running one (its blocks take SM slots while they wait).
// Both are no-ops below sm_90, and pdl_wait() returns at once when the kernel was launched without the attribute
// (no prerequisite grid is pending then), so a kernel with them is correct under a plain launch too.
#pragma once

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A hint that the 128-byte line holding p be brought into L2 (no register holds the data, no fault semantics
// the kernel relies on: p must still point into an allocation). Before pdl_wait() it lets a kernel start its
// DRAM traffic while the previous kernel runs, also for data the previous kernel may be writing: L2 is where
// those writes land, and the reads after the wait see them.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

