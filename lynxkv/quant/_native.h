/* The compiled quantizer kernels of lynxkv.quant.fast (lynxkv/quant/_native.c). This header is the binding's
 * contract: _native.c includes it (a definition that disagrees with it does not compile), and setup.py hands the
 * same declarations to cffi, whose generated module calls them with these C types (wrong Python arguments raise
 * TypeError or OverflowError instead of reaching C). The calls release the GIL. lynxkv.quant.c_kernels documents
 * every argument. cffi's parser reads this file with its '#' lines removed: declarations only, no macros. */
#ifndef LYNXKV_NATIVE_H
#define LYNXKV_NATIVE_H
#include <stdint.h>

int64_t lynx_encode_units(const void *x, int32_t x_bf16, int64_t x0, int64_t sh, int64_t st, int64_t T, int64_t D,
                          int64_t C, int64_t nc, int32_t per_row, int64_t block, float rotation_scale, int64_t u0,
                          int64_t u1, int32_t meta_given, void *offset, void *scale, int32_t meta_f16, float alpha,
                          float inv_c, float gk, float gb, float margin, const float *P, const uint32_t *tab,
                          int64_t off, int32_t shift, int32_t rb, int32_t packed, uint8_t *a_out, uint8_t *r_out,
                          int64_t out_h, int64_t out_t);
int64_t lynx_decode_pages(const uint8_t *o_buf, const uint8_t *s_buf, const uint8_t *a_buf, const uint8_t *r_buf,
                          const int64_t *pages, int64_t npages, int32_t packed, int32_t anchor_only, int32_t rb,
                          int32_t wide, int32_t per_row, int64_t block, float back, int64_t H, int64_t C, int64_t u0,
                          int64_t u1, const float *levels, void *y, int32_t y_bf16, int64_t sh, int64_t st,
                          int64_t sd);
int64_t lynx_rotate_rows(const void *x, int32_t x_bf16, int64_t x0, int64_t sh, int64_t st, int64_t T, int64_t D,
                         int64_t block, float scale, float *y, int64_t r0, int64_t r1);
int64_t lynx_pack4_rows(const uint8_t *v, int64_t v0, int64_t sh, int64_t st, int64_t n, int64_t D, uint8_t *out,
                        int64_t r0, int64_t r1);
int64_t lynx_unpack4(const uint8_t *p, uint8_t *out, int64_t i0, int64_t i1);
void lynx_scalar_only(int32_t on);
int32_t lynx_vector_rows(void);

#endif
