/* cxl_kv.h - KV cache on-media constants too wide for a Cython enum (a C int). */
#ifndef CXL_KV_H
#define CXL_KV_H

/* kv_claim.where of a record whose payload was evicted despite void pins
 * ("VIDPINS"): its `start` is then the mask of the nodes whose pins were void. */
#define KV_PIN_WHERE 0x534E4950444956ULL

/* kv_payload_header.magic ("CXLKVB02"): the header of a payload its writer began. */
#define KV_PAYLOAD_MAGIC 0x323042564B4C5843ULL

#endif /* CXL_KV_H */
