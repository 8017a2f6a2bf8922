"""A model given as a local path that does not exist fails early with an error that names the
path as missing (patch serve-clear-error-missing-model-path). Upstream passes such a value to the
Hub, which answers "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
from __future__ import annotations

import os

import pytest

from vllm.transformers_utils.local_model_path import check_local_model_path, looks_like_local_path


@pytest.mark.parametrize("rel", ["no-such-model", "a/b/c"])
def test_missing_absolute_path_raises_naming_the_path(tmp_path, rel):
    missing = tmp_path / rel
    with pytest.raises(ValueError, match="does not exist") as e:
        check_local_model_path(str(missing))
    assert repr(str(missing)) in str(e.value)


def test_missing_relative_and_home_paths_raise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in ("./missing-model", "../missing-model-xyz-0", "~/missing-model-xyz-0"):
        with pytest.raises(ValueError, match="does not exist"):
            check_local_model_path(value)


def test_existing_paths_pass(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    check_local_model_path(str(tmp_path / "m"))
    check_local_model_path(tmp_path / "m")  # os.PathLike
    monkeypatch.chdir(tmp_path)
    check_local_model_path("./m")
    check_local_model_path(".")
    monkeypatch.setenv("HOME", str(tmp_path))
    check_local_model_path("~/m")


@pytest.mark.parametrize("value", ["Qwen/Qwen3-0.6B", "gpt2", "s3://bucket/model", None])
def test_repo_ids_and_uris_are_left_to_the_hub(value):
    if value is not None:
        assert not looks_like_local_path(value)
    check_local_model_path(value)  # no error: not a local path


def test_engine_args_hook_rejects_a_missing_model_path(tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    missing = os.path.join(tmp_path, "no-such-model")
    with pytest.raises(ValueError, match="does not exist") as e:
        EngineArgs(model=missing)
    assert missing in str(e.value)


def test_relative_path_under_an_existing_folder_is_local(tmp_path, monkeypatch):
    """`vllm serve models/DeepSeek-V4-Flsh` (a typo) from a directory that has
    models/ must say the path is missing, not ask the Hub for a repo named
    'models/DeepSeek-V4-Flsh'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "DeepSeek-V4-Flash").mkdir(parents=True)
    check_local_model_path("models/DeepSeek-V4-Flash")  # exists: fine
    with pytest.raises(ValueError, match="does not exist") as e:
        check_local_model_path("models/DeepSeek-V4-Flsh")
    assert "'models/DeepSeek-V4-Flsh'" in str(e.value)
    with pytest.raises(ValueError, match="does not exist"):
        check_local_model_path("models/sub/missing")
    # no local 'deepseek-ai' folder: a repo id, left to the Hub
    assert not looks_like_local_path("deepseek-ai/DeepSeek-V4-Flash")
    with pytest.raises(ValueError, match="does not exist"):
        check_local_model_path("x/y/z")  # three parts: never a repo id
