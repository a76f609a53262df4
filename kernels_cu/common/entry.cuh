// Kernel entry points, declared so that the loader can compile one at a time.
//
// Every extern "C" kernel of every family is declared through CK_ENTRY(attributes, name):
//
//   CK_ENTRY(__launch_bounds__(256), adam_f32_v)(float* p, ...) { ... }
//
// A whole-family compile (no CK_ONE_ENTRY) reads that as
// `extern "C" __global__ void __launch_bounds__(256) adam_f32_v(float* p, ...) { ... }`: the PTX is byte-identical
// to writing it out by hand.
//
// cukernels/_loader.py compiles a single entry by putting ahead of the family's source
//
//   #define CK_ONE_ENTRY
//   #define CK_WANT_adam_f32_v ~, 1
//
// and every entry not wanted becomes a kernel template that is never instantiated: NVRTC generates no code for it
// and instantiates none of the templates its body calls. rms_norm (186 entries): the whole family takes 45 s to
// sm_90 cubin on one core of the CPU machine, one entry 0.2-0.5 s (benchmarks/NOTES.md, "Start-up").
//
// CK_LIST_ENTRIES: every entry also declares an empty kernel <name>__ck_entry, so a PTX compile that generates
// code for nothing else lists the family's entry points (names pasted by macros exist only after preprocessing)
// in a fraction of a second.
#pragma once

#define CK_CAT_(a, b) a##b
#define CK_CAT(a, b) CK_CAT_(a, b)
#if defined(CK_ONE_ENTRY) || defined(CK_LIST_ENTRIES)
// CK_WANTED(name) is 1 when CK_WANT_<name> is defined as `~, 1`, else 0 (the argument-count probe: an undefined
// CK_WANT_<name> stays one token, so the second argument is the 0 that follows it).
#define CK_SECOND_(a, b, ...) b
#define CK_SECOND(...) CK_SECOND_(__VA_ARGS__)
#define CK_WANTED(name) CK_SECOND(CK_WANT_##name, 0, ~)
// The wanted entries' siblings are declared but never defined as code: NVRTC reports them as unreferenced.
#pragma nv_diag_suppress 177
#else
#define CK_WANTED(name) 1
#endif
#define CK_ENTRY(attrs, name) CK_CAT(CK_ENTRY_, CK_WANTED(name))(attrs, name)
#define CK_ENTRY_1(attrs, name) extern "C" __global__ void attrs name
#ifdef CK_LIST_ENTRIES
#define CK_ENTRY_0(attrs, name) \
  extern "C" __global__ void name##__ck_entry() {} template <int CkNotWanted> __global__ void attrs name
#else
#define CK_ENTRY_0(attrs, name) template <int CkNotWanted> __global__ void attrs name
#endif
