/* CRC32C (Castagnoli, the iSCSI/ext4 polynomial 0x1EDC6F41, reflected 0x82F63B78): the checksum every put carries.
 * x86-64 with SSE4.2 uses the crc32 instruction (checked at run time with cpuid, so one binary runs everywhere) on
 * three independent streams at once: one stream is bound by the instruction's 3-cycle latency (about 8 GB/s here),
 * three keep its unit busy every cycle (about 3x that), and the three results are combined with a precomputed
 * "append N zero bytes" operator. AArch64 built with the CRC extension uses its instructions (one stream); anything
 * else a slicing-by-8 table (about 1.5 GB/s). Every path gives the same value for every input; the C tests compare
 * them on random buffers long enough for each block size. */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#include "internal.h"

#define POLY 0x82F63B78u

static uint32_t table[8][256];

/* Built once, before any thread can checksum (pthread_once), so the table is never read half-written. */
static void build_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
}

static pthread_once_t table_once = PTHREAD_ONCE_INIT;

/* crc is the running value without the final inversion (start with 0 via pdpi_crc32c). */
static uint32_t sw_update(uint32_t crc, const uint8_t *p, size_t len)
{
    while (len && ((uintptr_t)p & 7)) {
        crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
        len--;
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8); /* aligned here, but memcpy keeps the load defined everywhere */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
        v = __builtin_bswap64(v);
#endif
        v ^= crc;
        crc = table[7][v & 0xff] ^ table[6][(v >> 8) & 0xff] ^ table[5][(v >> 16) & 0xff] ^
              table[4][(v >> 24) & 0xff] ^ table[3][(v >> 32) & 0xff] ^ table[2][(v >> 40) & 0xff] ^
              table[1][(v >> 48) & 0xff] ^ table[0][v >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
    return crc;
}

uint32_t pdpi_crc32c_sw(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&table_once, build_table);
    return ~sw_update(~crc, buf, len);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>

/* Block sizes of the three streams: LONG_BLOCK for large buffers, SHORT_BLOCK for the rest (a 256-byte stream still
 * gains, and below 3 x 256 bytes one stream is as fast). */
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256

/* zeros_long[k][b]: the CRC register b << 8k after LONG_BLOCK zero bytes (the operator is linear, so four byte tables
 * apply it to any register); the same for SHORT_BLOCK. */
static uint32_t zeros_long[4][256], zeros_short[4][256];

static void build_zeros(uint32_t tab[4][256], size_t n)
{
    uint32_t basis[32];
    for (int i = 0; i < 32; i++) {
        uint32_t c = 1u << i;
        for (size_t k = 0; k < n; k++) c = (c >> 8) ^ table[0][c & 0xff];
        basis[i] = c;
    }
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (int i = 0; i < 8; i++)
                if (b & (1u << i)) v ^= basis[8 * k + i];
            tab[k][b] = v;
        }
}

static uint32_t shift(uint32_t tab[4][256], uint32_t c)
{
    return tab[0][c & 0xff] ^ tab[1][(c >> 8) & 0xff] ^ tab[2][(c >> 16) & 0xff] ^ tab[3][c >> 24];
}

static inline uint64_t load64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Three streams over consecutive thirds of each 3 x block bytes; crc(A B C) = shift(shift(crc(A)) ^ crc0(B)) ^ crc0(C),
 * where crc0 starts from 0 (the register without the final inversion is linear). */
__attribute__((target("sse4.2"))) static const uint8_t *three_streams(uint64_t *c, const uint8_t *p, size_t *len,
                                                                      size_t block, uint32_t tab[4][256])
{
    while (*len >= 3 * block) {
        uint64_t c0 = *c, c1 = 0, c2 = 0;
        for (const uint8_t *end = p + block; p < end; p += 8) {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + block));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * block));
        }
        c0 = shift(tab, (uint32_t)c0) ^ (uint32_t)c1;
        *c = shift(tab, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * block;
        *len -= 3 * block;
    }
    return p;
}

__attribute__((target("sse4.2"))) static uint32_t hw_update(uint32_t crc, const uint8_t *p, size_t len)
{
    uint64_t c = crc;
    while (len && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    p = three_streams(&c, p, &len, LONG_BLOCK, zeros_long);
    p = three_streams(&c, p, &len, SHORT_BLOCK, zeros_short);
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        len -= 8;
    }
    while (len--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}

static int hw_available(void)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2")) return 0;
    pthread_once(&table_once, build_table);
    build_zeros(zeros_long, LONG_BLOCK);
    build_zeros(zeros_short, SHORT_BLOCK);
    return 1;
}
#define HAVE_HW 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>

static uint32_t hw_update(uint32_t crc, const uint8_t *p, size_t len)
{
    while (len && ((uintptr_t)p & 7)) {
        crc = __crc32cb(crc, *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        crc = __crc32cd(crc, v);
        p += 8;
        len -= 8;
    }
    while (len--) crc = __crc32cb(crc, *p++);
    return crc;
}

static int hw_available(void) { return 1; } /* compiled for a CPU that has it */
#define HAVE_HW 1
#else
#define HAVE_HW 0
#endif

/* 1: hardware, 0: table; decided once (pthread_once orders it before every reader). */
static int use_hw = -1;
static pthread_once_t pick_once = PTHREAD_ONCE_INIT;

static void pick(void)
{
#if HAVE_HW
    use_hw = hw_available() ? 1 : 0;
#else
    use_hw = 0;
#endif
    if (!use_hw) pthread_once(&table_once, build_table);
}

bool pdpi_crc32c_hardware(void)
{
    pthread_once(&pick_once, pick);
    return use_hw == 1;
}

uint32_t pdpi_crc32c(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&pick_once, pick);
#if HAVE_HW
    if (use_hw) return ~hw_update(~crc, buf, len);
#endif
    return ~sw_update(~crc, buf, len);
}
