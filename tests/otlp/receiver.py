"""An OTLP/HTTP trace receiver for the tests and benchmarks.

Accepts `POST /v1/traces` (application/x-protobuf), decodes each export with the official
opentelemetry-proto definitions, and appends every span, one JSON object per line, to the file
named by the first argument. With `-` instead of a file it only receives (answers every export
without decoding it: a collector that costs the machine little, for benchmarks). Prints its
port, then serves until killed.

    python receiver.py spans.jsonl|- [port]
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

OUT = sys.argv[1]
MAX_BODY = 64 << 20
EMPTY = ExportTraceServiceResponse().SerializeToString()


def value(v):
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def attributes(kvs):
    return {kv.key: value(kv.value) for kv in kvs}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self, status, body=b"", content_type="application/x-protobuf"):
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(min(length, MAX_BODY))
        if self.path != "/v1/traces":
            return self.answer(404, b"not found", "text/plain")
        if self.headers.get("content-type") != "application/x-protobuf":
            return self.answer(415, b"protobuf only", "text/plain")
        if OUT == "-":
            return self.answer(200, EMPTY)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        lines = []
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    lines.append(
                        json.dumps(
                            {
                                "service": resource.get("service.name"),
                                "scope": scope_spans.scope.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "name": span.name,
                                "kind": span.kind,
                                "start_ns": span.start_time_unix_nano,
                                "end_ns": span.end_time_unix_nano,
                                "attributes": attributes(span.attributes),
                                "status_code": span.status.code,
                                "status_message": span.status.message,
                            }
                        )
                    )
        if lines:
            with open(OUT, "a") as f:
                f.write("\n".join(lines) + "\n")
        self.answer(200, EMPTY)

    def log_message(self, *args):
        pass


port = int(sys.argv[2]) if len(sys.argv) > 2 else 0
server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
