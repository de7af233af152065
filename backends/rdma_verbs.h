/* The libibverbs calls rdma: needs, as plain C the Cython side calls without the GIL.
 *
 * pyverbs wraps the same calls, but every pyverbs call takes the GIL and its objects
 * do not expose their C pointers to other extensions (no .pxd is installed), so the
 * data path could not use it from the backend contract's nogil slots.
 *
 * One reliable-connected QP per attachment. A transfer is split into chunks, up to
 * `depth` of them in flight; a completion error or a missed deadline ends the QP's
 * life (cxv_xfer's caller marks it broken and never polls it again): a completion
 * that arrives after the deadline can then not be taken for a later request's. */
#ifndef CXL_RDMA_VERBS_H
#define CXL_RDMA_VERBS_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <infiniband/verbs.h>

typedef struct {
    struct ibv_context* ctx;
    struct ibv_pd* pd;
    uint8_t port;
    int gid_index;
    union ibv_gid gid;
    enum ibv_mtu mtu;
    int rd_atom;    /* READs a QP of ours serves in flight (responder; at most 16) */
    int init_rd_atom; /* READs a QP of ours issues in flight (requester; at most 16) */
} cxv_dev;

typedef struct {
    struct ibv_cq* cq;
    struct ibv_qp* qp;
    uint32_t psn;
    int depth;
} cxv_qp;

static uint64_t cxv_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cxv_gid_is_zero(const union ibv_gid* g) {
    static const uint8_t zero[16];
    return memcmp(g->raw, zero, 16) == 0;
}

static int cxv_gid_is_v4(const union ibv_gid* g) {
    static const uint8_t pre[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return memcmp(g->raw, pre, 12) == 0;
}

/* Open device `name` (NULL or "": the first one) on `port`. gid_index < 0 picks the
 * first IPv4-mapped GID (RoCE v2 over an IPv4 address), else the first non-zero one. */
static int cxv_open(cxv_dev* d, const char* name, int port, int gid_index, char* err,
                    size_t errlen) {
    struct ibv_device** list;
    struct ibv_port_attr pa;
    int n = 0, i, pick = -1;
    memset(d, 0, sizeof(*d));
    list = ibv_get_device_list(&n);
    if (list == NULL || n == 0) {
        snprintf(err, errlen, "no RDMA device on this host (ibv_get_device_list: %s); "
                 "for SoftRoCE: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0",
                 list == NULL ? strerror(errno) : "none");
        if (list) ibv_free_device_list(list);
        return -1;
    }
    for (i = 0; i < n; i++)
        if (name == NULL || name[0] == 0 || strcmp(ibv_get_device_name(list[i]), name) == 0) {
            pick = i;
            break;
        }
    if (pick < 0) {
        snprintf(err, errlen, "no RDMA device named %s (this host has %s%s)", name,
                 ibv_get_device_name(list[0]), n > 1 ? " and others" : "");
        ibv_free_device_list(list);
        return -1;
    }
    d->ctx = ibv_open_device(list[pick]);
    ibv_free_device_list(list);
    if (d->ctx == NULL) {
        snprintf(err, errlen, "ibv_open_device: %s", strerror(errno));
        return -1;
    }
    d->port = (uint8_t)port;
    if (ibv_query_port(d->ctx, d->port, &pa) != 0) {
        snprintf(err, errlen, "ibv_query_port(%d): %s", port, strerror(errno));
        goto fail;
    }
    if (pa.state != IBV_PORT_ACTIVE) {
        snprintf(err, errlen, "RDMA port %d is not active (state %d)", port, (int)pa.state);
        goto fail;
    }
    d->mtu = pa.active_mtu;
    if (gid_index < 0) {
        int first = -1;
        /* An IPv4-mapped GID of RoCE v2 (routable UDP), not its v1 twin that some
         * devices list first for the same address. */
        for (i = 0; i < pa.gid_tbl_len && i < 64; i++) {
            union ibv_gid g;
            struct ibv_gid_entry e;
            if (ibv_query_gid(d->ctx, d->port, i, &g) != 0 || cxv_gid_is_zero(&g)) continue;
            if (first < 0) first = i;
            if (!cxv_gid_is_v4(&g)) continue;
            if (ibv_query_gid_ex(d->ctx, d->port, i, &e, 0) == 0 &&
                e.gid_type != IBV_GID_TYPE_ROCE_V2) continue;
            gid_index = i;
            break;
        }
        if (gid_index < 0) gid_index = first;
        if (gid_index < 0) {
            snprintf(err, errlen, "RDMA port %d has no GID (no address on its netdev?)", port);
            goto fail;
        }
    }
    if (ibv_query_gid(d->ctx, d->port, gid_index, &d->gid) != 0 || cxv_gid_is_zero(&d->gid)) {
        snprintf(err, errlen, "GID index %d of port %d is not set", gid_index, port);
        goto fail;
    }
    d->gid_index = gid_index;
    {
        struct ibv_device_attr da;
        d->rd_atom = d->init_rd_atom = 16;
        if (ibv_query_device(d->ctx, &da) == 0) {
            if (da.max_qp_rd_atom > 0 && da.max_qp_rd_atom < d->rd_atom)
                d->rd_atom = da.max_qp_rd_atom;
            if (da.max_qp_init_rd_atom > 0 && da.max_qp_init_rd_atom < d->init_rd_atom)
                d->init_rd_atom = da.max_qp_init_rd_atom;
        }
    }
    d->pd = ibv_alloc_pd(d->ctx);
    if (d->pd == NULL) {
        snprintf(err, errlen, "ibv_alloc_pd: %s", strerror(errno));
        goto fail;
    }
    return 0;
fail:
    ibv_close_device(d->ctx);
    d->ctx = NULL;
    return -1;
}

static void cxv_close(cxv_dev* d) {
    if (d->pd) ibv_dealloc_pd(d->pd);
    if (d->ctx) ibv_close_device(d->ctx);
    d->pd = NULL;
    d->ctx = NULL;
}

static struct ibv_mr* cxv_reg(cxv_dev* d, void* addr, size_t len, int remote) {
    int access = IBV_ACCESS_LOCAL_WRITE;
    if (remote) access |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    return ibv_reg_mr(d->pd, addr, len, access);
}

static int cxv_qp_create(cxv_dev* d, cxv_qp* q, int depth, uint32_t psn) {
    struct ibv_qp_init_attr ia;
    struct ibv_qp_attr a;
    memset(q, 0, sizeof(*q));
    q->cq = ibv_create_cq(d->ctx, depth * 2, NULL, NULL, 0);
    if (q->cq == NULL) return -errno;
    memset(&ia, 0, sizeof(ia));
    ia.send_cq = q->cq;
    ia.recv_cq = q->cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = depth;
    ia.cap.max_recv_wr = 1;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    q->qp = ibv_create_qp(d->pd, &ia);
    if (q->qp == NULL) {
        int e = errno;
        ibv_destroy_cq(q->cq);
        q->cq = NULL;
        return -e;
    }
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = d->port;
    a.qp_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                      IBV_QP_ACCESS_FLAGS) != 0) {
        int e = errno;
        ibv_destroy_qp(q->qp);
        ibv_destroy_cq(q->cq);
        q->qp = NULL;
        q->cq = NULL;
        return -e;
    }
    q->psn = psn & 0xffffff;
    q->depth = depth;
    return 0;
}

/* INIT -> RTR -> RTS against the peer's QP. timeout: 4.096 us * 2^timeout per try,
 * retry: tries after the first; their product bounds how long a dead peer takes to
 * show as IBV_WC_RETRY_EXC_ERR. */
static int cxv_qp_connect(cxv_dev* d, cxv_qp* q, uint32_t rqpn, uint32_t rpsn,
                          const uint8_t* rgid, int mtu, int rd_atom, int timeout, int retry) {
    /* mtu, rd_atom: the peer's; each side uses the smaller of its own and the peer's. */
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)(mtu > 0 && mtu < (int)d->mtu ? mtu : (int)d->mtu);
    a.dest_qp_num = rqpn;
    a.rq_psn = rpsn & 0xffffff;
    a.max_dest_rd_atomic = (uint8_t)d->rd_atom;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, rgid, 16);
    a.ah_attr.grh.sgid_index = (uint8_t)d->gid_index;
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.port_num = d->port;
    if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                      IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                      IBV_QP_MIN_RNR_TIMER) != 0)
        return -errno;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.timeout = (uint8_t)timeout;
    a.retry_cnt = (uint8_t)retry;
    a.rnr_retry = (uint8_t)retry;
    a.sq_psn = q->psn;
    a.max_rd_atomic = (uint8_t)(rd_atom > 0 && rd_atom < d->init_rd_atom ? rd_atom
                                                                       : d->init_rd_atom);
    if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                      IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) != 0)
        return -errno;
    return 0;
}

/* Test hook: the send queue to the drain state, in which the device takes requests
 * and never starts them: a queue pair that stops completing, as a hung device would. */
static int cxv_qp_stall(cxv_qp* q) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_SQD;
    return ibv_modify_qp(q->qp, &a, IBV_QP_STATE) != 0 ? -errno : 0;
}

static void cxv_qp_destroy(cxv_qp* q) {
    if (q->qp) ibv_destroy_qp(q->qp);
    if (q->cq) ibv_destroy_cq(q->cq);
    q->qp = NULL;
    q->cq = NULL;
}

enum { CXV_OK = 0, CXV_POST = 1, CXV_WC = 2, CXV_TIMEOUT = 3, CXV_POLL = 4 };
#define CXV_SPIN_NS 500000ull

/* After a failure: the QP to the error state, so the device stops retrying and
 * flushes what it still holds, then its `inflight` completions reaped (bounded), so
 * no READ lands in the caller's buffer after the caller was told it failed. A WRITE
 * the responder already took cannot be called back: it may still land. */
static void cxv_abort(cxv_qp* q, int inflight) {
    struct ibv_qp_attr a;
    struct ibv_wc wc[16];
    uint64_t end = cxv_now_ns() + 2000000000ull;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(q->qp, &a, IBV_QP_STATE);
    while (inflight > 0 && cxv_now_ns() < end) {
        int k = ibv_poll_cq(q->cq, 16, wc);
        if (k < 0) break;
        inflight -= k;
        if (k == 0) {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
    }
}

/* Where piece i of a transfer goes: local address, remote address, length. */
typedef struct {
    char* laddr;
    uint64_t raddr;
    uint64_t n;           /* cxv_xfer: bytes in all; cxv_xfer_v: bytes per piece */
    uint64_t chunk;       /* cxv_xfer: bytes per piece */
    const uint64_t* offs; /* cxv_xfer_v: remote offsets from raddr, one per piece */
} cxv_plan;

static void cxv_piece(const cxv_plan* p, uint64_t i, char** l, uint64_t* r, uint64_t* len) {
    if (p->offs) {
        *l = p->laddr + i * p->n;
        *r = p->raddr + p->offs[i];
        *len = p->n;
    } else {
        uint64_t at = i * p->chunk;
        *l = p->laddr + at;
        *r = p->raddr + at;
        *len = p->n - at < p->chunk ? p->n - at : p->chunk;
    }
}

/* Run `pieces` requests of a plan, `depth` in flight, all complete on return 0. A
 * failure is a completion error, or no completion for `timeout_ns` (the clock restarts
 * at each one: a long transfer that moves is never cut off). On failure *wc_status
 * holds the completion status (or an errno for CXV_POST), the QP is in the error state
 * and drained, and must not be used again. */
static int cxv_run(cxv_qp* q, int write, const cxv_plan* p, uint64_t pieces, uint32_t lkey,
                   uint32_t rkey, uint64_t timeout_ns, int* wc_status) {
    uint64_t deadline_ns = cxv_now_ns() + timeout_ns;
    struct ibv_sge sge;
    struct ibv_send_wr wr, *bad;
    struct ibv_wc wc[16];
    uint64_t sent = 0, done = 0, spin_end = 0, len, raddr;
    char* laddr;
    int inflight = 0, spins = 0, k, i;
    *wc_status = 0;
    while (done < pieces) {
        while (sent < pieces && inflight < q->depth) {
            cxv_piece(p, sent, &laddr, &raddr, &len);
            memset(&wr, 0, sizeof(wr));
            sge.addr = (uint64_t)(uintptr_t)laddr;
            sge.length = (uint32_t)len;
            sge.lkey = lkey;
            wr.wr_id = sent;
            wr.sg_list = &sge;
            wr.num_sge = 1;
            wr.opcode = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
            wr.send_flags = IBV_SEND_SIGNALED;
            wr.wr.rdma.remote_addr = raddr;
            wr.wr.rdma.rkey = rkey;
            k = ibv_post_send(q->qp, &wr, &bad);
            if (k != 0) {
                *wc_status = k;
                cxv_abort(q, inflight);
                return CXV_POST;
            }
            sent++;
            inflight++;
        }
        k = ibv_poll_cq(q->cq, 16, wc);
        if (k < 0) {
            cxv_abort(q, inflight);
            return CXV_POLL;
        }
        for (i = 0; i < k; i++) {
            inflight--;
            if (wc[i].status != IBV_WC_SUCCESS) {
                *wc_status = (int)wc[i].status;
                cxv_abort(q, inflight - (k - i - 1));  /* those after i: already reaped */
                return CXV_WC;
            }
            done++;
        }
        if (k > 0) {
            deadline_ns = cxv_now_ns() + timeout_ns;
            spin_end = 0;
        }
        if (k == 0 && ++spins % 64 == 0) {
            /* Busy-poll for the first CXV_SPIN_NS of a wait (a round trip is tens of
             * microseconds: a sleep would cost more than it waits), then poll between
             * short sleeps, leaving the core to whoever completes the request. */
            uint64_t now = cxv_now_ns();
            if (now > deadline_ns) {
                cxv_abort(q, inflight);
                return CXV_TIMEOUT;
            }
            if (spin_end == 0) {
                spin_end = now + CXV_SPIN_NS;
            } else if (now > spin_end) {
                struct timespec ts = {0, 5000};
                nanosleep(&ts, NULL);
            }
        }
    }
    return CXV_OK;
}

/* Move n bytes between local [laddr, +n) (registered, lkey) and remote [raddr, +n)
 * (rkey): READ when !write, at most `chunk` bytes per request (cxv_run). */
static int cxv_xfer(cxv_qp* q, int write, char* laddr, uint32_t lkey, uint64_t raddr,
                    uint32_t rkey, uint64_t n, uint64_t chunk, uint64_t timeout_ns,
                    int* wc_status) {
    cxv_plan p = {laddr, raddr, n, chunk, NULL};
    return cxv_run(q, write, &p, n ? (n + chunk - 1) / chunk : 0, lkey, rkey, timeout_ns,
                   wc_status);
}

/* `count` transfers of `len` bytes each, piece i between local laddr + i * len and
 * remote raddr + offs[i]: a gather (READ) or scatter (WRITE) of small words, all of
 * them in flight at once up to the QP's depth (cxv_run). */
static int cxv_xfer_v(cxv_qp* q, int write, char* laddr, uint32_t lkey, uint64_t raddr,
                      uint32_t rkey, const uint64_t* offs, uint64_t len, uint64_t count,
                      uint64_t timeout_ns, int* wc_status) {
    cxv_plan p = {laddr, raddr, len, 0, offs};
    return cxv_run(q, write, &p, count, lkey, rkey, timeout_ns, wc_status);
}

#endif
