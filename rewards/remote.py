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
first up to 4x the bound so the client sees the reply, and the connection closed). The server
binds 127.0.0.1 unless told otherwise, handles at most ``max_connections`` connections at once
(one more gets 503) and drops a connection silent for ``client_timeout_s``.

The client has a timeout per request and a bounded number of retries (with a short backoff) for
connection failures and server errors (5xx); a 4xx is the request's fault and is not retried.
Its errors name the reward, the address and the server's reason, and the trainer's
``rewards.on_error`` policy applies to them like to any reward's failure.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from .registry import check_videos

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


def _wire_videos(tensors: dict) -> torch.Tensor:
    """The wire's ``videos`` (uint8 pixels) as the [0, 1] floats a reward takes."""
    if "videos" not in tensors:
        raise ValueError(f"videos: no 'videos' tensor in the body (got {sorted(tensors)})")
    pixels = tensors["videos"]
    if pixels.dtype != torch.uint8:
        raise ValueError(
            f"videos: expected uint8 pixels 0..255 (the wire format), got {pixels.dtype}; "
            f"send round(videos.clamp(0, 1) * 255) as uint8, as encode_request does"
        )
    return pixels.float() / 255.0


def decode_request(body: bytes, max_bytes: int) -> tuple[torch.Tensor, list[str], list[dict]]:
    """The videos, prompts and metadata of a request body; a ValueError says what is wrong."""
    inflater = zlib.decompressobj()
    raw = inflater.decompress(body, max_bytes)
    if inflater.unconsumed_tail:
        raise ValueError(f"request decompresses to more than {max_bytes} bytes")
    tensors = load_tensors(raw)
    # the safetensors header: an 8-byte little-endian length, then JSON with __metadata__
    header_size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_size]).get("__metadata__") or {}
    videos = _wire_videos(tensors)
    prompts = _json_list(header, "prompts", str)
    metadata = _json_list(header, "metadata", dict)
    check_videos(videos, prompts, metadata)  # rank, frames, batch >= 1, one prompt per video
    return videos, prompts, metadata


def _content_length(value: str | None) -> int:
    if value is None or not value.strip().isdigit():
        raise ValueError(f"Content-Length: expected a byte count, got {value!r}")
    return int(value)


class _Handler(BaseHTTPRequestHandler):
    """One connection: ``GET /health`` or ``POST /score`` (HTTP/1.0: one request each)."""

    def setup(self) -> None:
        self.timeout = self.server.client_timeout_s  # bounds every read and write of this socket
        super().setup()

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
        if self.path != "/health":
            return self._error(404, f"no {self.path}; POST /score or GET /health")
        self._reply(
            200, json.dumps({"reward": self.server.reward.name}).encode(), "application/json"
        )

    def do_POST(self) -> None:
        if self.path != "/score":
            return self._error(404, f"no {self.path}; POST /score")
        limit = self.server.limit
        try:
            length = _content_length(self.headers.get("Content-Length"))
        except ValueError as error:
            self.close_connection = True
            return self._error(400, f"bad request: {error}")
        if length > limit:
            self.close_connection = True
            if length <= 4 * limit:  # read it off the socket, so the client gets the reply
                self._discard(length)
            return self._error(413, f"request of {length} bytes exceeds {limit}")
        try:
            videos, prompts, metadata = decode_request(self.rfile.read(length), limit)
        except TimeoutError:  # a client that stops sending: handle_one_request drops it
            raise
        except Exception as error:  # a malformed body: the client's fault, not to be retried
            return self._error(400, f"bad request: {error}")
        try:
            scores = self.server.reward.evaluate(videos, prompts, metadata, checked_input=True)
        except Exception as error:  # the reward failed: reported, the server keeps serving
            return self._error(500, str(error))
        body = save_tensors({"scores": scores.cpu().contiguous()})
        self._reply(200, body, "application/octet-stream")

    def log_message(self, format: str, *args) -> None:  # quiet: one line per failure only
        if args and str(args[1]) not in ("200",):
            super().log_message(format, *args)


class RewardServer(ThreadingHTTPServer):
    """The HTTP server of ``vsa2-rl serve-reward``: binds at construction (so a port in use fails
    before a reward loads), then :meth:`serve` scores with a reward until interrupted.

    At most ``max_connections`` connections are handled at once, each in its own thread; one more
    gets HTTP 503 at once (the client retries it) rather than a queue that grows without bound.
    A connection that sends nothing, or stops mid-request, for ``client_timeout_s`` is dropped.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        max_request_mb: int = 512,
        client_timeout_s: float = 60.0,
        max_connections: int = 32,
    ) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self.address_family = family  # read by TCPServer.__init__: IPv6 hosts work too
        self.limit = max_request_mb * 2**20
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

    def _refuse(self, request: socket.socket) -> None:
        body = b'{"error": "too many connections; retry later"}'
        head = "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        request.settimeout(1.0)  # the accept loop must not wait on this client
        with contextlib.suppress(OSError):  # a client already gone
            request.sendall(head.encode() + body)
        self.shutdown_request(request)


def _reason(error: urllib.error.HTTPError) -> str:
    """The server's one-line reason (its JSON ``error``), else the start of the body."""
    body = error.read().decode(errors="replace")
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:500]


class RemoteReward:
    """The client side of ``remote:http://host:port``."""

    def __init__(self, url: str, timeout: float = 120.0, retries: int = 2) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{PREFIX}{url}: expected remote:http://host:port")
        if timeout <= 0 or retries < 0:
            raise ValueError(f"{PREFIX}{url}: timeout must be > 0 and retries >= 0")
        self.url, self.timeout, self.retries = url.rstrip("/"), timeout, retries

    def _request(self, path: str, body: bytes | None = None) -> bytes:
        request = urllib.request.Request(
            self.url + path, data=body, method="POST" if body else "GET"
        )
        last = None
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.read()
            except urllib.error.HTTPError as error:
                detail = _reason(error)
                if error.code < 500:  # the request is wrong: retrying will not help
                    raise RuntimeError(
                        f"{self.url}{path}: HTTP {error.code} (not retried): {detail}"
                    ) from None
                last = f"HTTP {error.code}: {detail}"
            except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
                last = str(getattr(error, "reason", error))
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
