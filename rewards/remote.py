"""Rewards served over HTTP: ``vsa2-rl serve-reward`` runs any registered reward as a service,
and the reward ``remote:http://host:port`` scores through it (heavy scorers on other machines or
GPUs, as FastVideo's and flow_grpo's reward servers do).

Wire format (no pickle anywhere): a request is ``POST /score`` with a zlib-compressed
safetensors body holding ``videos`` as uint8 ``[B, T, C, H, W]`` (the [0, 1] videos quantised to
255 levels, 4x smaller than float32; B >= 1, T >= 2) and, in the safetensors metadata,
``prompts`` (a JSON list of B strings) and ``metadata`` (a JSON list of B objects); the reply is
a safetensors body with ``scores`` float32 ``[B]``, or a JSON ``{"error": ...}`` with an HTTP
error status. ``GET /health`` returns ``{"reward": NAME}``. Any other dtype (floats included:
the server does not guess their scale) or shape, or a malformed body, gets HTTP 400 with a
one-line reason; 500 means the reward itself failed. Request bodies, compressed and
decompressed, are bounded (``max_request_mb``; a larger one gets HTTP 413, read off the socket
first up to 4x the bound so the client sees the reply, and the connection closed); a body is
inflated no further than its header's shape needs, and the memory of all requests in flight is
bounded (``max_inflight_mb``; beyond it, 503). The server binds 127.0.0.1 unless told
otherwise, handles at most ``max_connections`` connections at once (one more gets 503) and
drops a connection whose whole request (headers and body) has not arrived ``client_timeout_s``
after it opened. A client that leaves early is one log line, not a traceback.

The client has a timeout per request (for connecting, and then for the whole exchange: a server
that trickles its reply is cut off) and a bounded number of retries (with a short backoff) for
connection failures and server errors (5xx); a 4xx is the request's fault and is not retried.
Its errors name the reward, the address and the server's reason, and the trainer's
``rewards.on_error`` policy applies to them like to any reward's failure.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import sys
import threading
import time
import urllib.parse
import warnings
import zlib
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from .videos import check_videos

PREFIX = "remote:"


def encode_request(videos: torch.Tensor, prompts: list[str], metadata: list[dict]) -> bytes:
    pixels = (videos.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    header = {"prompts": json.dumps(list(prompts)), "metadata": json.dumps(list(metadata))}
    return zlib.compress(save_tensors({"videos": pixels.contiguous()}, metadata=header), 1)


def _json_list(header: dict, key: str, kind: type) -> list:
    """``header[key]``: a JSON list of ``kind`` items (a string is refused, not split)."""
    if key not in header:
        raise ValueError(f"{key}: missing from the safetensors metadata")
    try:
        value = json.loads(header[key])
    except json.JSONDecodeError as error:
        raise ValueError(f"{key}: not JSON ({error})") from None
    if not isinstance(value, list) or not all(isinstance(item, kind) for item in value):
        raise ValueError(f"{key}: expected a JSON list of {kind.__name__}, got {header[key][:80]}")
    return value


class ServerBusy(Exception):
    """The server's budget of request memory is spent for now (HTTP 503, which clients retry)."""


def _inflate(inflater, size: int, data: bytes | None = None) -> bytes:
    """Up to ``size`` more bytes of the zlib stream: from ``data``, else from the input the
    last call left (``decompress(b"")`` would drop it)."""
    out, pending = b"", inflater.unconsumed_tail if data is None else data
    while len(out) < size:
        more = inflater.decompress(pending, size - len(out))
        pending = inflater.unconsumed_tail
        if not more:
            break
        out += more
    return out


def _video_record(header: dict) -> tuple[list[int], int]:
    """The shape and byte count of the header's ``videos`` entry: uint8 pixels, the only tensor."""
    names = sorted(key for key in header if key != "__metadata__")
    if names != ["videos"]:
        raise ValueError(f"videos: expected one tensor, 'videos', in the body (got {names})")
    record = header["videos"]
    dtype, shape = record.get("dtype"), record.get("shape")
    if dtype != "U8":
        raise ValueError(
            f"videos: expected uint8 pixels 0..255 (the wire format), got {dtype}; send "
            "round(videos.clamp(0, 1) * 255) as uint8, as encode_request does"
        )
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"videos: the header's shape is not a list of sizes: {shape!r}")
    size = math.prod(shape)
    if record.get("data_offsets") != [0, size]:
        raise ValueError(f"videos: data_offsets {record.get('data_offsets')} do not fit {shape}")
    return shape, size


def decode_request(
    body: bytes, max_bytes: int, reserve=lambda size: None
) -> tuple[torch.Tensor, list[str], list[dict]]:
    """The videos, prompts and metadata of a request body; a ValueError says what is wrong.

    The body is inflated no further than its safetensors header declares (and never past
    ``max_bytes``), and ``reserve(n)`` is told the bytes the header, then the pixels and their
    float32 copy take, before they are inflated (it raises :class:`ServerBusy` to refuse them).
    """
    inflater = zlib.decompressobj()
    start = _inflate(inflater, 8, body)
    if len(start) < 8:
        raise ValueError("the body is not a zlib-compressed safetensors file (too short)")
    header_size = int.from_bytes(start, "little")
    if 8 + header_size > max_bytes:
        raise ValueError(f"request decompresses to more than {max_bytes} bytes")
    reserve(header_size)
    try:
        header = json.loads(_inflate(inflater, header_size))
    except ValueError as error:
        raise ValueError(f"the safetensors header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    shape, size = _video_record(header)
    if 8 + header_size + size > max_bytes:
        raise ValueError(f"request decompresses to more than {max_bytes} bytes")
    reserve(5 * size)  # the uint8 pixels, then their float32 copy
    data = _inflate(inflater, size)
    if len(data) < size or _inflate(inflater, 1):
        raise ValueError(f"videos: the body does not hold the {size} bytes its header declares")
    metadata_header = header.get("__metadata__") or {}
    prompts = _json_list(metadata_header, "prompts", str)
    metadata = _json_list(metadata_header, "metadata", dict)
    with warnings.catch_warnings():  # read-only bytes: torch only copies from them
        warnings.simplefilter("ignore", UserWarning)
        pixels = torch.frombuffer(data, dtype=torch.uint8) if size else torch.empty(0)
    videos = pixels.view(shape).float().div_(255.0)  # one float32 copy, divided in place
    check_videos(videos, prompts, metadata)  # rank, frames, batch >= 1, one prompt per video
    return videos, prompts, metadata


def _content_length(value: str | None) -> int:
    if value is None or not value.strip().isdigit():
        raise ValueError(f"Content-Length: expected a byte count, got {value!r}")
    return int(value)


class _Handler(BaseHTTPRequestHandler):
    """One connection: ``GET /health`` or ``POST /score`` (HTTP/1.0: one request each).

    The whole request, headers and body, must arrive within ``client_timeout_s`` of the
    connection (a watchdog closes the socket when it has not), so a client that trickles bytes
    cannot hold a slot; the reward's scoring and the reply are not under that deadline.
    """

    def setup(self) -> None:
        self.timeout = self.server.client_timeout_s  # bounds every read and write of this socket
        super().setup()
        self._held = 0  # bytes of the server's request budget this request holds
        self._lock = threading.Lock()
        self._read = False  # the request is in: the deadline no longer applies
        self._watchdog = threading.Timer(self.server.client_timeout_s, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        with self._lock:
            if self._read:
                return
            with contextlib.suppress(OSError):  # wakes the blocked read: it sees the end
                self.connection.shutdown(socket.SHUT_RDWR)

    def _request_read(self) -> None:
        """The request is in: the deadline stops (a reply may take as long as scoring does)."""
        with self._lock:
            self._read = True
        self._watchdog.cancel()

    def _reserve(self, size: int) -> None:
        if not self.server.budget.take(size):
            raise ServerBusy(
                f"the server holds its limit of request memory ({self.server.budget.total} "
                "bytes); retry later"
            )
        self._held += size

    def _release(self, size: int) -> None:
        self.server.budget.give(size)
        self._held -= size

    def finish(self) -> None:
        self._watchdog.cancel()
        self.server.budget.give(self._held)
        self._held = 0
        with contextlib.suppress(OSError):  # a client that left: nothing more to flush
            super().finish()

    def _reply(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        one_line = " ".join(message.split())
        self._reply(status, json.dumps({"error": one_line}).encode(), "application/json")

    def _discard(self, length: int) -> None:
        while length > 0:
            chunk = self.rfile.read(min(length, 2**20))
            if not chunk:
                return
            length -= len(chunk)

    def do_GET(self) -> None:
        self._request_read()
        if self.path != "/health":
            return self._error(404, f"no {self.path}; POST /score or GET /health")
        self._reply(
            200, json.dumps({"reward": self.server.reward.name}).encode(), "application/json"
        )

    def do_POST(self) -> None:
        if self.path != "/score":
            self._request_read()
            return self._error(404, f"no {self.path}; POST /score")
        self.close_connection = True  # one request per connection
        try:
            body = self._body()
            if body is None:
                return None
            videos, prompts, metadata = decode_request(body, self.server.limit, self._reserve)
        except ServerBusy as error:
            return self._error(503, str(error))
        except OSError:  # the client left, or its time ran out: handle_error says so
            raise
        except Exception as error:  # a malformed body: the client's fault, not to be retried
            return self._error(400, f"bad request: {error}")
        del body
        try:
            scores = self.server.reward.evaluate(videos, prompts, metadata, checked_input=True)
        except Exception as error:  # the reward failed: reported, the server keeps serving
            return self._error(500, str(error))
        body = save_tensors({"scores": scores.cpu().contiguous()})
        self._reply(200, body, "application/octet-stream")

    def _body(self) -> bytes | None:
        """The request body, read within the deadline and the budget; None when answered."""
        limit = self.server.limit
        length = _content_length(self.headers.get("Content-Length"))  # ValueError: 400
        if length > limit:
            if length <= 4 * limit:  # read it off the socket, so the client gets the reply
                self._discard(length)
            self._request_read()
            self._error(413, f"request of {length} bytes exceeds {limit}")
            return None
        chunks, arrived = [], 0
        while arrived < length:  # budget taken as bytes arrive: a promise alone holds none
            chunk = self.rfile.read1(min(length - arrived, 2**20))
            if not chunk:  # the client stopped, or the deadline closed the connection
                raise ConnectionAbortedError(f"{arrived} of {length} bytes arrived in time")
            self._reserve(2 * len(chunk))  # the chunks, then the body they are joined into
            chunks.append(chunk)
            arrived += len(chunk)
        self._request_read()
        body = b"".join(chunks)
        del chunks
        self._release(length)
        return body

    def log_message(self, format: str, *args) -> None:  # quiet: one line per failure only
        if len(args) < 2 or str(args[1]) != "200":
            super().log_message(format, *args)


class _Budget:
    """Bytes of request memory (bodies, pixels, their float32 copies) the server may hold at
    once, across connections."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        with self._lock:
            if self.used + size > self.total:
                return False
            self.used += size
            return True

    def give(self, size: int) -> None:
        with self._lock:
            self.used -= size


def _finite_positive(value) -> bool:
    """Whether ``value`` is a real number of seconds a socket timeout takes (finite, > 0)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


class RewardServer(ThreadingHTTPServer):
    """The HTTP server of ``vsa2-rl serve-reward``: binds at construction (so a port in use fails
    before a reward loads), then :meth:`serve` scores with a reward until interrupted.

    At most ``max_connections`` connections are handled at once, each in its own thread; one more
    gets HTTP 503 at once (the client retries it) rather than a queue that grows without bound.
    A connection whose request has not fully arrived ``client_timeout_s`` after it opened is
    dropped. The memory requests take is bounded: a body inflates no further than its header
    declares, and all requests together hold at most ``max_inflight_mb`` (default: 6 x
    ``max_request_mb``, one largest request: its body, its pixels and their float32 copy); a
    request beyond it gets 503.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        max_request_mb: int = 512,
        client_timeout_s: float = 60.0,
        max_connections: int = 32,
        max_inflight_mb: int | None = None,
    ) -> None:
        if not _finite_positive(client_timeout_s):
            from vsa2_rl.config import ConfigError

            raise ConfigError(
                f"--client-timeout-s (client_timeout_s): must be a finite number of seconds "
                f"> 0, got {client_timeout_s!r} (e.g. 60)"
            )
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self.address_family = family  # read by TCPServer.__init__: IPv6 hosts work too
        self.limit = max_request_mb * 2**20
        self.budget = _Budget((max_inflight_mb or 6 * max_request_mb) * 2**20)
        self.client_timeout_s = client_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self.reward = None
        super().__init__((host, port), _Handler)

    def serve(self, reward) -> None:
        """Serves ``reward`` (a :class:`~vsa2_rl.rewards.registry.Reward`) until interrupted."""
        self.reward = reward
        host, port = self.server_address[:2]
        print(f"serving reward {reward.name} on http://{host}:{port}", flush=True)
        try:
            self.serve_forever()
        finally:
            self.server_close()

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            return self._refuse(request)
        super().process_request(request, client_address)  # a thread, which frees the slot

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        """One line for a connection that failed (a client that left, or ran out of time), not
        socketserver's traceback."""
        error = sys.exc_info()[1]
        if not isinstance(error, (OSError, ValueError)):
            return super().handle_error(request, client_address)
        reason = " ".join(str(error).split()) or type(error).__name__
        print(f"{client_address[0]}: connection dropped ({reason})", file=sys.stderr, flush=True)
        return None

    def _refuse(self, request: socket.socket) -> None:
        body = b'{"error": "too many connections; retry later"}'
        head = "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        request.settimeout(1.0)  # the accept loop must not wait on this client
        with contextlib.suppress(OSError):  # a client already gone
            request.sendall(head.encode() + body)
        self.shutdown_request(request)


def _reason(body: bytes) -> str:
    """The server's one-line reason (its JSON ``error``), else the start of the body."""
    text = body.decode(errors="replace")
    try:
        return str(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return text[:500]


class RemoteReward:
    """The client side of ``remote:http://host:port``."""

    def __init__(self, url: str, timeout: float = 120.0, retries: int = 2) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{PREFIX}{url}: expected remote:http://host:port")
        if not _finite_positive(timeout):
            raise ValueError(
                f"{PREFIX}{url}: timeout must be a finite number of seconds > 0, got {timeout!r}"
            )
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"{PREFIX}{url}: retries must be a whole number >= 0, got {retries!r}")
        self.url, self.timeout, self.retries = url.rstrip("/"), timeout, retries

    def _exchange(self, path: str, body: bytes | None) -> tuple[int, bytes]:
        """One attempt: (HTTP status, reply body). Connecting takes at most ``timeout``, and
        then the whole exchange too: a watchdog closes the connection when it runs over, so a
        server that trickles its reply cannot hold the run (a socket timeout bounds one read)."""
        parts = urllib.parse.urlsplit(self.url)
        kind = HTTPSConnection if parts.scheme == "https" else HTTPConnection
        connection = kind(parts.hostname, parts.port, timeout=self.timeout)
        connection.connect()
        sock, expired = connection.sock, threading.Event()  # the response takes the socket over

        def expire() -> None:
            expired.set()
            with contextlib.suppress(OSError):  # wakes the blocked read
                sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(self.timeout, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.request("POST" if body else "GET", parts.path + path, body=body)
            response = connection.getresponse()
            return response.status, response.read()
        except (OSError, HTTPException):
            if expired.is_set():
                raise TimeoutError(f"no whole reply within {self.timeout:g} s") from None
            raise
        finally:
            watchdog.cancel()
            connection.close()

    def _request(self, path: str, body: bytes | None = None) -> bytes:
        last = None
        for attempt in range(self.retries + 1):
            try:
                status, reply = self._exchange(path, body)
            except (OSError, HTTPException) as error:  # refused, reset, timed out, cut short
                last = str(error) or type(error).__name__
            else:
                if status < 300:
                    return reply
                if status < 500:  # the request is wrong: retrying will not help
                    raise RuntimeError(
                        f"{self.url}{path}: HTTP {status} (not retried): {_reason(reply)}"
                    )
                last = f"HTTP {status}: {_reason(reply)}"
            if attempt < self.retries:
                time.sleep(0.2 * 2**attempt)
        raise RuntimeError(f"{self.url}{path}: failed after {self.retries + 1} attempts: {last}")

    def name(self) -> str:
        reply = self._request("/health")
        try:
            name = json.loads(reply)["reward"]
        except (ValueError, KeyError, TypeError):
            name = None
        if not isinstance(name, str) or not name:
            raise RuntimeError(
                f'{self.url}/health: not a vsa2-rl reward server (expected {{"reward": NAME}}, '
                f"got {reply[:80]!r})"
            )
        return name

    def __call__(
        self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        reply = self._request("/score", encode_request(videos, prompts, metadata))
        try:
            scores = load_tensors(reply)["scores"]
        except Exception:  # whatever safetensors makes of bytes that are not its format
            raise RuntimeError(
                f"{self.url}/score: the reply is not a safetensors 'scores' tensor "
                f"({len(reply)} bytes, starting {reply[:40]!r})"
            ) from None
        if scores.shape != (videos.shape[0],):
            raise RuntimeError(
                f"{self.url}/score: {tuple(scores.shape)} scores for a batch of "
                f"{videos.shape[0]} videos"
            )
        return scores.to(videos.device)
