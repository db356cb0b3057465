"""The official openai SDK streaming through idemgate.

Usage: python openai_stream.py PATH_TO_IDEMGATE_BINARY

Starts a local provider that streams the OpenAI SSE fixture, starts the gateway in front of
it, streams a chat completion through the gateway with the SDK, then repeats the call with
the same idempotency key: the chunks must arrive in order both times, and the provider must
see exactly one request.
"""

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from openai import OpenAI

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "fixtures", "openai-chat-stream.sse")
EXPECTED = "Hello! How can I help?"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Provider(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    calls = 0

    def do_POST(self):
        Provider.calls += 1
        self.rfile.read(int(self.headers.get("content-length", 0)))
        with open(FIXTURE, "rb") as f:
            events = [e + b"\n\n" for e in f.read().split(b"\n\n") if e.strip()]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for event in events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
            time.sleep(0.02)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def log_message(self, *args):
        pass


def wait_for(port, deadline):
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


def stream(client, key):
    chunks = []
    response = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "Say hello."}],
        stream=True,
        extra_headers={"Idempotency-Key": key},
    )
    for chunk in response:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            chunks.append(chunk.choices[0].delta.content)
    return chunks


def main():
    binary = sys.argv[1]
    provider = ThreadingHTTPServer(("127.0.0.1", 0), Provider)
    threading.Thread(target=provider.serve_forever, daemon=True).start()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "idemgate.toml")
        with open(config, "w") as f:
            f.write(
                f'[server]\nlisten = "127.0.0.1:{port}"\n[store]\nkind = "memory"\n'
                f'[[providers]]\nname = "primary"\nbase_url = "http://127.0.0.1:{provider.server_port}"\n'
                '[[routes]]\nname = "chat"\npath_prefix = "/v1/chat/completions"\nproviders = ["primary"]\n'
            )
        gateway = subprocess.Popen([binary, "--config", config], stderr=subprocess.DEVNULL)
        passed = failed = 0
        try:
            wait_for(port, time.time() + 10)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-sdk-test", max_retries=0)
            key = str(uuid.uuid4())
            checks = []
            first = stream(client, key)
            checks.append(("stream arrives in order", "".join(first) == EXPECTED and len(first) > 1))
            again = stream(client, key)
            checks.append(("the same key replays the same chunks", again == first))
            checks.append(("one provider call", Provider.calls == 1))
            for name, ok in checks:
                print(f"openai sdk: {name} ... {'ok' if ok else 'FAILED'}")
                passed += ok
                failed += not ok
        finally:
            gateway.terminate()
            gateway.wait(timeout=10)
            provider.shutdown()
        print(f"openai sdk: {passed} passed, {failed} failed")
        sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
