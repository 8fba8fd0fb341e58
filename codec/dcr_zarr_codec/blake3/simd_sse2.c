/* BLAKE3's sse2 kernels (blake3_sse2.c, unchanged), compiled for that instruction set alone:
 * blake3_dispatch.c picks them at run time from the CPU's features, so the extension builds with
 * the compiler's default flags. Empty off x86. */
#if (defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)) && !defined(_M_ARM64EC)
#if defined(__clang__)
#pragma clang attribute push (__attribute__((target("sse2"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("sse2")
#endif
#include "blake3_sse2.c"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
