"""A tracking server on 127.0.0.1 for the tracker tests: MLflow's REST API, answered until told to stall.

    server = MlflowServer()            # answers what MlflowClient asks of a tracking server
    server.url                         # "http://127.0.0.1:PORT" for [logging] mlflow_uri
    server.stall()                     # from now on: accepts every connection and never replies
    server.close()

It answers the calls etrain's MLflow tracker makes (experiment by name, create
experiment and run, log a parameter, a batch of metrics, a tag, terminate) with
the JSON the real server sends, and counts them per path (``server.calls``).
Stalled, it keeps each connection open without a byte of reply, as a server
whose backend hangs does: the client waits out its own timeout (MLflow's: 120 s,
then retries).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RUN_INFO = {"run_id": "r1", "run_uuid": "r1", "experiment_id": "1", "run_name": "run", "status": "RUNNING",
            "start_time": 0, "lifecycle_stage": "active", "artifact_uri": "mlflow-artifacts:/1/r1"}


class MlflowServer:
    def __init__(self, stalled: bool = False):
        self.calls: Counter = Counter()
        self.stalled = threading.Event()
        self.closing = threading.Event()
        if stalled:
            self.stalled.set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                path = self.path.split("?", 1)[0]
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                server.calls[path] += 1
                if server.stalled.is_set():
                    server.closing.wait()  # hold the connection, never reply
                    return
                status, body = 200, {}
                if path.endswith("/experiments/get-by-name"):
                    status, body = 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"}
                elif path.endswith("/experiments/create"):
                    body = {"experiment_id": "1"}
                elif path.endswith("/runs/create"):
                    body = {"run": {"info": RUN_INFO, "data": {}}}
                elif path.endswith("/runs/update"):
                    body = {"run_info": {**RUN_INFO, "status": "FINISHED"}}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="mlflow-server", daemon=True)
        self.thread.start()

    def stall(self) -> None:
        self.stalled.set()

    def answered(self, suffix: str) -> int:
        """How many requests to a path ending in ``suffix`` arrived (answered or held)."""
        return sum(n for p, n in self.calls.items() if p.endswith(suffix))

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()
