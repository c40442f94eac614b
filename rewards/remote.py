"""Rewards served over HTTP: ``vsa2-rl serve-reward`` runs any registered reward as a service,
and the reward ``remote:http://host:port`` scores through it (heavy scorers on other machines or
GPUs, as FastVideo's and flow_grpo's reward servers do).

Wire format (no pickle anywhere): a request is ``POST /score`` with a zlib-compressed
safetensors body holding ``videos`` as uint8 ``[B, T, C, H, W]`` (the [0, 1] videos quantised to
255 levels, 4x smaller than float32) and, in the safetensors metadata, ``prompts`` and
``metadata`` as JSON; the reply is a safetensors body with ``scores`` float32 ``[B]``, or a JSON
``{"error": ...}`` with an HTTP error status. ``GET /health`` returns ``{"reward": NAME}``.
Request bodies, compressed and decompressed, are bounded (``max_request_mb``; a larger one gets
HTTP 413, read off the socket first up to 4x the bound so the client sees the reply, and the
connection closed). The server binds 127.0.0.1 unless told otherwise.

The client has a timeout per request and a bounded number of retries (with a short backoff) for
connection failures and server errors; its errors name the reward and the address, and the
trainer's ``rewards.on_error`` policy applies to them like to any reward's failure.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

PREFIX = "remote:"


def encode_request(videos: torch.Tensor, prompts: list[str], metadata: list[dict]) -> bytes:
    pixels = (videos.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    header = {"prompts": json.dumps(list(prompts)), "metadata": json.dumps(list(metadata))}
    return zlib.compress(save_tensors({"videos": pixels.contiguous()}, metadata=header), 1)


def decode_request(body: bytes, max_bytes: int) -> tuple[torch.Tensor, list[str], list[dict]]:
    inflater = zlib.decompressobj()
    raw = inflater.decompress(body, max_bytes)
    if inflater.unconsumed_tail:
        raise ValueError(f"request decompresses to more than {max_bytes} bytes")
    tensors = load_tensors(raw)
    # the safetensors header: an 8-byte little-endian length, then JSON with __metadata__
    header_size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_size]).get("__metadata__", {})
    videos = tensors["videos"].float() / 255.0
    return videos, json.loads(header["prompts"]), json.loads(header["metadata"])


def serve(reward, host: str = "127.0.0.1", port: int = 8000, max_request_mb: int = 512):
    """Serves ``reward`` (a :class:`~vsa2_rl.rewards.registry.Reward`) until interrupted."""
    limit = max_request_mb * 2**20

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            self._reply(status, json.dumps({"error": message}).encode(), "application/json")

        def _discard(self, length: int) -> None:
            while length > 0:
                chunk = self.rfile.read(min(length, 2**20))
                if not chunk:
                    return
                length -= len(chunk)

        def do_GET(self) -> None:
            if self.path != "/health":
                return self._error(404, f"no {self.path}; POST /score or GET /health")
            self._reply(200, json.dumps({"reward": reward.name}).encode(), "application/json")

        def do_POST(self) -> None:
            if self.path != "/score":
                return self._error(404, f"no {self.path}; POST /score")
            length = int(self.headers.get("Content-Length") or 0)
            if length > limit:
                self.close_connection = True
                if length <= 4 * limit:  # read it off the socket, so the client gets the reply
                    self._discard(length)
                return self._error(413, f"request of {length} bytes exceeds {limit}")
            try:
                videos, prompts, metadata = decode_request(self.rfile.read(length), limit)
            except Exception as error:  # a malformed body: the client's fault
                return self._error(400, f"bad request: {error}")
            try:
                scores = reward(videos, prompts, metadata).float().cpu().contiguous()
            except Exception as error:  # the reward failed: reported, the server keeps serving
                return self._error(500, str(error))
            self._reply(200, save_tensors({"scores": scores}), "application/octet-stream")

        def log_message(self, format: str, *args) -> None:  # quiet: one line per failure only
            if args and str(args[1]) not in ("200",):
                super().log_message(format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    print(f"serving reward {reward.name} on http://{host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


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
                detail = error.read().decode(errors="replace")[:500]
                if error.code < 500:  # the request is wrong: retrying will not help
                    raise RuntimeError(f"{self.url}{path}: HTTP {error.code}: {detail}") from None
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
