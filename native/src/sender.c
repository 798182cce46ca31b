/* The sender thread: the only writer of a connection's socket (rejects, acks, region announcements, requests). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "core.h"
#include "wire.h"

#define SEND_BATCH_FRAMES 64              /* frames per sendmsg */
#define SEND_BATCH_BYTES (4u << 20)       /* payload bytes per sendmsg, so acks are not starved */

static pdpair_status send_iov(pdpair_conn *c, struct iovec *iov, int niov, int *err)
{
    while (niov > 0) {
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
        ssize_t n = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return pdpi_net_errno_status(errno);
        }
        size_t left = (size_t)n;
        while (niov > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            niov--;
        }
        if (niov > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return PDPAIR_OK;
}

void *pdpi_sender_main(void *arg)
{
    pdpair_conn *c = arg;
    uint8_t headers[SEND_BATCH_FRAMES][WIRE_FRAME_SIZE];
    /* a frame is a header and at most 3 payload pieces (TEST ONLY corruption: before, the flipped byte, after) */
    struct iovec iov[4 * SEND_BATCH_FRAMES];
    uint8_t flipped[SEND_BATCH_FRAMES]; /* here, not in the queue: a post may move the queue during sendmsg */
    pdpair_context *ctx = c->ctx;

    pthread_mutex_lock(&c->mu);
    while (c->state == PDPAIR_OK) {
        int nf = 0, niov = 0;
        uint64_t payload = 0, signals = 0;
        struct wire_frame f;
        /* rejects go before the ack that covers them */
        size_t nrej = 0;
        while (nrej < c->n_rejects_out && nf < SEND_BATCH_FRAMES) {
            f = (struct wire_frame){.type = WIRE_REJECT, .region = PDPAIR_REMOTE_REJECTED,
                                    .seq = c->rejects_out[nrej].seq, .offset = c->rejects_out[nrej].reason};
            nrej++;
            wire_encode(headers[nf], &f);
            iov[niov++] = (struct iovec){headers[nf++], WIRE_FRAME_SIZE};
        }
        if (nrej) {
            memmove(c->rejects_out, c->rejects_out + nrej, (c->n_rejects_out - nrej) * sizeof *c->rejects_out);
            c->n_rejects_out -= nrej;
        }
        if (c->n_rejects_out == 0 && c->ack_to_send > c->ack_sent && nf < SEND_BATCH_FRAMES) {
            f = (struct wire_frame){.type = WIRE_ACK, .seq = c->ack_to_send};
            c->ack_sent = c->ack_to_send;
            wire_encode(headers[nf], &f);
            iov[niov++] = (struct iovec){headers[nf++], WIRE_FRAME_SIZE};
        }
        uint32_t nreg = atomic_load_explicit(&ctx->region_count, memory_order_acquire);
        while (c->regions_announced < nreg && nf < SEND_BATCH_FRAMES) {
            uint32_t i = c->regions_announced++;
            f = (struct wire_frame){.type = WIRE_REGION, .region = i, .length = ctx->regions[i].size};
            wire_encode(headers[nf], &f);
            iov[niov++] = (struct iovec){headers[nf++], WIRE_FRAME_SIZE};
        }
        while (c->q_len > 0 && !c->fault_hold_sends && c->sent_seq - c->acked_seq < c->slots &&
               nf < SEND_BATCH_FRAMES && payload < SEND_BATCH_BYTES) {
            struct op *o = &c->queue[c->q_head];
            c->q_head = (c->q_head + 1) % c->q_cap;
            c->q_len--;
            c->sent_seq = o->seq;
            f = (struct wire_frame){.type = WIRE_DATA, .flags = o->flags, .region = o->remote_region,
                                    .slot = o->slot, .seq = o->seq, .offset = o->remote_offset,
                                    .length = o->length, .crc = o->crc, .transfer = o->transfer,
                                    .generation = o->generation};
            wire_encode(headers[nf], &f);
            iov[niov++] = (struct iovec){headers[nf], WIRE_FRAME_SIZE};
            if (o->length && o->corrupt) { /* TEST ONLY: the checksum was taken from the true bytes */
                uint64_t k = o->length / 2;
                flipped[nf] = (uint8_t)(o->src[k] ^ 0x01);
                if (k) iov[niov++] = (struct iovec){(void *)o->src, k};
                iov[niov++] = (struct iovec){&flipped[nf], 1};
                if (o->length - k - 1) iov[niov++] = (struct iovec){(void *)(o->src + k + 1), o->length - k - 1};
            } else if (o->length) {
                iov[niov++] = (struct iovec){(void *)o->src, o->length};
            }
            nf++;
            payload += o->length;
            signals += (o->flags & WIRE_FLAG_SIGNAL) != 0;
        }
        if (nf == 0) {
            pthread_cond_wait(&c->send_cv, &c->mu);
            continue;
        }
        /* Counted when committed to the socket, so they are current before any ack of these frames. */
        c->stats.bytes_sent += payload;
        c->stats.signals_sent += signals;
        pthread_mutex_unlock(&c->mu);
        int err = 0;
        pdpair_status st = send_iov(c, iov, niov, &err);
        pthread_mutex_lock(&c->mu);
        if (st != PDPAIR_OK) {
            pdpi_conn_break_locked(c, st, "send failed: %s", strerror(err));
            break;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}
