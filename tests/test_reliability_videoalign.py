"""The videoalign loader on damaged files: each names the file and the problem in one line."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vsa2_rl.rewards.videoalign import checkpoint_files, load_weights

LORA = {"lora_r": 4, "lora_alpha": 8}


def _folder(tmp_path, config) -> str:
    checkpoint = tmp_path / "reward" / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    (tmp_path / "reward" / "model_config.json").write_text(json.dumps(config))
    torch.save({"rm_head.weight": torch.zeros(3, 4)}, checkpoint / "non_lora_state_dict.pth")
    save_file({"x.lora_A.weight": torch.zeros(2, 4)}, str(checkpoint / "adapter_model.safetensors"))
    return str(tmp_path / "reward")


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.mark.parametrize("config", [[1, 2], {"data_config": []}, "text"])
def test_a_model_config_that_is_no_object_of_sections_is_named(tmp_path, config):
    with pytest.raises(ValueError) as error:
        checkpoint_files(_folder(tmp_path, config), None)
    assert "model_config.json" in _one_line(error) and "JSON object" in str(error.value)


def test_a_model_config_that_is_not_json_is_named(tmp_path):
    folder = _folder(tmp_path, {})
    (tmp_path / "reward" / "model_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"model_config\.json is not valid JSON"):
        checkpoint_files(folder, None)


class _Planted:
    def __reduce__(self):
        return (os.system, ("echo planted",))


def _pth(tmp_path, payload: bytes | None = None, obj=None):
    path = tmp_path / "non_lora_state_dict.pth"
    if payload is not None:
        path.write_bytes(payload)
    else:
        torch.save(obj, path)
    return str(path)


@pytest.mark.parametrize("damage", ["truncated", "planted", "tensor"])
def test_a_damaged_state_dict_names_the_file_and_the_problem(tmp_path, damage):
    if damage == "truncated":
        whole = _pth(tmp_path, obj={"rm_head.weight": torch.zeros(3, 4)})
        path = _pth(tmp_path, Path(whole).read_bytes()[:100])
    elif damage == "planted":
        path = _pth(tmp_path, pickle.dumps({"rm_head.weight": _Planted()}))
    else:
        path = _pth(tmp_path, obj=torch.zeros(3))
    with pytest.raises(ValueError) as error:
        load_weights(torch.nn.Linear(4, 4), path, "unused.safetensors", LORA)
    assert path in _one_line(error)
    assert ("not a state dict" if damage == "tensor" else "cannot be read") in str(error.value)


def test_a_truncated_safetensors_adapter_names_the_file(tmp_path):
    head = _pth(tmp_path, obj={"rm_head.weight": torch.zeros(3, 4)})
    adapter = tmp_path / "adapter_model.safetensors"
    save_file({"weight.lora_A.weight": torch.zeros(2, 4)}, str(adapter))
    adapter.write_bytes(adapter.read_bytes()[:-10])
    with pytest.raises(ValueError) as error:
        load_weights(torch.nn.Linear(4, 4), head, str(adapter), LORA)
    assert str(adapter) in _one_line(error) and "cannot be read" in str(error.value)


def test_a_lora_config_without_its_rank_is_named(tmp_path):
    head = _pth(tmp_path, obj={"rm_head.weight": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="lora_r"):
        load_weights(torch.nn.Linear(4, 4), head, "unused.safetensors", {})


def test_an_adapter_without_its_lora_b_half_is_named(tmp_path):
    head = _pth(tmp_path, obj={"rm_head.weight": torch.zeros(3, 4)})
    adapter = tmp_path / "adapter_model.safetensors"
    save_file({"weight.lora_A.weight": torch.zeros(2, 4)}, str(adapter))
    with pytest.raises(ValueError, match="no lora_B partner"):
        load_weights(torch.nn.Linear(4, 4), head, str(adapter), LORA)
