/* BLAKE3's NEON kernels (blake3_neon.c, unchanged) on little-endian AArch64, where blake3_impl.h
 * turns them on; empty elsewhere. */
#if (defined(__aarch64__) || defined(_M_ARM64)) && !defined(__ARM_BIG_ENDIAN)
#include "blake3_neon.c"
#endif
