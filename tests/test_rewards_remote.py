"""The reward server and its client: a real ``vsa2-rl serve-reward`` process on 127.0.0.1 scores
as the reward does locally (on the 8-bit videos it receives), bounds request sizes, and when it
is killed the client's error names the address and the mixer's on_error policy applies."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import save as save_tensors

from vsa2_rl.rewards import RewardError, RewardMixer, RewardSkip, get_reward
from vsa2_rl.rewards.remote import RemoteReward, encode_request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SERVE = [sys.executable, "-m", "vsa2_rl.cli", "serve-reward"]
ENV = {**os.environ, "PYTHONPATH": os.path.join(REPO, "tests")}


def scaled_brightness(scale=1.0):
    """Served factory: brightness times ``scale``, a number (a string is a TypeError here)."""
    factor = scale + 0.0
    return lambda videos, prompts, metadata: videos.mean(dim=(1, 2, 3, 4)).float() * factor


def weights_from(path):
    """Served factory that loads a file first (a missing one is an OSError here)."""
    with open(path, "rb"):
        return scaled_brightness()


def _ctrl_c_as_in_a_terminal():
    """In the child: SIGINT at its default, as a terminal's command gets it, even when these
    tests run under a shell that ignores it (a background job: ``nohup make test &``)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(*options):
    """A served ``test_trainer:brightness`` on a free port: (process, its URL)."""
    command = [*SERVE, "--port", "0", "--reward", "test_trainer:brightness", *options]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )  # fmt: skip
    line = process.stdout.readline()  # "serving reward NAME on http://127.0.0.1:PORT"
    assert "serving reward brightness on http://127.0.0.1:" in line, line
    return process, line.split(" on ")[1].strip()


@pytest.fixture
def server():
    """A served ``test_trainer:brightness`` (1 MiB requests); yields its URL, kills it after."""
    process, url = _start(
        "--max-request-mb", "1", "--client-timeout-s", "1", "--max-connections", "2"
    )
    yield process, url
    process.kill()
    process.wait()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _exchange(url: str, request: bytes) -> bytes:
    """Sends raw bytes on a new connection; everything the server says until it closes."""
    with _connect(url) as connection:
        connection.sendall(request)
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    return reply


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/") else 0


def _post(body: bytes, length: str | None = None) -> bytes:
    length = str(len(body)) if length is None else length
    return b"POST /score HTTP/1.1\r\nContent-Length: " + length.encode() + b"\r\n\r\n" + body


def _body(videos: torch.Tensor, prompts: str = '["a", "b"]', metadata: str = "[{}, {}]") -> bytes:
    """A request body as the wire format lays it out, with any tensor and any JSON text."""
    header = {"prompts": prompts, "metadata": metadata}
    return zlib.compress(save_tensors({"videos": videos.contiguous()}, metadata=header))


@pytest.mark.slow
def test_a_served_reward_scores_as_the_local_one(server):
    _, url = server
    remote = get_reward(f"remote:{url}", timeout=30)
    assert remote.name == "remote_brightness"
    videos = torch.rand(3, 4, 3, 16, 16)
    received = (videos * 255).round() / 255  # what the 8-bit wire format carries
    local = get_reward("test_trainer:brightness")(received, ["a", "b", "c"])
    torch.testing.assert_close(remote(videos, ["a", "b", "c"]), local, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_the_server_bounds_request_sizes(server):
    _, url = server
    remote = get_reward(f"remote:{url}", timeout=30, retries=0)
    noise = torch.rand(2, 8, 3, 256, 256)  # ~3 MB of incompressible 8-bit pixels
    assert len(encode_request(noise, ["a", "b"], [{}, {}])) > 2**20
    with pytest.raises(Exception, match=r"HTTP 413.*exceeds"):
        remote(noise, ["a", "b"])


@pytest.mark.slow
def test_a_killed_server_is_a_reward_failure_that_on_error_handles(server):
    process, url = server
    mixer = RewardMixer([(f"remote:{url}", 1.0, {"timeout": 5, "retries": 1})], on_error="skip")
    videos = torch.rand(2, 4, 3, 16, 16)
    assert torch.isfinite(mixer(videos, ["a", "b"], [{}, {}]).total).all()
    process.kill()
    process.wait()
    with pytest.raises(RewardSkip, match=rf"remote_brightness.*{url}/score: failed after 2"):
        mixer(videos, ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match=rf"cannot reach the server: {url}/health"):
        get_reward(f"remote:{url}", retries=0)


class _Impostor(BaseHTTPRequestHandler):
    """A server that answers, but not as a reward server does (``replies``: path -> body, set
    on a subclass by the fixture)."""

    def do_GET(self):
        self._reply(self.replies["/health"])

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(self.replies["/score"])

    def _reply(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def impostor():
    """An HTTP server on 127.0.0.1 whose replies the test sets; yields (replies, url)."""
    replies = {"/health": b'{"reward": "fake"}', "/score": b"garbage"}
    handler = type("Handler", (_Impostor,), {"replies": replies})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield replies, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_server_answering_garbage_or_the_wrong_batch_is_a_reward_error(impostor):
    replies, url = impostor
    reward = get_reward(f"remote:{url}", retries=0)
    videos = torch.rand(3, 2, 3, 8, 8)
    with pytest.raises(RewardError, match=rf"remote_fake.*{url}/score: the reply is not"):
        reward(videos, ["a", "b", "c"])
    replies["/score"] = save_tensors({"scores": torch.zeros(2)})
    with pytest.raises(RewardError, match=rf"{url}/score: \(2,\) scores for a batch of 3"):
        reward(videos, ["a", "b", "c"])
    replies["/health"] = b"<html>not here</html>"
    with pytest.raises(ValueError, match=rf"{url}/health: not a vsa2-rl reward server"):
        get_reward(f"remote:{url}", retries=0)


# ---- bounded connections ----------------------------------------------------------------------


@pytest.mark.slow
def test_idle_and_half_sent_connections_are_dropped_after_the_client_timeout(server):
    _, url = server
    idle, partial = _connect(url), _connect(url)
    partial.sendall(_post(b"only the start of the body", length="1000"))
    start = time.monotonic()
    for connection in (idle, partial):
        with connection:
            assert connection.recv(65536) == b""  # closed by the server (10 s socket timeout)
    assert time.monotonic() - start < 8  # --client-timeout-s 1, not the socket's 10 s
    assert _status(_exchange(url, b"GET /health HTTP/1.1\r\n\r\n")) == 200


@pytest.mark.slow
def test_connections_beyond_max_connections_get_503_until_one_frees(server):
    _, url = server
    held = [_connect(url), _connect(url)]  # --max-connections 2, both taken
    time.sleep(0.3)  # let the server accept both
    reply = _exchange(url, b"GET /health HTTP/1.1\r\n\r\n")
    assert _status(reply) == 503 and b"too many connections" in reply
    for connection in held:
        connection.close()
    deadline = time.monotonic() + 5
    while _status(_exchange(url, b"GET /health HTTP/1.1\r\n\r\n")) != 200:
        assert time.monotonic() < deadline, "slots not freed after the clients closed"
        time.sleep(0.1)


# ---- client mistakes: 400, never retried ------------------------------------------------------

PIXELS = torch.randint(0, 256, (2, 3, 3, 8, 8), dtype=torch.uint8)
BAD_REQUESTS = {
    "nan_floats": (_post(_body(torch.full((2, 3, 3, 8, 8), float("nan")))), "expected uint8"),
    "floats_in_0_1": (_post(_body(torch.rand(2, 3, 3, 8, 8))), "expected uint8"),
    "rank_4": (_post(_body(PIXELS[0], '["a", "b", "c"]', "[{}, {}, {}]")), "expected rank 5"),
    "one_frame": (_post(_body(PIXELS[:, :1])), "at least 2 frames"),
    "prompt_count": (_post(_body(PIXELS, '["a"]')), "prompts: expected 2 prompts"),
    "empty_batch": (_post(_body(PIXELS[:0], "[]", "[]")), "need B >= 1"),
    "prompts_a_string": (_post(_body(PIXELS, '"ab"')), "prompts: expected a JSON list"),
    "content_length_abc": (_post(b"", length="abc"), "Content-Length: expected a byte count"),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_client_mistakes_get_400_with_a_one_line_reason(server, case):
    _, url = server
    request, reason = BAD_REQUESTS[case]
    reply = _exchange(url, request)
    assert _status(reply) == 400, reply[:300]
    message = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
    assert reason in message and "\n" not in message, message
    assert _status(_exchange(url, b"GET /health HTTP/1.1\r\n\r\n")) == 200  # still serving


@pytest.mark.slow
def test_the_client_does_not_retry_a_400_and_names_the_reason(server):
    _, url = server
    reward = get_reward(f"remote:{url}", timeout=30, retries=2)
    videos = torch.rand(2, 3, 3, 8, 8)
    with pytest.raises(RewardError) as failure:  # the mixer's path: its input check already ran
        reward.evaluate(videos, ["only one prompt"], checked_input=True)
    message = str(failure.value)
    assert "remote_brightness" in message and f"{url}/score: HTTP 400 (not retried)" in message
    assert "prompts: expected 2 prompts" in message and "attempts" not in message


# ---- serve-reward's arguments: one error line, exit 2 -----------------------------------------

BAD_ARGUMENTS = {
    "max_request_mb_0": (["--max-request-mb", "0"], "--max-request-mb: must be > 0"),
    "client_timeout_0": (["--client-timeout-s", "0"], "--client-timeout-s: must be > 0"),
    "max_connections_0": (["--max-connections", "0"], "--max-connections: must be >= 1"),
    "max_inflight_below_one_request": (
        ["--max-request-mb", "2", "--max-inflight-mb", "11"],
        "--max-inflight-mb: 11 cannot hold one largest request (6 x --max-request-mb = 12)",
    ),
    "kwargs_a_list": (["--kwargs", "[1, 2]"], "--kwargs: expected a JSON object"),
    "port_out_of_range": (["--port", "70000"], "--port: 70000 is not a port"),
    "host_unresolvable": (["--host", "no-such-host.invalid"], "--host: cannot resolve"),
    "kwarg_wrong_type": (
        ["--reward", "test_rewards_remote:scaled_brightness", "--kwargs", '{"scale": "2"}'],
        "--kwargs: the reward 'test_rewards_remote:scaled_brightness' refused them",
    ),
    "kwarg_missing_file": (
        ["--reward", "test_rewards_remote:weights_from", "--kwargs", '{"path": "/no/such.pt"}'],
        "--kwargs: the reward 'test_rewards_remote:weights_from' could not load: ",
    ),
}


def _serve_reward_error(*options) -> str:
    """The one stderr line of a ``serve-reward`` that must refuse its arguments with exit 2."""
    command = [*SERVE, "--reward", "test_trainer:brightness", "--port", "0", *options]
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_serve_reward_arguments_are_one_error_line_and_exit_2(case):
    options, reason = BAD_ARGUMENTS[case]
    assert reason in _serve_reward_error(*options)


@pytest.mark.slow
def test_a_port_in_use_is_refused_before_the_reward_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a reward that cannot load: the port's error shows it was checked first
        line = _serve_reward_error("--port", str(port), "--reward", "no_such_module:reward")
    assert f"--port: {port} is in use on 127.0.0.1" in line


# ---- what one client can hold: time, memory, a traceback --------------------------------------


@pytest.mark.slow
def test_a_client_that_trickles_its_request_is_dropped_at_the_deadline(server):
    import select

    _, url = server  # --client-timeout-s 1: for the whole request, not for each read
    start = time.monotonic()
    with _connect(url) as trickling:
        for byte in _post(b"x" * 50)[:25]:  # one byte every 0.2 s: each read well within 1 s
            if select.select([trickling], [], [], 0)[0]:  # the server closed it
                break
            trickling.sendall(bytes([byte]))
            time.sleep(0.2)
        elapsed = time.monotonic() - start
        assert select.select([trickling], [], [], 0)[0] and trickling.recv(65536) == b""
    assert elapsed < 3, f"the trickling client held its slot for {elapsed:.1f} s"
    assert _status(_exchange(url, b"GET /health HTTP/1.1\r\n\r\n")) == 200


def _request_of(batch: int, frame=(3, 4, 2), trailing: bytes = b"") -> bytes:
    """A zlib body of ``batch`` 2-frame black videos of ``frame`` (C, H, W), then ``trailing``."""
    videos = torch.zeros(batch, 2, *frame, dtype=torch.uint8)
    header = {"prompts": json.dumps(["p"] * batch), "metadata": json.dumps([{}] * batch)}
    return zlib.compress(save_tensors({"videos": videos}, metadata=header) + trailing)


def test_a_body_inflates_no_further_than_its_header_declares():
    from vsa2_rl.rewards.remote import ServerBusy, decode_request

    reserved = []
    bomb = _request_of(2, trailing=bytes(50 * 2**20))  # 50 MiB of zeros behind 96 pixels
    with pytest.raises(ValueError, match="does not hold the 96 bytes its header declares"):
        decode_request(bomb, 64 * 2**20, reserved.append)
    assert reserved[1:] == [5 * 96]  # the header, then the pixels and their float32 copy

    def busy(size):
        if size > 2**20:
            raise ServerBusy("full")

    with pytest.raises(ServerBusy):  # refused before the 4.8 MB of pixels are inflated
        decode_request(_request_of(2, (3, 400, 200)), 64 * 2**20, busy)
    videos, prompts, _ = decode_request(_request_of(2), 2**20)
    assert (
        videos.shape == (2, 2, 3, 4, 2) and videos.dtype == torch.float32 and prompts == ["p"] * 2
    )


def test_requests_beyond_the_memory_in_flight_get_503_until_it_frees():
    from vsa2_rl.rewards.remote import RewardServer

    server = RewardServer("127.0.0.1", 0, max_request_mb=1, client_timeout_s=10, max_inflight_mb=6)
    threading.Thread(target=server.serve, args=(get_reward("test_trainer:brightness"),)).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        holders = [_connect(url) for _ in range(2)]  # each holds ~1 MiB of body, read so far
        for holder in holders:
            holder.sendall(_post(bytes(2**20 - 10), length=str(2**20)))
        time.sleep(0.3)
        request = _post(_request_of(2, (3, 256, 340)))  # ~1 MB of pixels: 5 MB with float32
        reply = _exchange(url, request)
        assert _status(reply) == 503 and b"limit of request memory" in reply
        for holder in holders:
            holder.close()
        time.sleep(0.3)
        assert _status(_exchange(url, request)) == 200
    finally:
        server.shutdown()


def test_connections_that_only_promise_a_large_body_hold_no_memory():
    from vsa2_rl.rewards.remote import RewardServer

    server = RewardServer("127.0.0.1", 0, max_request_mb=1, client_timeout_s=10, max_inflight_mb=6)
    threading.Thread(target=server.serve, args=(get_reward("test_trainer:brightness"),)).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        promises = [_connect(url) for _ in range(8)]  # 8 MiB promised, nothing sent
        for promise in promises:
            promise.sendall(_post(b"", length=str(2**20)))
        time.sleep(0.3)
        assert _status(_exchange(url, _post(_request_of(2, (3, 256, 340))))) == 200
        for promise in promises:
            promise.close()
    finally:
        server.shutdown()


def test_a_client_that_leaves_is_one_log_line(capsys):
    from vsa2_rl.rewards.remote import RewardServer

    server = RewardServer("127.0.0.1", 0)
    try:
        try:
            raise BrokenPipeError(32, "Broken pipe")
        except BrokenPipeError:
            server.handle_error(None, ("127.0.0.1", 5555))
    finally:
        server.server_close()
    assert capsys.readouterr().err == "127.0.0.1: connection dropped ([Errno 32] Broken pipe)\n"


@pytest.mark.slow
def test_ctrl_c_stops_the_server_with_one_line_and_exit_130():
    process, _ = _start()
    process.send_signal(2)  # SIGINT, as Ctrl-C sends
    try:
        _, err = process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == 130
    assert err == "vsa2-rl serve-reward: stopped (Ctrl-C)\n"


def test_a_server_that_trickles_its_reply_is_cut_off_at_the_client_timeout():
    listener = socket.create_server(("127.0.0.1", 0))

    def trickle():  # headers at once, then one byte of the body every 0.2 s
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n")
            for _ in range(40):
                try:
                    connection.sendall(b"x")
                except OSError:
                    return
                time.sleep(0.2)

    threading.Thread(target=trickle, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    remote = RemoteReward(url, timeout=1, retries=0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed after 1 attempts: no whole reply within 1 s"):
        remote(torch.rand(1, 2, 3, 8, 8), ["a"], [{}])
    assert time.monotonic() - start < 3  # not the 8 s the trickle lasts
    listener.close()
