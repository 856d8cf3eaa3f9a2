/* The proxy's objects, declared so that headers can name one another's without including
 * them. Each is defined in its own header: px_t (px.h), px_gen_t (gen.h), px_pool_t (pool.h),
 * px_replica_t (replica.h), px_thread_t (thread.h); the rest belong to the plane that owns
 * them and are opaque here. */
#ifndef PX_TYPES_H
#define PX_TYPES_H

typedef struct px_s px_t;
typedef struct px_gen_s px_gen_t;
typedef struct px_pool_s px_pool_t;
typedef struct px_replica_s px_replica_t;
typedef struct px_thread_s px_thread_t;
typedef struct px_admission_entry_s px_admission_entry_t;
typedef struct px_worker_s px_worker_t;         /* data/worker.c */
typedef struct px_attest_ctx_s px_attest_ctx_t; /* control/attest.c */
typedef struct px_shadow_ctx_s px_shadow_ctx_t; /* data/shadow.c */
typedef struct px_audit_s px_audit_t;           /* obs/audit.c */
typedef struct px_discovery_s px_discovery_t;   /* control/discovery.c */
typedef struct px_otel_ctx_s px_otel_ctx_t;     /* obs/otel.c */
typedef struct px_fleet_s px_fleet_t;           /* control/fleet.c */

#endif
