"""Repo content cannot make every view costly (issue 35, point 5): files per commit and a
head's labels file (``HEAD_LABELS``) are capped (413 naming the limit), and a dataset page's
composition is computed once per change of the dataset's releases, under PRV only within its
stage budget. A real server, the real huggingface_hub client."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import pytest
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError
from support.helpers import TINY, synthetic_stage, tiny_encoder, tiny_repo_with_head
from support.live import WRITE_TOKEN, ThreadedServer, settings_for

from vip_hub import Dataset, DPStage, export_encoder
from vip_hub.repo.push import push_repo
from vip_hub.repo_format import HEAD_LABELS, head_file

FILES, LABELS = 14, 2048


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = settings_for(
        tmp_path_factory.mktemp("caps-store"),
        hub={"max_commit_files": FILES, "max_labels_bytes": LABELS, "max_prv_stages": 2},
        inference={"enabled": False},
    )
    with ThreadedServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def published(server, tmp_path_factory) -> str:
    folder = tiny_repo_with_head(tmp_path_factory.mktemp("caps-repo") / "capped")
    push_repo(folder, "up/capped", endpoint=server.url, token=WRITE_TOKEN)
    return "up/capped"


def _api(server: ThreadedServer) -> HfApi:
    return HfApi(endpoint=server.url, token=WRITE_TOKEN)


def test_a_commit_over_the_files_limit_is_refused(server, published):
    api = _api(server)
    held = len(api.list_repo_files(published))
    assert held < FILES
    extra = [
        CommitOperationAdd(f"notes/{i}.txt", f"note {i}".encode()) for i in range(FILES - held + 1)
    ]
    with pytest.raises(HfHubHTTPError) as refused:  # the tree would hold FILES + 1 files
        api.create_commit(published, extra, commit_message="one file too many")
    assert refused.value.response.status_code == 413
    assert f"limit of {FILES} files per commit" in refused.value.response.text
    api.create_commit(published, extra[:-1], commit_message="up to the limit")  # FILES: fine
    many = [CommitOperationAdd(f"more/{i}.txt", b"x") for i in range(FILES + 1)]
    with pytest.raises(HfHubHTTPError) as refused:  # refused as the body streams in
        api.create_commit(published, many, commit_message="too many operations")
    assert refused.value.response.status_code == 413
    assert "hub.max_commit_files" in refused.value.response.text
    assert len(api.list_repo_files(published)) == FILES


def test_a_labels_file_over_its_limit_is_refused(server, published):
    labels = head_file("toy", HEAD_LABELS)
    big = ("[" + ", ".join(f'"label {i:05d}"' for i in range(LABELS // 10)) + "]").encode()
    assert len(big) > LABELS
    with pytest.raises(HfHubHTTPError) as refused:
        _api(server).create_commit(
            published, [CommitOperationAdd(labels, big)], commit_message="many labels"
        )
    assert refused.value.response.status_code == 413
    assert f"{labels} is {len(big)} bytes, over the limit of {LABELS}" in (
        refused.value.response.text
    )


def _compositions(server: ThreadedServer) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(r"^vip_hub_compositions_total (\S+)$", text, re.M).group(1))


def _release(server: ThreadedServer, folder, i: int) -> None:
    """A tiny encoder with one DP stage on ``caps/images``, published as ``up/release-<i>``."""
    stage = DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(name="caps/images", size=1000),
        sample_rate=0.05,
        noise_multiplier=1.0 + i / 2,
        steps=100,
        clipping_norm=1.0,
        noised_tensors={"unreleased:test": 1_000},
    )
    repo = export_encoder(
        folder / f"r{i}", tiny_encoder(i), TINY, [synthetic_stage(), stage], model_name=f"r{i}"
    )
    push_repo(repo, f"up/release-{i}", endpoint=server.url, token=WRITE_TOKEN)


def test_dataset_compositions_are_computed_once_per_change_within_a_budget(server, tmp_path):
    page = f"{server.url}/datasets/caps/images"
    _release(server, tmp_path, 0)
    before = _compositions(server)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        views = list(pool.map(lambda _: httpx.get(page, timeout=120), range(4)))
    views.append(httpx.get(page, timeout=120))
    assert all(v.status_code == 200 for v in views), views[0].text[:500]
    assert len({v.text for v in views}) == 1
    assert _compositions(server) == before + 1  # five views, one computation
    assert "(PRV)" in views[0].text and "Not computed under PRV" not in views[0].text
    # new releases on the dataset are a change: composed again, now over the PRV budget of 2
    # stages (the page says so and shows the other accountants)
    for i in (1, 2):
        _release(server, tmp_path, i)
    html = httpx.get(page, timeout=120).text
    assert _compositions(server) == before + 2
    assert "3 DP stages" in html and "(RDP)" in html and "(PLD)" in html
    assert "(PRV)" not in html
    assert "over this\n    page's budget of 2 stages for the PRV accountant" in html
    httpx.get(page, timeout=120)
    assert _compositions(server) == before + 2
