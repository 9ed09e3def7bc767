"""The proxy's added latency (BENCHMARKS.md, "dflash proxy"): a fixed-answer OpenAI-compatible upstream and a
load generator of one or many connections, both on loopback with TCP_NODELAY (so neither side waits on delayed ACKs).

  python3 scripts/probes/proxy_latency.py upstream PORT            # answers every chat completion at once (JSON or 64 events)
  python3 scripts/probes/proxy_latency.py load HOST PORT N STREAM [C]  # N requests over C connections at once (default
                                                          # 1), each one request after another (the first 100 of each
                                                          # not in the latencies); prints p50/p99 in ms and all
                                                          # requests/s over the wall time as JSON
Run: upstream on 9701, `dflash proxy --upstream http://127.0.0.1:9701 --listen 127.0.0.1:9702 --record DIR`, then
`load` against 9701 (direct) and 9702 (through the proxy), alternated, STREAM 0 and 1.
"""

import http.client
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ANSWER = json.dumps({"id": "c", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "x" * 400}, "finish_reason": "stop"}]}).encode()
EVENTS = b"".join(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "tok "}}]}).encode() + b"\n\n"
                  for _ in range(64)) + b"data: [DONE]\n\n"


class Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        body, kind = (EVENTS, "text/event-stream") if request.get("stream") else (ANSWER, "application/json")
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def one_connection(host, port, n, body, latencies):
    c = http.client.HTTPConnection(host, port)
    c.connect()
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mine = []
    for _ in range(n):
        start = time.perf_counter()
        c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = c.getresponse()
        got = r.read()
        assert r.status == 200 and len(got) > 100, (r.status, got[:200])
        mine.append((time.perf_counter() - start) * 1000)
    latencies.extend(mine[100:])


def load(host, port, n, stream, connections):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}], "temperature": 0,
                       "stream": stream})
    latencies = []
    threads = [threading.Thread(target=one_connection, args=(host, port, n // connections, body, latencies))
               for _ in range(connections)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    q = lambda p: latencies[int(p * (len(latencies) - 1))]  # noqa: E731
    # Requests/s: every request (warm-up included) over the wall time of the whole load.
    print(json.dumps({"stream": stream, "connections": connections, "n": len(latencies), "p50_ms": round(q(0.5), 3),
                      "p99_ms": round(q(0.99), 3), "rps": round(connections * (n // connections) / wall, 1)}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["upstream"]:
        ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Upstream).serve_forever()
    elif sys.argv[1:2] == ["load"]:
        load(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", int((sys.argv[6:7] or ["1"])[0]))
    else:
        sys.exit(__doc__)
