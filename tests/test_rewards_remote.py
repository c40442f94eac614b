"""The reward server and its client: a real ``vsa2-rl serve-reward`` process on 127.0.0.1 scores
as the reward does locally (on the 8-bit videos it receives), bounds request sizes, and when it
is killed the client's error names the address and the mixer's on_error policy applies."""

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import save as save_tensors

from vsa2_rl.rewards import RewardError, RewardMixer, RewardSkip, get_reward
from vsa2_rl.rewards.remote import encode_request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def server():
    """A served ``test_trainer:brightness`` on a free port; yields its URL, kills it after."""
    command = [sys.executable, "-m", "vsa2_rl.cli", "serve-reward", "--port", "0",
               "--reward", "test_trainer:brightness", "--max-request-mb", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "tests")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = process.stdout.readline()  # "serving reward NAME on http://127.0.0.1:PORT"
    assert "serving reward brightness on http://127.0.0.1:" in line, line
    yield process, line.split(" on ")[1].strip()
    process.kill()
    process.wait()


def test_a_served_reward_scores_as_the_local_one(server):
    _, url = server
    remote = get_reward(f"remote:{url}", timeout=30)
    assert remote.name == "remote_brightness"
    videos = torch.rand(3, 4, 3, 16, 16)
    received = (videos * 255).round() / 255  # what the 8-bit wire format carries
    local = get_reward("test_trainer:brightness")(received, ["a", "b", "c"])
    torch.testing.assert_close(remote(videos, ["a", "b", "c"]), local, rtol=1e-6, atol=1e-6)


def test_the_server_bounds_request_sizes(server):
    _, url = server
    remote = get_reward(f"remote:{url}", timeout=30, retries=0)
    noise = torch.rand(2, 8, 3, 256, 256)  # ~3 MB of incompressible 8-bit pixels
    assert len(encode_request(noise, ["a", "b"], [{}, {}])) > 2**20
    with pytest.raises(Exception, match=r"HTTP 413.*exceeds"):
        remote(noise, ["a", "b"])


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
