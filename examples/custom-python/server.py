"""
A standard-library HTTP server for Ferry's custom runtime (no dependencies: nothing is installed).

    GET  /health, /ready  200 "ok" (Ferry's health and readiness checks, see ferry.toml)
    GET  /                {"hello": "world", "pid": ...}
    ANY  /echo            the request as JSON: method, path, query, headers, body
    GET  /events          a server-sent-event stream: data: 1 ... data: 5, 200 ms apart

Ferry gives the server the path after /v4/<project_id>/custom-python and sets PORT. Output is flushed
at once (flush=True) so it reaches the replica's logs as it is printed.
"""

import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

PORT = int(os.environ.get("PORT", "8080"))

# Requests being answered, so SIGTERM can let them finish.
active = 0
idle = threading.Condition()


@contextmanager
def tracked():
    global active
    with idle:
        active += 1
    try:
        yield
    finally:
        with idle:
            active -= 1
            idle.notify_all()


class Handler(BaseHTTPRequestHandler):
    # HTTP/1.1: keep-alive, and chunked responses for the event stream (see events()).
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        with tracked():
            self.route()

    def do_POST(self):
        with tracked():
            self.route()

    def do_PUT(self):
        with tracked():
            self.route()

    def do_DELETE(self):
        with tracked():
            self.route()

    def do_PATCH(self):
        with tracked():
            self.route()

    def route(self):
        url = urlsplit(self.path)
        route = (self.command, url.path)
        if route in (("GET", "/health"), ("GET", "/ready")):
            self.send_body(200, "text/plain", b"ok")
        elif route == ("GET", "/"):
            self.send_json(200, {"hello": "world", "pid": os.getpid()})
        elif url.path == "/echo":
            body = self.read_body().decode("utf-8", errors="replace")
            self.send_json(200, {
                "method": self.command,
                "path": url.path,
                "query": dict(parse_qsl(url.query, keep_blank_values=True)),
                "headers": {name.lower(): value for name, value in self.headers.items()},
                "body": body,
            })
        elif route == ("GET", "/events"):
            self.events()
        else:
            self.read_body()  # so the connection can be reused
            self.send_json(404, {"error": "not found", "method": self.command, "path": url.path})

    def read_body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            # A streamed request body: <hex size>\r\n<data>\r\n ... 0\r\n\r\n
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def send_body(self, status, content_type, data):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_json(self, status, value):
        self.send_body(status, "application/json", json.dumps(value).encode())

    def events(self):
        # Streaming: HTTP/1.1 with "Transfer-Encoding: chunked" written by hand. Each event is one chunk,
        # "<hex length>\r\n<bytes>\r\n", written and flushed at once, so a proxy that copies bytes (Ferry's
        # does) passes it on immediately; the zero-length chunk at the end says "done", so the connection
        # stays usable and a cut stream cannot pass for a complete one. (The other way, "Connection: close"
        # with no length, streams too, but ends every stream with the connection.)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for n in range(1, 6):
                if n > 1:
                    time.sleep(0.2)
                data = f"data: {n}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the caller went away

    def log_message(self, format, *args):
        print(f"{self.address_string()} {format % args}", flush=True)


def main():
    server = ThreadingHTTPServer(("", PORT), Handler)

    def on_sigterm(signum, frame):
        # Ferry stops a replica with SIGTERM. shutdown() waits for serve_forever() to return, and that
        # runs in this (the main) thread, so it is called from another thread.
        print("SIGTERM: closing", flush=True)
        threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"listening on port {PORT}", flush=True)
    server.serve_forever()
    # No new connections now; let the requests in flight finish (at most 10 s), then exit 0. Idle
    # keep-alive connections are in daemon threads and end with the process.
    server.server_close()
    with idle:
        idle.wait_for(lambda: active == 0, timeout=10)
    print("closed", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
