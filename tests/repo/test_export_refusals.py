"""An export or update that would not verify never replaces the release: the staged repo is
verified before it is swapped in, and names verify would skip or refuse are refused up front."""

from __future__ import annotations

import os

import pytest
import torch
from support.helpers import TINY, synthetic_stage, tiny_encoder

from vip_hub import export_encoder, verify_repo
from vip_hub.errors import VipHubError
from vip_hub.repo.files import update_repo


def _snapshot(folder):
    return {p: (folder / p).read_bytes() for p in sorted(os.listdir(folder))}


def test_update_with_a_hidden_file_does_not_leave_a_repo_that_no_longer_verifies(tiny_repo):
    before = _snapshot(tiny_repo)
    with pytest.raises(VipHubError, match=r"\.notes\.txt"):
        update_repo(tiny_repo, add_files={".notes.txt": b"x\n"})
    assert verify_repo(tiny_repo).ok
    assert _snapshot(tiny_repo) == before


def test_an_overwriting_export_that_would_not_verify_keeps_the_previous_release(tmp_path):
    """A diverged run's weights (NaN) exported with overwrite=True, as training exports, must not
    replace the earlier release with a repo verify rejects."""
    out = export_encoder(
        tmp_path / "repo", tiny_encoder(), TINY, [synthetic_stage()], model_name="x"
    )
    before = _snapshot(out)
    model = tiny_encoder()
    with torch.no_grad():
        model.cls_token[0, 0, 0] = float("nan")
    with pytest.raises(VipHubError, match=r"NaN or infinite values in cls_token"):
        export_encoder(out, model, TINY, [synthetic_stage()], model_name="x", overwrite=True)
    assert verify_repo(out).ok
    assert _snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == ["repo"]  # no staging folder left


def test_update_of_the_working_directory_given_as_dot(tiny_repo, monkeypatch):
    """``update_repo(".")`` from inside the repo staged its copy inside the repo itself
    (``Path(".").parent`` is ``.``) and failed with a bare OSError (EBUSY renaming onto '.')."""
    monkeypatch.chdir(tiny_repo)
    update_repo(".", add_files={"notes.txt": b"hi\n"})
    assert (tiny_repo / "notes.txt").read_bytes() == b"hi\n"
    assert verify_repo(tiny_repo).ok
    assert sorted(os.listdir(tiny_repo.parent)) == [tiny_repo.name]
