"""A DP-Cap repo published to a live vip-hub server: plain timm over hf-hub, /v1/captions,
/v1/zero-shot, the dpcap feature mode over /v1/embeddings, limits, errors, batching, metrics."""

from __future__ import annotations

import base64
import io
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import timm
import torch
from PIL import Image
from support.dpcap import DPCAP, publish_dpcap
from support.helpers import synthetic_stage
from support.live import WRITE_TOKEN, ThreadedServer, settings_for

from vip_hub import export_encoder, load_encoder
from vip_hub.loading import load_captioner
from vip_hub.models.encoders import EncoderSpec, create_encoder
from vip_hub.repo.push import push_repo

VIP = "vip/vip-nano-test"


@pytest.fixture(scope="module")
def dpcap(hub, published, tmp_path_factory) -> Path:
    return publish_dpcap(tmp_path_factory.mktemp("dpcap-service"))


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


IMAGES = [png(i) for i in range(4)]
PIL_IMAGES = [Image.open(io.BytesIO(data)).convert("RGB") for data in IMAGES]


def post(url: str, path: str, payload: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json=payload, timeout=120)


def test_plain_timm_loads_it_through_the_hub(dpcap):
    model = timm.create_model(f"hf-hub:{DPCAP}", pretrained=True).eval()
    local = load_encoder(dpcap)
    x = local.preprocess(PIL_IMAGES[:2])
    with torch.no_grad():
        torch.testing.assert_close(model(x), local.embed(x, "avg"))


def test_captions_and_zero_shot_match_the_library(hub, dpcap):
    local = load_captioner(dpcap, verify=False)
    r = post(
        hub.url,
        "captions",
        {"model": DPCAP, "input": [b64(d) for d in IMAGES[:3]], "max_tokens": 5},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["caption"] for c in body["data"]] == local.caption(PIL_IMAGES[:3], max_tokens=5)
    assert body["usage"] == {"images": 3} and body["revision"] == r.headers["X-Model-Revision"]
    assert body["privacy"]["epsilon"] == 0.0 and "no private data" in body["privacy"]["headline"]
    assert float(r.headers["X-Inference-Ms"]) > 0
    labels = ["dog", "red car", "handwritten digit"]
    r = post(
        hub.url,
        "zero-shot",
        {"model": DPCAP, "input": [b64(d) for d in IMAGES[:2]], "labels": labels, "top_k": 2},
    )
    assert r.status_code == 200, r.text
    want = local.zero_shot(PIL_IMAGES[:2], labels)
    for row, losses in zip(r.json()["data"], want, strict=True):
        order = losses.argsort().tolist()
        assert row["label"] == labels[order[0]] and [x["label"] for x in row["labels"]] == [
            labels[j] for j in order[:2]
        ]
        assert row["labels"][0]["loss"] == pytest.approx(float(losses[order[0]]), abs=1e-4)
        assert row["labels"][0]["score"] == pytest.approx(
            float(torch.softmax(-losses, 0)[order[0]]), abs=1e-4
        )


def test_dpcap_features_over_rest_and_modes_it_does_not_have(hub, dpcap):
    r = post(hub.url, "embeddings", {"model": DPCAP, "input": [b64(IMAGES[0])], "pooling": "dpcap"})
    assert r.status_code == 200, r.text
    want = load_encoder(dpcap, verify=False).embed(PIL_IMAGES[:1], "dpcap")[0]
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], want.numpy(), atol=1e-5)
    r = post(hub.url, "embeddings", {"model": DPCAP, "input": [b64(IMAGES[0])], "pooling": "vip"})
    assert r.status_code == 400 and "'vip' is not available for dpcap-nano" in r.json()["error"]
    r = post(hub.url, "embeddings", {"model": VIP, "input": [b64(IMAGES[0])], "pooling": "dpcap"})
    assert r.status_code == 400 and "'dpcap' is not available for vip-nano" in r.json()["error"]


def test_a_dpcap_repo_without_its_decoder_names_no_server_path(hub, tmp_path):
    """The 400 for the ``dpcap`` mode of a DP-Cap repo without its text decoder named the
    snapshot's folder on the server (``/.../store/snapshots/vip/...``)."""
    spec = EncoderSpec("dpcap-nano", img_size=32)
    torch.manual_seed(0)
    repo = export_encoder(
        tmp_path / "dn", create_encoder(spec).eval(), spec, [synthetic_stage()], model_name="dn"
    )
    push_repo(repo, "vip/dpcap-no-decoder", token=WRITE_TOKEN)
    payload = {"model": "vip/dpcap-no-decoder", "input": [b64(IMAGES[0])], "pooling": "dpcap"}
    r = post(hub.url, "embeddings", payload)
    assert r.status_code == 400 and "this repo has no text_decoder" in r.json()["error"], r.text
    assert "snapshots" not in r.text and str(hub.settings.store) not in r.text, r.text


def test_models_listing_says_which_repos_caption(hub, dpcap):
    one = httpx.get(f"{hub.url}/v1/models/{DPCAP}").json()
    assert one["captions"] is True and list(one["feature_dims"])[:3] == ["dpcap", "avg", "cls"]
    listed = {m["id"]: m["captions"] for m in httpx.get(f"{hub.url}/v1/models").json()["data"]}
    assert listed[DPCAP] is True and listed[VIP] is False


@pytest.mark.parametrize(
    "path,payload,status,fragment",
    [
        ("captions", {"model": VIP, "input": ["IMG0"]}, 400, "vip/vip-nano-test cannot caption"),
        ("zero-shot", {"model": VIP, "input": ["IMG0"], "labels": ["a"]}, 400, "cannot caption"),
        (
            "captions",
            {"model": DPCAP, "input": ["IMG0"], "max_tokens": 30},
            400,
            "max_tokens: 30 is more than the limit of 15",
        ),
        ("captions", {"model": DPCAP, "input": ["IMG0", "bm90IGFuIGltYWdl"]}, 400, "input[1]"),
        ("captions", {"model": DPCAP, "input": []}, 400, "at least one image"),
        (
            "zero-shot",
            {"model": DPCAP, "input": ["IMG0"], "labels": ["dog " * 20]},
            400,
            "longer than 16 tokens",
        ),
        (
            "zero-shot",
            {"model": DPCAP, "input": ["IMG0"], "labels": ["a"] * 101},
            413,
            "101 labels, more than the limit of 100",
        ),
        ("zero-shot", {"model": DPCAP, "input": ["IMG0"], "labels": []}, 422, "labels"),
        # nothing the tokenizer keeps: scored as the prompt alone, it could win
        (
            "zero-shot",
            {"model": DPCAP, "input": ["IMG0"], "labels": ["dog", "\u200b"]},
            400,
            "labels[1]",
        ),
        (
            "zero-shot",
            {"model": DPCAP, "input": ["IMG0"], "labels": ["\x00\x07"]},
            400,
            "labels[0]",
        ),
        (
            "zero-shot",
            {"model": DPCAP, "input": ["IMG0"], "labels": ["\u0301\u0301"]},
            400,
            "is empty",
        ),
        ("captions", {"model": "vip/nothing-here", "input": ["IMG0"]}, 404, "vip/nothing-here"),
    ],
)
def test_bad_requests_are_named(hub, dpcap, path, payload, status, fragment):
    payload = {**payload, "input": [b64(IMAGES[0]) if x == "IMG0" else x for x in payload["input"]]}
    r = post(hub.url, path, payload)
    assert r.status_code == status, r.text
    assert fragment in r.text


def test_zero_shot_reads_special_token_names_as_text(hub, dpcap):
    """A label or prompt spelling a special token is text, as uncased as any other: "[PAD]" is not
    the padding the loss skips, "[SEP]" not the end of the caption."""
    labels = ["[PAD]", "[pad]", "dog [SEP] cat", "dog [sep] cat"]
    losses = []
    for prompt in ("[CLS] a", "[cls] a"):
        r = post(
            hub.url,
            "zero-shot",
            {"model": DPCAP, "input": [b64(IMAGES[0])], "labels": labels, "prompt": prompt},
        )
        assert r.status_code == 200, r.text
        losses.append({x["label"]: x["loss"] for x in r.json()["data"][0]["labels"]})
    assert losses[0] == pytest.approx(losses[1])
    for row in losses:
        assert row["[PAD]"] == pytest.approx(row["[pad]"])
        assert row["dog [SEP] cat"] == pytest.approx(row["dog [sep] cat"])


def test_a_long_image_is_squashed_whole_as_the_library_does(hub, dpcap):
    """DP-Cap's transform squashes the whole image to its square; the service cropped a long
    image's sides first (as it does before a ViP's resize and centre crop, where they are
    dropped anyway), so its features differed from the library's."""
    settings = settings_for(
        hub.settings.store, inference={"max_aspect_ratio": 64, "max_resized_pixels": 2048}
    )
    rng = np.random.default_rng(7)
    wide = Image.fromarray(rng.integers(0, 255, (16, 600, 3), dtype=np.uint8))
    buf = io.BytesIO()
    wide.save(buf, "PNG")
    with ThreadedServer(settings) as server:
        payload = {"model": DPCAP, "input": [b64(buf.getvalue())], "pooling": "dpcap"}
        r = post(server.url, "embeddings", payload)
    assert r.status_code == 200, r.text
    want = load_encoder(dpcap, verify=False).embed([wide], "dpcap")[0]
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], want.numpy(), atol=1e-5)


def test_zero_shot_holds_its_images_x_labels_of_the_queue(hub, dpcap):
    """Zero-shot scores every label for every image with the text decoder: the queue counts a
    request's images x labels, refuses one whose share would not fit (429), and one over the
    whole queue before it is queued (413)."""
    settings = settings_for(
        hub.settings.store, inference={"max_queue_images": 64, "max_labels": 16, "max_wait_ms": 0}
    )
    labels = [f"label {i}" for i in range(16)]
    with ThreadedServer(settings) as server:
        assert post(server.url, "captions", {"model": DPCAP, "input": [b64(IMAGES[0])]}).is_success
        (model,) = [m for m in server.app.state.engine.loaded() if m.repo_id == DPCAP]
        batcher, run = model.batcher, model.batcher._run_batch
        gate, running = threading.Event(), threading.Event()

        def held(items: list) -> None:
            running.set()
            gate.wait(20)
            run(items)

        batcher._run_batch = held
        statuses: dict[str, int] = {}

        def call(name: str, path: str, payload: dict) -> None:
            statuses[name] = post(server.url, path, {"model": DPCAP, **payload}).status_code

        first = threading.Thread(
            target=call, args=("first", "captions", {"input": [b64(IMAGES[0])]})
        )
        first.start()
        assert running.wait(20)  # the worker holds the first request's batch
        zero_shot = threading.Thread(
            target=call,
            args=("zero-shot", "zero-shot", {"input": [b64(x) for x in IMAGES], "labels": labels}),
        )
        zero_shot.start()
        deadline = time.monotonic() + 20
        while batcher.depth == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batcher.depth == 4 * 16  # 4 images x 16 labels: the queue is full
        r = post(server.url, "captions", {"model": DPCAP, "input": [b64(IMAGES[1])]})
        assert r.status_code == 429 and "inference.max_queue_images" in r.text, r.text
        r = post(
            server.url,
            "zero-shot",
            {"model": DPCAP, "input": [b64(x) for x in IMAGES + IMAGES[:1]], "labels": labels},
        )
        assert r.status_code == 413, r.text
        assert "5 images x 16 labels: 80 text-decoder passes, more than the 64" in r.text
        gate.set()
        first.join()
        zero_shot.join()
        assert statuses == {"first": 200, "zero-shot": 200}


def test_concurrent_captions_share_batches_and_keep_their_own_budget(hub, dpcap):
    local = load_captioner(dpcap, verify=False)
    settings = settings_for(
        hub.settings.store, inference={"max_wait_ms": 2000.0, "max_batch_size": 16}
    )
    with ThreadedServer(settings) as server:
        assert (
            post(server.url, "captions", {"model": DPCAP, "input": [b64(IMAGES[0])]}).status_code
            == 200
        )
        results: dict[int, list[str]] = {}
        server.hold_first_batch(DPCAP, 6)  # however the six arrive: at most two batches

        def call(i: int) -> None:
            r = post(
                server.url,
                "captions",
                {"model": DPCAP, "input": [b64(IMAGES[i % 4])], "max_tokens": 1 + i % 3},
            )
            results[i] = [c["caption"] for c in r.json()["data"]]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == list(range(6))
        for i, captions in results.items():
            assert captions == local.caption(PIL_IMAGES[i % 4 : i % 4 + 1], max_tokens=1 + i % 3), i
        text = httpx.get(f"{server.url}/metrics").text
        assert 'vip_hub_requests_total{method="POST",route="/v1/captions",status="200"}' in text
        counts = [
            line for line in text.splitlines() if line.startswith("vip_hub_batch_images_count")
        ]
        assert (
            counts and sum(float(line.split()[-1]) for line in counts) <= 3
        )  # 7 requests: the first alone, then at most two batches
