"""Atomic checkpoints (incl. a SIGKILL mid-save), RNG capture, and the EMA of parameters."""

import os
import random
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from vsa2_rl.rl.checkpoint import (
    capture_rng_state,
    checkpoint_step,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    stage_checkpoint,
    verify_checkpoint,
)
from vsa2_rl.rl.ema import EMA


def _draws():
    return (
        random.random(),
        np.random.rand(3).tolist(),
        np.random.randn(),  # exercises numpy's cached-gaussian state
        torch.rand(4).tolist(),
    )


def test_roundtrip_tensors_optimizer_scheduler_rng(tmp_path):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = torch.randn(5, 4)
    model(data).square().sum().backward()
    opt.step()
    sched.step()
    shared = torch.arange(6.0)
    tensors = {
        **model.state_dict(),
        "tied_a": shared,
        "tied_b": shared,  # same storage: safetensors would refuse it as is
        "half": torch.randn(3, dtype=torch.bfloat16),
    }
    np.random.randn()  # leave a cached gaussian in numpy's state
    rng = capture_rng_state()
    expected_draws = _draws()
    path = save_checkpoint(
        tmp_path,
        7,
        {
            "model": tensors,
            "optimizer": opt.state_dict(),
            "lr_schedule": sched.state_dict(),
            "rng": rng,
            "meta_info": {"step": 7, "note": "x", "values": [1.5, None]},
        },
    )
    assert path == tmp_path / "step_7" and (path / "model.safetensors").is_file()
    assert checkpoint_step(path) == 7

    state = load_checkpoint(path)  # weights_only=True loads all of this
    for key, value in tensors.items():
        assert state["model"][key].dtype == value.dtype
        assert torch.equal(state["model"][key], value)
    assert state["meta_info"] == {"step": 7, "note": "x", "values": [1.5, None]}

    # a fresh model/optimizer/scheduler restored from the checkpoint takes the identical next step
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh.load_state_dict({k: v for k, v in state["model"].items() if k[0].isdigit()})
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_opt.load_state_dict(state["optimizer"])
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    fresh_sched.load_state_dict(state["lr_schedule"])
    for m, o, s in ((model, opt, sched), (fresh, fresh_opt, fresh_sched)):
        o.zero_grad()
        m(data).square().sum().backward()
        o.step()
        s.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh_sched.get_last_lr() == sched.get_last_lr()

    _draws()  # move every generator on
    restore_rng_state(state["rng"])
    assert _draws() == expected_draws


def test_find_latest_ignores_temp_and_incomplete_dirs(tmp_path):
    assert find_latest(tmp_path / "missing") is None
    save_checkpoint(tmp_path, 3, {"model": {"w": torch.zeros(2)}})
    # a crashed save: a temp dir holding every file, even a marker, is never a checkpoint
    crashed = tmp_path / ".tmp-step_9-abc123"
    crashed.mkdir()
    (crashed / "COMPLETE").write_text("step 9\n")
    # a step dir without the marker (e.g. copied by hand, interrupted) is ignored too
    (tmp_path / "step_8").mkdir()
    (tmp_path / "step_8" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "notes").mkdir()
    assert find_latest(tmp_path) == tmp_path / "step_3"
    with pytest.raises(ValueError, match="COMPLETE"):
        load_checkpoint(tmp_path / "step_8")
    # the next save removes crashed temp dirs, leaves foreign dirs alone
    save_checkpoint(tmp_path, 4, {"model": {"w": torch.ones(2)}})
    assert not crashed.exists() and (tmp_path / "step_8").exists()
    assert find_latest(tmp_path) == tmp_path / "step_4"


def test_keep_last_pruning_and_resave_same_step(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, {"step": step}, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 40]
    save_checkpoint(tmp_path, 40, {"step": 41})
    assert load_checkpoint(tmp_path / "step_40")["step"] == 41
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_30", "step_40"]


def test_save_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="entry name"):
        save_checkpoint(tmp_path, 1, {"../evil": 1})
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, -1, {"a": 1})
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 1, {"a": 1}, keep_last=0)
    with pytest.raises(ValueError, match="state"):
        save_checkpoint(tmp_path, 1, {})


_KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    import torch
    from vsa2_rl.rl.checkpoint import save_checkpoint

    class Stall:
        # pickled after model.safetensors is already in the temp dir
        def __reduce__(self):
            print("saving", flush=True)
            time.sleep(120)
            return (int, (0,))

    save_checkpoint(sys.argv[1], 1, {"model": {"w": torch.ones(3)}, "step": 1})
    save_checkpoint(sys.argv[1], 2, {"model": {"w": torch.full((3,), 2.0)}, "extra": Stall()})
    """
)


def test_staged_checkpoint_commits_files_written_by_other_processes(tmp_path):
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, {"step": 1})
    staged = stage_checkpoint(root, 2)
    # a staged directory is not a checkpoint yet
    assert find_latest(root).name == "step_1"
    shard = staged / "deepspeed" / "rank1.pt"
    shard.parent.mkdir()
    torch.save({"moments": torch.arange(3.0)}, shard)
    final = save_checkpoint(root, 2, {"step": 2}, staged=staged)
    assert final == root / "step_2" and not staged.exists()
    assert find_latest(root) == final and load_checkpoint(final) == {"step": 2}
    assert torch.equal(torch.load(final / "deepspeed" / "rank1.pt")["moments"], torch.arange(3.0))
    # only a directory staged under the same checkpoints folder is accepted
    elsewhere = stage_checkpoint(tmp_path / "other", 3)
    with pytest.raises(ValueError, match="staged="):
        save_checkpoint(root, 3, {"step": 3}, staged=elsewhere)


@pytest.mark.slow
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "saving"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    temps = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-step_2")]
    assert len(temps) == 1 and (temps[0] / "model.safetensors").is_file()  # killed mid-save
    latest = find_latest(tmp_path)
    assert latest == tmp_path / "step_1"
    state = load_checkpoint(latest)
    assert torch.equal(state["model"]["w"], torch.ones(3)) and state["step"] == 1


def test_ema_update_every_swap_and_state(tmp_path):
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    model.bias.requires_grad_(False)  # frozen parameters are not tracked
    ema = EMA(model, decay=0.9, update_every=2)
    assert list(ema.shadow) == ["weight"]
    start = model.weight.detach().float().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert ema.update() is False  # first call: not an update step
    assert torch.equal(ema.shadow["weight"], start)
    assert ema.update() is True
    expected = 0.9 * start + 0.1 * model.weight.float()
    torch.testing.assert_close(ema.shadow["weight"], expected)
    assert ema.shadow["weight"].dtype == torch.float32

    trained = model.weight.detach().clone()
    with ema.swapped():
        torch.testing.assert_close(model.weight, expected.to(torch.bfloat16))
    assert torch.equal(model.weight, trained)

    path = save_checkpoint(tmp_path, 1, {"ema": ema.state_dict()})
    other = EMA(model, decay=0.5)
    other.load_state_dict(load_checkpoint(path)["ema"])
    assert (other.decay, other.update_every, other.num_calls) == (0.9, 2, 2)
    assert torch.equal(other.shadow["weight"], ema.shadow["weight"])
    with pytest.raises(ValueError, match="missing"):
        EMA(torch.nn.Linear(3, 2)).load_state_dict(ema.state_dict())


def test_ema_decay_warmup(tmp_path):
    """warmup=True (the toy model build's EMA): decay min(decay, (1 + n) / (10 + n)) at the n-th
    update, counted in updates, not calls; saved with the state."""
    param = torch.nn.Parameter(torch.zeros(3))
    ema = EMA([param], decay=0.5, warmup=True, update_every=2)
    expected = 0.0
    for call in range(1, 41):
        with torch.no_grad():
            param.fill_(float(call))
        if call % 2 == 0:
            n = call // 2 - 1
            decay = min(0.5, (1 + n) / (10 + n))  # 0.1, 0.18.., .., then 0.5 from n = 8 on
            expected = decay * expected + (1 - decay) * float(call)
        ema.update()
        torch.testing.assert_close(ema.shadow["0"], torch.full((3,), expected), rtol=1e-6, atol=0)
    assert ema.state_dict()["warmup"] is True
    plain = EMA([param], decay=0.5)
    assert plain.warmup is False
    plain.load_state_dict(ema.state_dict())
    assert plain.warmup is True
    legacy = {k: v for k, v in ema.state_dict().items() if k != "warmup"}  # older checkpoints
    plain.load_state_dict(legacy)
    assert plain.warmup is False


def test_ema_of_parameter_list_and_bad_arguments():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.ones(1))]
    ema = EMA(params, decay=0.5)
    with torch.no_grad():
        params[0].fill_(4.0)
    ema.update()
    assert ema.shadow["0"].tolist() == [2.0, 2.0] and ema.shadow["1"].tolist() == [1.0]
    with pytest.raises(ValueError, match="decay"):
        EMA(params, decay=1.0)
    with pytest.raises(ValueError, match="update_every"):
        EMA(params, update_every=0)
    with pytest.raises(ValueError, match="trainable"):
        EMA([torch.nn.Parameter(torch.zeros(1), requires_grad=False)])


def _damage(path, how):
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # same size, other bytes
        path.write_bytes(bytes(b ^ 0x5A for b in data))


@pytest.mark.parametrize(
    ("file", "how", "problem"),
    [
        ("model.safetensors", "truncate", r"model.safetensors has \d+ bytes, \d+ were written"),
        ("optimizer.pt", "garble", "optimizer.pt does not match the checksum"),
        ("meta.json", "garble", "meta.json is missing or does not match the checksum"),
    ],
)
def test_damaged_newest_checkpoint_falls_back_to_the_newest_whole_one(tmp_path, file, how, problem):
    state = {"model": {"w": torch.arange(64.0)}, "optimizer": {"lr": 0.1, "m": torch.ones(64)}}
    for step in (1, 2):
        save_checkpoint(tmp_path, step, state)
    assert verify_checkpoint(tmp_path / "step_2") is None
    _damage(tmp_path / "step_2" / file, how)
    assert re.search(problem, verify_checkpoint(tmp_path / "step_2"))
    with pytest.warns(UserWarning, match=rf"skipping damaged checkpoints \(step_2: {problem}"):
        assert find_latest(tmp_path) == tmp_path / "step_1"
    with pytest.raises(ValueError, match=rf"step_2 is not a usable checkpoint: {problem}"):
        load_checkpoint(tmp_path / "step_2")
    _damage(tmp_path / "step_1" / "model.safetensors", "truncate")
    with pytest.raises(ValueError, match=r"no checkpoint under .* verifies \(step_2: .*; step_1"):
        find_latest(tmp_path)


def test_files_the_run_did_not_write_and_markers_without_a_checksum_are_refused(tmp_path):
    staged = stage_checkpoint(tmp_path, 1)
    (staged / "deepspeed").mkdir()
    torch.save({"moments": torch.arange(8.0)}, staged / "deepspeed" / "rank0.pt")
    final = save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(2)}}, staged=staged)
    assert verify_checkpoint(final) is None
    torch.save({"planted": 1}, final / "deepspeed" / "rank1.pt")  # unpickled by DeepSpeed
    problem = "deepspeed/rank1.pt was not written with the checkpoint (meta.json does not record"
    assert verify_checkpoint(final).startswith(problem)
    os.remove(final / "deepspeed" / "rank1.pt")
    (final / "COMPLETE").write_text("step 1\n")  # a hand-made marker: meta.json goes unchecked
    assert (
        verify_checkpoint(final) == "COMPLETE carries no meta.json checksum (edited, or not "
        "written by vsa2_rl)"
    )


def test_a_damaged_deepspeed_shard_stops_the_resume_before_deepspeed_reads_it(tmp_path):
    # DeepSpeed unpickles its shards (weights_only=False): they are verified like every file
    staged = stage_checkpoint(tmp_path, 1)
    shard = staged / "deepspeed" / "rank1.pt"
    shard.parent.mkdir(parents=True)
    torch.save({"moments": torch.arange(8.0)}, shard)
    final = save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(2)}}, staged=staged)
    assert verify_checkpoint(final) is None
    _damage(final / "deepspeed" / "rank1.pt", "garble")
    problem = "deepspeed/rank1.pt does not match the checksum recorded when it was written"
    assert verify_checkpoint(final) == problem
    with pytest.raises(ValueError, match=rf"step_1 is not a usable checkpoint: {problem}"):
        load_checkpoint(final)


def _tamper_meta(folder, edit):
    """Rewrites meta.json with ``edit`` applied and the COMPLETE marker's checksum recomputed
    (what a hand who knows the format can do)."""
    import hashlib

    meta = folder / "meta.json"
    meta.write_text(edit(meta.read_text()))
    digest = hashlib.sha256(meta.read_bytes()).hexdigest()
    (folder / "COMPLETE").write_text(f"step 2\nmeta.json sha256 {digest}\n")


def test_a_folder_named_for_a_newer_step_than_it_records_is_skipped(tmp_path):
    import shutil

    for step in (2, 4):
        save_checkpoint(tmp_path, step, {"model": {"w": torch.full((2,), float(step))}})
    shutil.copytree(tmp_path / "step_2", tmp_path / "step_7")  # copied, or misnamed
    problem = "meta.json records step 2 but the folder is named step_7"
    assert problem in verify_checkpoint(tmp_path / "step_7")
    with pytest.warns(UserWarning, match=f"step_7: {problem}"):
        assert find_latest(tmp_path) == tmp_path / "step_4"


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda text: text.replace('"files"', '"filez"'), "has no valid 'files' record"),
        (lambda text: text[:-5], "is not valid JSON"),
        (lambda text: text.replace('"step": 2', '"step": "2"'), "has no valid 'step'"),
        (
            lambda text: text.replace('"model.safetensors"', '"../step_1/model.safetensors"'),
            "records a file outside the checkpoint folder: ../step_1/model.safetensors",
        ),
    ],
)
def test_a_meta_json_rewritten_with_its_checksum_is_refused_naming_it(tmp_path, edit, problem):
    from vsa2_rl.rl.checkpoint import load_latest

    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"model": {"w": torch.full((2,), float(step))}})
    _tamper_meta(tmp_path / "step_2", edit)
    assert problem in verify_checkpoint(tmp_path / "step_2")
    assert str(tmp_path / "step_2" / "meta.json") in verify_checkpoint(tmp_path / "step_2")
    with pytest.warns(UserWarning, match="skipping damaged checkpoints"):
        path, state = load_latest(tmp_path)
    assert path == tmp_path / "step_1" and state["model"]["w"].tolist() == [1.0, 1.0]


class _Planted:
    def __reduce__(self):
        return (print, ("planted",))


def test_a_pickle_planted_with_recomputed_checksums_falls_back_to_the_previous_checkpoint(
    tmp_path,
):
    import hashlib
    import json

    from vsa2_rl.rl.checkpoint import load_latest

    state = {"model": {"w": torch.ones(2)}, "optimizer": {"lr": 0.1}}
    for step in (1, 2):
        save_checkpoint(tmp_path, step, state)
    planted = tmp_path / "step_2" / "optimizer.pt"
    torch.save({"lr": _Planted()}, planted)
    record = {"size": planted.stat().st_size, "sha256": hashlib.sha256(planted.read_bytes())}
    record["sha256"] = record["sha256"].hexdigest()

    def edit(text):
        meta = json.loads(text)
        meta["files"]["optimizer.pt"] = record
        return json.dumps(meta)

    _tamper_meta(tmp_path / "step_2", edit)
    assert verify_checkpoint(tmp_path / "step_2") is None  # the checksums were recomputed
    with pytest.raises(ValueError, match=r"optimizer.pt cannot be loaded \(Weights only load"):
        load_checkpoint(tmp_path / "step_2")
    with pytest.warns(UserWarning, match="step_2: optimizer.pt cannot be loaded"):
        path, restored = load_latest(tmp_path)
    assert path == tmp_path / "step_1" and restored["optimizer"] == {"lr": 0.1}


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["model", "optimizer"])
def test_a_save_that_fills_the_disk_is_one_line_naming_the_file_and_leaves_nothing(tmp_path, entry):
    # a file-size limit (ulimit -f) fails writes as a full disk does; python ignores SIGXFSZ
    script = textwrap.dedent(
        f"""
        import resource, sys, torch
        from vsa2_rl.rl.checkpoint import DiskFull, save_checkpoint
        save_checkpoint(sys.argv[1], 1, {{"model": {{"w": torch.ones(4)}}}})
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))
        big = torch.ones(1_000_000)  # 4 MB
        state = {{"model": {{"w": torch.ones(4)}}, "optimizer": {{"lr": 0.1, "m": torch.ones(4)}}}}
        state["{entry}"] = {{"w": big}} if "{entry}" == "model" else {{"lr": 0.1, "m": big}}
        try:
            save_checkpoint(sys.argv[1], 2, state)
        except DiskFull as error:
            print(error.strerror)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    suffix = "safetensors" if entry == "model" else "pt"
    assert re.match(
        rf"checkpoint: writing \S+/\.tmp-step_2-\S+/{entry}\.{suffix} failed: its disk", line
    )
    assert "it needs about 3.8 MiB" in line and "\n" not in line
    assert sorted(os.listdir(tmp_path)) == ["step_1"]  # the partial save is gone
    assert verify_checkpoint(tmp_path / "step_1") is None


def test_every_checkpoint_file_gets_the_mode_the_umask_gives(tmp_path):
    before = os.umask(0o022)
    try:
        final = save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(2)}, "rng": {"a": 1}})
    finally:
        os.umask(before)
    modes = {path.name: path.stat().st_mode & 0o777 for path in final.iterdir()}
    assert modes == {
        "model.safetensors": 0o644, "rng.pt": 0o644, "meta.json": 0o644, "COMPLETE": 0o644
    }  # fmt: skip


def test_a_checkpoint_removed_after_it_was_found_says_it_is_gone(tmp_path):
    found = save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(2)}})
    save_checkpoint(tmp_path, 2, {"model": {"w": torch.ones(2)}}, keep_last=1)  # a running train
    with pytest.raises(ValueError, match=r"step_1 is not a usable checkpoint: the folder is gone"):
        load_checkpoint(found)


def test_keep_last_neither_counts_nor_deletes_a_folder_named_for_another_step(tmp_path):
    import shutil

    for step in (2, 4):
        save_checkpoint(tmp_path, step, {"model": {"w": torch.full((2,), float(step))}})
    shutil.copytree(tmp_path / "step_2", tmp_path / "step_7")  # a copy under another name
    save_checkpoint(tmp_path, 5, {"model": {"w": torch.ones(2)}}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5", "step_7"]
