/* The wire format: little-endian, fixed-size headers. Both ends encode and decode explicitly, so the layout
 * never depends on the compiler or the host byte order. */
#ifndef PDPAIR_WIRE_H
#define PDPAIR_WIRE_H

#include <stdint.h>

/* Hello: sent by both ends right after the TCP connection forms, followed by region_count u64 sizes. */
#define WIRE_HELLO_SIZE 40
#define WIRE_MAGIC 0x52504450u /* "PDPR" read as little-endian */
#define WIRE_MAX_REGIONS (1u << 20)

/* Every later message is one 56-byte frame header, DATA frames followed by `length` payload bytes:
 *   0 u8 type | 1 u8 flags | 2 u16 0 | 4 u32 region (REJECT: status) | 8 u64 seq | 16 u64 offset (REJECT: reason)
 *   24 u64 length (REGION: size) | 32 u32 signal slot | 36 u32 CRC32C of the payload (DATA)
 *   40 u64 transfer id (DATA; 0 = untagged) | 48 u32 transfer generation (DATA) | 52 u32 0
 * Protocol 3 added the checksum and the transfer tag (40-byte frames before). */
#define WIRE_FRAME_SIZE 56

enum wire_type {
    WIRE_DATA = 1,   /* put / put_signal / signal; seq = request id, consecutive from 1 */
    WIRE_ACK = 2,    /* cumulative: every DATA frame with id <= seq is placed (or rejected) */
    WIRE_REJECT = 3, /* the DATA frame `seq` was refused (offset: why, enum wire_reject); before the ACK covering it */
    WIRE_REGION = 4  /* the sender registered region `region` of `length` bytes */
};

enum wire_flags {
    WIRE_FLAG_SIGNAL = 1, /* add 1 to `slot` after the payload is in place */
    WIRE_FLAG_NODATA = 2  /* no payload, no region: a bare signal (or a no-op when the signal was fault-dropped) */
};

/* Why a DATA frame was refused (REJECT's offset field; the sender only names it in its error text). The same numbers
 * as pdpair_refusal (transport.h), which reports them per slot on the receiving side. */
enum wire_reject {
    WIRE_REJECT_BOUNDS = 1,   /* outside the receiver's regions or signal slots */
    WIRE_REJECT_TRANSFER = 2, /* expectation mode: no outstanding transfer with that id and generation */
    WIRE_REJECT_WINDOW = 3,   /* expectation mode: outside the transfer's windows (or not where one goes on: a
                                 window is written once, front to back), or another signal slot */
    WIRE_REJECT_CHECKSUM = 4, /* the payload's CRC32C differs from the one sent */
    WIRE_REJECT_INCOMPLETE = 5 /* expectation mode: the transfer's last signal came before all of its bytes */
};

struct wire_frame {
    uint8_t type, flags;
    uint32_t region, slot, crc, generation;
    uint64_t seq, offset, length, transfer;
};

static inline void wire_put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void wire_put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t wire_get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static inline uint64_t wire_get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static inline void wire_encode(uint8_t *p, const struct wire_frame *f)
{
    p[0] = f->type;
    p[1] = f->flags;
    p[2] = p[3] = 0;
    wire_put_u32(p + 4, f->region);
    wire_put_u64(p + 8, f->seq);
    wire_put_u64(p + 16, f->offset);
    wire_put_u64(p + 24, f->length);
    wire_put_u32(p + 32, f->slot);
    wire_put_u32(p + 36, f->crc);
    wire_put_u64(p + 40, f->transfer);
    wire_put_u32(p + 48, f->generation);
    wire_put_u32(p + 52, 0);
}

static inline void wire_decode(const uint8_t *p, struct wire_frame *f)
{
    f->type = p[0];
    f->flags = p[1];
    f->region = wire_get_u32(p + 4);
    f->seq = wire_get_u64(p + 8);
    f->offset = wire_get_u64(p + 16);
    f->length = wire_get_u64(p + 24);
    f->slot = wire_get_u32(p + 32);
    f->crc = wire_get_u32(p + 36);
    f->transfer = wire_get_u64(p + 40);
    f->generation = wire_get_u32(p + 48);
}

#endif
