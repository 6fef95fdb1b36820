/* The compiled CRC-32 of lynxkv.format.checksum (lynxkv/format/_crc.c), the binding's contract: _crc.c includes
 * it and setup.py hands the same declarations to cffi (see lynxkv/quant/_native.h). The call releases the GIL. */
#ifndef LYNXKV_CRC_H
#define LYNXKV_CRC_H
#include <stddef.h>
#include <stdint.h>

uint32_t lynx_crc32(const uint8_t *p, size_t n, uint32_t crc);
int32_t lynx_crc32_folds(void);

#endif
