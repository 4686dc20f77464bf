"""A replica of examples/service.yaml: answers on $PORT (GET / with which replica and GPUs
served it, GET /health for the readiness and liveness checks). Replace the body of
`answer` with your model's inference; the rest is what a gpuflow service needs."""

from __future__ import annotations

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def answer(path: str) -> dict:
    """Return the reply to a request for `path` (your model goes here)."""
    return {
        "path": path,
        "replica": os.environ.get("GPUFLOW_REPLICA", ""),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"ok\n" if self.path == "/health" else json.dumps(answer(self.path)).encode()
        self.send_response(200)
        self.send_header(
            "Content-Type", "text/plain" if self.path == "/health" else "application/json"
        )
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # the endpoint logs requests already
        pass


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler)
    # a scale-down or a cancel sends SIGTERM: stop taking requests and end cleanly
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"serving on {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
