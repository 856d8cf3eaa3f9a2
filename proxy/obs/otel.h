/* OpenTelemetry spans for inference requests (docs/operations.md §7): OTLP/HTTP with JSON encoding,
 * GenAI semantic conventions, W3C traceparent propagated to the replica.
 *
 * A span is built while the request runs (a few fields copied, the response's first and last
 * bytes kept, bounded) and serialised once the request is over; finished spans wait in a bounded
 * queue that a timer posts to <otel.endpoint>/v1/traces in batches, one export at a time. When
 * the queue is full, or the collector is slow or down, spans are dropped and counted
 * (detproxy_otel_spans_total{result="dropped"|"failed"}): export never delays a request. */
#ifndef PX_OTEL_H
#define PX_OTEL_H

#include "policy/policy.h"
#include "proxy/core/px.h"

typedef struct px_span_s px_span_t;

/* The request reached the inference path. Returns a span when otel is configured and the request
 * is sampled (a client traceparent's sampled flag decides, else otel.sample_rate), else NULL.
 * With a span, traceparent (56 bytes) is set to the value to send to the replica: the client's
 * trace id (or a new one) with this span as the parent; otherwise it is left empty and the
 * client's own header, if any, passes through unchanged. *new_trace is set when that value starts
 * a new trace (no valid client traceparent): the client's tracestate is then not forwarded. */
px_span_t *px_otel_start(px_t *px, const net_req_t *req, const char *route, char traceparent[56],
                         bool *new_trace);
/* Post-policy request attributes (the span keeps copies). */
void px_otel_request(px_span_t *s, const char *tenant, const px_pool_t *pool,
                     const policy_result_t *res);
/* The refusal code of a request that did not pass policy or routing. */
void px_otel_refused(px_span_t *s, const char *code);
void px_otel_replica(px_span_t *s, const char *replica, bool shadowed);
/* Response bytes as forwarded to the client. */
void px_otel_bytes(px_span_t *s, const char *p, size_t n);
/* The request is over: serialise, queue for export, free the span. */
void px_otel_end(px_t *px, px_span_t *s, int status, const char *request_id,
                 const char *upstream_fingerprint);
/* Start, or a new configuration generation: (re)connect to otel.endpoint (a host name is
 * resolved here, once per load), or stop exporting when otel is gone. */
void px_otel_sync(px_t *px);
/* Shutdown: cancel the export in flight and drop what is queued. */
void px_otel_stop(px_t *px);

#endif
