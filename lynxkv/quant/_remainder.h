/* The compiled exact remainder of lynxkv.quant.remainder (lynxkv/quant/_remainder.c), the binding's contract:
 * _remainder.c includes it and setup.py hands the same declarations to cffi (see _native.h). The calls release
 * the GIL; both return 0, -1 for a width other than 2 and 4, or -2 when the scratch memory cannot be
 * allocated. */
#ifndef LYNXKV_REMAINDER_H
#define LYNXKV_REMAINDER_H
#include <stdint.h>

int64_t lynx_exact_planes(const void *original, const void *predicted, int64_t n, int32_t width, int32_t fp16,
                          uint8_t *planes, int64_t *counts);
int64_t lynx_exact_apply(const uint8_t *planes, const void *predicted, int64_t n, int32_t width, int32_t fp16,
                         void *original);

#endif
