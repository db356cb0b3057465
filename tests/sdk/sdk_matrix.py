"""The official SDKs through idemgate's example configs, against a local fake provider.

Usage: python sdk_matrix.py PATH_TO_IDEMGATE_BINARY

Runs every check whose SDK is importable in this interpreter (openai, anthropic), each
through config/openai.toml or config/anthropic.toml with only the provider addresses,
listeners, store and timeouts rewritten for the test:

- every endpoint twice with one idempotency key: one provider call, the second answer a
  replay identical to the first;
- a reused key with another payload: the SDK raises the 409 after one request (the gateway
  counts its requests), and the exception's text carries the gateway's explanation;
- a provider that does not answer in time: the SDK raises the 504 `outcome-unknown` of the
  request that ran it, after one request, not a 409 of its own retry.

Prints one line per check and a summary; exits non-zero when a check fails.
"""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.request import urlopen

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
FIXTURES = os.path.join(HERE, "..", "fixtures")


def fixture(name):
    with open(os.path.join(FIXTURES, name), "rb") as f:
        return f.read()


def events(raw):
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e.strip()]


RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1,
    "status": "completed",
    "model": "gpt-4o-mini",
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello!", "annotations": []}],
        }
    ],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
}


def response_stream():
    out = []
    for kind, data in [
        ("response.created", {"type": "response.created", "sequence_number": 0, "response": dict(RESPONSE, status="in_progress", output=[])}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "Hello", "logprobs": []}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 2, "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "!", "logprobs": []}),
        ("response.completed", {"type": "response.completed", "sequence_number": 3, "response": RESPONSE}),
    ]:
        out.append(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
    return out


class Provider(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    calls = Counter()

    def do_POST(self):
        path = self.path.split("?")[0]
        Provider.calls[path] += 1
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        try:
            request = json.loads(body)
        except ValueError:
            request = {}
        if request.get("model") == "slow":
            time.sleep(3)
        stream = request.get("stream") is True
        if path == "/v1/chat/completions":
            if stream:
                return self.sse(events(fixture("openai-chat-stream.sse")))
            return self.json(fixture("openai-chat-completion.json"))
        if path == "/v1/responses":
            return self.sse(response_stream()) if stream else self.json(json.dumps(RESPONSE).encode())
        if path == "/v1/embeddings":
            return self.json(json.dumps({
                "object": "list", "model": "text-embedding-3-small",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}],
                "usage": {"prompt_tokens": 2, "total_tokens": 2},
            }).encode())
        if path == "/v1/audio/transcriptions":
            return self.json(json.dumps({"text": f"heard {len(body)} bytes"}).encode())
        if path == "/v1/files":
            return self.json(json.dumps({
                "id": f"file-{Provider.calls[path]}", "object": "file", "bytes": len(body),
                "created_at": 1, "filename": "batch.jsonl", "purpose": "batch", "status": "processed",
            }).encode())
        if path == "/v1/messages":
            if stream:
                return self.sse(events(fixture("anthropic-stream.sse")))
            return self.json(fixture("anthropic-message.json"))
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def json(self, payload):
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def sse(self, chunks):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def log_message(self, *args):
        pass

    def handle_one_request(self):
        # The gateway hangs up on a provider slower than its timeout: not this test's error.
        try:
            super().handle_one_request()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(port, deadline):
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


class Gateway:
    """The binary on an example config, rewritten to reach the fake provider."""

    def __init__(self, binary, example, provider_url, tmp):
        self.port, self.admin = free_port(), free_port()
        with open(os.path.join(ROOT, "config", example)) as f:
            text = f.read()
        text = re.sub(r'https://[a-z.]+(/api)?"', provider_url + '"', text)
        text = text.replace('"127.0.0.1:8080"', f'"127.0.0.1:{self.port}"')
        text = text.replace('"127.0.0.1:8081"', f'"127.0.0.1:{self.admin}"')
        text = text.replace('kind = "embedded"', 'kind = "memory"')
        text = re.sub(r'timeout = "120s"', 'timeout = "1s"', text)
        path = os.path.join(tmp, example)
        with open(path, "w") as f:
            f.write(text)
        env = dict(os.environ, OPENAI_API_KEY="sk-gw-openai", OPENROUTER_API_KEY="sk-gw-or",
                   ANTHROPIC_API_KEY="sk-gw-ant", ANTHROPIC_FALLBACK_KEY="sk-gw-ant2",
                   IDEMGATE_LOG="error")
        self.process = subprocess.Popen([binary, "--config", path], env=env, stderr=subprocess.DEVNULL)
        wait_for(self.port, time.time() + 10)
        wait_for(self.admin, time.time() + 10)

    def requests(self, route):
        """How many requests the gateway counted for a route, every outcome."""
        text = urlopen(f"http://127.0.0.1:{self.admin}/metrics").read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("idemgate_requests_total{") and f'route="{route}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self):
        self.process.terminate()
        self.process.wait(timeout=10)


class Checks:
    def __init__(self):
        self.passed = self.failed = 0

    def check(self, name, ok, detail=""):
        print(f"sdk: {name} ... {'ok' if ok else 'FAILED ' + str(detail)}")
        if ok:
            self.passed += 1
        else:
            self.failed += 1


def twice(checks, label, path, call):
    """`call(key)` twice with one key: one provider call, the same answer."""
    key = str(uuid.uuid4())
    before = Provider.calls[path]
    try:
        first = call(key)
        second = call(key)
    except Exception as e:  # noqa: BLE001 - any SDK error fails the check
        checks.check(f"{label}: replayed", False, repr(e))
        return
    calls = Provider.calls[path] - before
    checks.check(f"{label}: one provider call for two requests ({calls})", calls == 1)
    checks.check(f"{label}: the replay is the same answer", first == second, (first, second))
    return calls


def openai_checks(binary, provider_url, tmp, checks, matrix):
    import openai
    from openai import OpenAI

    gateway = Gateway(binary, "openai.toml", provider_url, tmp)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="sk-client")
        h = lambda key: {"Idempotency-Key": key}
        messages = [{"role": "user", "content": "Say hello."}]

        def chat(key):
            return client.chat.completions.create(model="gpt-4o-mini", messages=messages, extra_headers=h(key)).model_dump()

        def chat_stream(key):
            stream = client.chat.completions.create(model="gpt-4o-mini", messages=messages, stream=True, extra_headers=h(key))
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        def responses(key):
            return client.responses.create(model="gpt-4o-mini", input="Say hello.", extra_headers=h(key)).output_text

        def responses_stream(key):
            stream = client.responses.create(model="gpt-4o-mini", input="Say hello.", stream=True, extra_headers=h(key))
            return "".join(e.delta for e in stream if e.type == "response.output_text.delta")

        def embeddings(key):
            return client.embeddings.create(model="text-embedding-3-small", input="hello", extra_headers=h(key)).model_dump()

        def transcription(key):
            # The SDK picks a new multipart boundary for every request.
            return client.audio.transcriptions.create(model="whisper-1", file=("a.wav", b"RIFF-fake-audio"), extra_headers=h(key)).text

        def upload(key):
            return client.files.create(file=("batch.jsonl", b'{"a":1}\n'), purpose="batch", extra_headers=h(key)).id

        for label, path, call in [
            ("openai chat.completions", "/v1/chat/completions", chat),
            ("openai chat.completions stream", "/v1/chat/completions", chat_stream),
            ("openai responses", "/v1/responses", responses),
            ("openai responses stream", "/v1/responses", responses_stream),
            ("openai embeddings", "/v1/embeddings", embeddings),
            ("openai audio.transcriptions (multipart)", "/v1/audio/transcriptions", transcription),
            ("openai files.create (multipart)", "/v1/files", upload),
        ]:
            matrix.append((f"openai {openai.__version__}", label, twice(checks, label, path, call)))

        # A changed file byte under the same key is another payload.
        key = str(uuid.uuid4())
        client.files.create(file=("batch.jsonl", b'{"a":1}\n'), purpose="batch", extra_headers=h(key))
        try:
            client.files.create(file=("batch.jsonl", b'{"a":2}\n'), purpose="batch", extra_headers=h(key))
            checks.check("openai files.create: a changed byte is a conflict", False, "no error")
        except openai.ConflictError as e:
            checks.check("openai files.create: a changed byte is a conflict", getattr(e, "code", None) == "idempotency-key-reused", str(e))

        # Reuse: raised after exactly one request, with the explanation in the message.
        key = str(uuid.uuid4())
        chat(key)
        before = gateway.requests("chat")
        try:
            client.chat.completions.create(model="gpt-4o", messages=messages, extra_headers=h(key))
            checks.check("openai reuse raises", False, "no error")
        except openai.ConflictError as e:
            checks.check("openai reuse: the message explains", "different request" in str(e), str(e))
            checks.check("openai reuse: error.code is the slug", getattr(e, "code", None) == "idempotency-key-reused", getattr(e, "code", None))
        sent = gateway.requests("chat") - before
        checks.check(f"openai reuse: no SDK retry ({sent:.0f} request)", sent == 1)

        # A provider that does not answer in time: the 504 of the request that ran it.
        key = str(uuid.uuid4())
        before = gateway.requests("chat")
        started = time.time()
        try:
            client.chat.completions.create(model="slow", messages=messages, extra_headers=h(key))
            checks.check("openai timeout raises", False, "no error")
        except openai.APIStatusError as e:
            checks.check(f"openai timeout: 504 outcome-unknown (got {e.status_code})", e.status_code == 504 and getattr(e, "code", None) == "outcome-unknown", str(e))
            checks.check("openai timeout: the message explains", "did not answer in time" in str(e), str(e))
        sent = gateway.requests("chat") - before
        checks.check(f"openai timeout: no SDK retry ({sent:.0f} request, {time.time() - started:.1f}s)", sent == 1)
    finally:
        gateway.close()


def anthropic_checks(binary, provider_url, tmp, checks, matrix):
    import anthropic
    from anthropic import Anthropic

    gateway = Gateway(binary, "anthropic.toml", provider_url, tmp)
    try:
        client = Anthropic(base_url=f"http://127.0.0.1:{gateway.port}", api_key="sk-ant-client")
        h = lambda key: {"Idempotency-Key": key}
        messages = [{"role": "user", "content": "Say hello."}]

        def create(key):
            return client.messages.create(model="claude-sonnet-4-6", max_tokens=64, messages=messages, extra_headers=h(key)).model_dump()

        def stream(key):
            with client.messages.stream(model="claude-sonnet-4-6", max_tokens=64, messages=messages, extra_headers=h(key)) as s:
                return "".join(s.text_stream)

        version = anthropic.__version__
        matrix.append((f"anthropic {version}", "messages.create", twice(checks, f"anthropic {version} messages.create", "/v1/messages", create)))
        matrix.append((f"anthropic {version}", "messages.stream", twice(checks, f"anthropic {version} messages.stream", "/v1/messages", stream)))

        key = str(uuid.uuid4())
        create(key)
        before = gateway.requests("messages")
        try:
            client.messages.create(model="claude-opus-4", max_tokens=64, messages=messages, extra_headers=h(key))
            checks.check(f"anthropic {version} reuse raises", False, "no error")
        except anthropic.ConflictError as e:
            checks.check(f"anthropic {version} reuse: the message explains", "different request" in str(e), str(e))
        sent = gateway.requests("messages") - before
        checks.check(f"anthropic {version} reuse: no SDK retry ({sent:.0f} request)", sent == 1)

        key = str(uuid.uuid4())
        before = gateway.requests("messages")
        try:
            client.messages.create(model="slow", max_tokens=64, messages=messages, extra_headers=h(key))
            checks.check(f"anthropic {version} timeout raises", False, "no error")
        except anthropic.APIStatusError as e:
            checks.check(f"anthropic {version} timeout: 504 outcome-unknown", e.status_code == 504 and "did not answer in time" in str(e), str(e))
        sent = gateway.requests("messages") - before
        checks.check(f"anthropic {version} timeout: no SDK retry ({sent:.0f} request)", sent == 1)
    finally:
        gateway.close()


def main():
    binary = sys.argv[1]
    provider = ThreadingHTTPServer(("127.0.0.1", 0), Provider)
    threading.Thread(target=provider.serve_forever, daemon=True).start()
    provider_url = f"http://127.0.0.1:{provider.server_port}"
    checks, matrix = Checks(), []
    with tempfile.TemporaryDirectory() as tmp:
        for module, run in [("openai", openai_checks), ("anthropic", anthropic_checks)]:
            try:
                __import__(module)
            except ImportError:
                continue
            run(binary, provider_url, tmp, checks, matrix)
    provider.shutdown()
    for sdk, endpoint, calls in matrix:
        print(f"sdk matrix: {sdk} | {endpoint} | provider calls for 2 requests: {calls}")
    print(f"sdk: {checks.passed} passed, {checks.failed} failed")
    sys.exit(1 if checks.failed or not checks.passed else 0)


if __name__ == "__main__":
    main()
