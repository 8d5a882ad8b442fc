"""The inference endpoints against real uvicorn servers on 127.0.0.1."""

import base64
import io
import json
import logging
import os
import re
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import timm
import torch
from PIL import Image
from support.helpers import (
    NEEDS_CUDA,
    TINY,
    dp_stage,
    synthetic_stage,
    tiny_encoder,
    tiny_repo_with_head,
    turned_jpeg,
    wide_grey,
)
from support.live import READ_TOKEN, WRITE_TOKEN, ThreadedServer, settings_for

import vip_hub
from service.app import create_app
from service.inference.models import LoadedModel
from vip_hub import export_encoder
from vip_hub.device import pick_device
from vip_hub.errors import ConfigError
from vip_hub.repo.heads import load_head
from vip_hub.repo.push import push_repo
from vip_hub.repo_format import CONFIG_FILE

MODEL = "vip/vip-nano-test"
RNG = np.random.default_rng(0)


def image(w: int, h: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    img = Image.fromarray(RNG.integers(0, 255, (h, w, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


BOMB = (lambda buf: (Image.new("L", (8000, 8000)).save(buf, "PNG"), buf.getvalue())[1])(
    io.BytesIO()
)
IMAGES = [
    image(40, 30),
    image(64, 64, "JPEG"),
    image(17, 50, "WEBP"),
    image(32, 32, "BMP"),
    image(50, 20, "GIF"),
]


@pytest.fixture(scope="module")
def local(published):
    """The same encoder in this process, on the device the server picked (``auto``)."""
    return vip_hub.load_encoder(published[MODEL], device=pick_device("auto"))


def _pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


@pytest.mark.parametrize("pooling", ["avg", "cls", "vip"])
def test_parity_with_in_process(hub, local, pooling):
    r = httpx.post(
        f"{hub.url}/v1/embeddings",
        timeout=60,
        json={"model": MODEL, "input": [b64(x) for x in IMAGES], "pooling": pooling},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    got = torch.tensor([d["embedding"] for d in body["data"]])
    expected = local.embed([_pil(x) for x in IMAGES], pooling)
    assert (got - expected).abs().max().item() <= 1e-5
    assert [d["index"] for d in body["data"]] == list(range(len(IMAGES)))
    assert body["object"] == "list" and body["model"] == MODEL and body["usage"] == {"images": 5}
    assert body["privacy"]["datasets"] == ["test-images"] and body["privacy"]["accountant"] == "rdp"
    assert (
        body["privacy"]["headline"].startswith("(ε = ")
        and "test-images" in body["privacy"]["headline"]
    )
    assert r.headers["x-model-revision"] == body["revision"] and len(body["revision"]) == 40
    assert float(r.headers["x-privacy-epsilon"]) == pytest.approx(body["privacy"]["epsilon"])
    assert float(r.headers["x-privacy-delta"]) == pytest.approx(body["privacy"]["delta"])
    for h in ("x-queue-ms", "x-preprocess-ms", "x-inference-ms"):
        assert float(r.headers[h]) >= 0


def test_wide_greyscale_and_exif_orientation_embed_as_seen(hub, local):
    """A 16-bit PNG embeds as its 8-bit version and a JPEG as its EXIF orientation shows it, over
    HTTP as in the library."""
    wide, narrow = wide_grey("I;16")
    turned, upright = turned_jpeg()
    r = httpx.post(
        f"{hub.url}/v1/embeddings",
        timeout=60,
        json={"model": MODEL, "input": [b64(wide), b64(turned)], "pooling": "avg"},
    )
    assert r.status_code == 200, r.text
    got = torch.tensor([d["embedding"] for d in r.json()["data"]])
    assert (got - local.embed([narrow, upright])).abs().max().item() <= 1e-5
    assert (got - local.embed([_pil(wide), _pil(turned)])).abs().max().item() <= 1e-5


def test_spatial_pooling_live(hub, local):
    """A spatial mode the repo declares is served as the library computes it, by name; plain timm
    (through HF_ENDPOINT) still loads the repo; an undeclared or unknown mode is a 400 naming the
    declared ones."""
    described = httpx.get(f"{hub.url}/v1/models/{MODEL}").json()
    assert described["feature_dims"]["spatial-b8-g2"] == 768
    for files in (False, True):
        r = (
            httpx.post(
                f"{hub.url}/v1/embeddings/files",
                data={"model": MODEL, "pooling": "spatial-b8-g2"},
                files=[("files", ("a.png", IMAGES[0], "image/png"))],
                timeout=60,
            )
            if files
            else httpx.post(
                f"{hub.url}/v1/embeddings",
                json={
                    "model": MODEL,
                    "input": [b64(x) for x in IMAGES[:2]],
                    "pooling": "spatial-b8-g2",
                },
                timeout=60,
            )
        )
        assert r.status_code == 200, r.text
        body = r.json()
        got = torch.tensor([d["embedding"] for d in body["data"]])
        n = 1 if files else 2
        expected = local.embed([_pil(x) for x in IMAGES[:n]], "spatial-b8-g2")
        assert body["pooling"] == "spatial-b8-g2" and got.shape == (n, 768)
        assert (got - expected).abs().max().item() <= 1e-4
    timm_model = timm.create_model(f"hf-hub:{MODEL}", pretrained=True).eval()
    batch = local.preprocess([_pil(IMAGES[0])])
    with torch.no_grad():
        plain = vip_hub.extract_features(timm_model, batch, "spatial-b8-g2")
    torch.testing.assert_close(plain, local.embed(batch, "spatial-b8-g2"))
    for mode in ("spatial-b5-g2", "max", "spatial-b8-g3"):
        r = httpx.post(
            f"{hub.url}/v1/embeddings",
            json={"model": MODEL, "input": [b64(IMAGES[0])], "pooling": mode},
        )
        assert r.status_code == 400, r.text
        assert "this repo offers vip, avg, cls, spatial-b4-g2, spatial-b8-g2" in r.json()["error"]
    # the raw-pixel mode every repo offers: the preprocessed image, channels averaged
    assert described["feature_dims"]["pixels"] == 32 * 32
    r = httpx.post(
        f"{hub.url}/v1/embeddings",
        json={"model": MODEL, "input": [b64(IMAGES[0])], "pooling": "pixels"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    got = torch.tensor([d["embedding"] for d in r.json()["data"]])
    torch.testing.assert_close(got, local.preprocess([_pil(IMAGES[0])]).mean(1).flatten(1))


def test_encodings_normalize_dimensions_and_data_uris(hub, local):
    data_uri = "data:image/png;base64," + b64(IMAGES[0])
    floats = httpx.post(f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": data_uri}).json()
    packed = httpx.post(
        f"{hub.url}/v1/embeddings",
        json={"model": MODEL, "input": [b64(IMAGES[0])], "encoding_format": "base64"},
    ).json()
    vec = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, floats["data"][0]["embedding"], rtol=0, atol=0)
    short = httpx.post(
        f"{hub.url}/v1/embeddings",
        json={"model": MODEL, "input": [b64(IMAGES[0])], "normalize": True, "dimensions": 16},
    ).json()
    v = np.array(short["data"][0]["embedding"])
    assert v.shape == (16,) and abs(np.linalg.norm(v) - 1) < 1e-5
    ref = np.array(floats["data"][0]["embedding"][:16])
    np.testing.assert_allclose(v, ref / np.linalg.norm(ref), atol=1e-6)
    r = httpx.post(
        f"{hub.url}/v1/embeddings",
        json={"model": MODEL, "input": [b64(IMAGES[0])], "dimensions": 999},
    )
    assert r.status_code == 400 and "dimensions" in r.json()["error"]


def test_multipart_variant(hub, published):
    files = [
        ("files", (f"img{i}.bin", x, "application/octet-stream")) for i, x in enumerate(IMAGES[:3])
    ]
    r = httpx.post(
        f"{hub.url}/v1/embeddings/files",
        data={"model": MODEL, "pooling": "vip"},
        files=files,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    j = httpx.post(
        f"{hub.url}/v1/embeddings",
        json={"model": MODEL, "input": [b64(x) for x in IMAGES[:3]], "pooling": "vip"},
    ).json()
    np.testing.assert_allclose(
        [d["embedding"] for d in r.json()["data"]], [d["embedding"] for d in j["data"]], atol=1e-5
    )
    bad = httpx.post(
        f"{hub.url}/v1/embeddings/files",
        data={"model": MODEL},
        files=[("files", ("a", IMAGES[0], "image/png")), ("files", ("b", b"", "image/png"))],
    )
    assert bad.status_code == 400 and "input[1]: empty image" in bad.json()["error"]


def test_device_setting_is_checked_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        settings_for(tmp_path, inference={"device": "tpu"})
    if not torch.cuda.is_available():
        cuda = settings_for(tmp_path, inference={"device": "cuda"})
        with pytest.raises(
            ConfigError, match="device cuda:0 was asked for, but this machine has 0 CUDA"
        ):
            create_app(cuda)  # what `vip-hub serve` does before it listens
    assert settings_for(tmp_path, inference={"device": "cpu"}).inference.device == "cpu"


@NEEDS_CUDA
def test_cpu_and_cuda_servers_agree(hub, published):
    body = {"model": MODEL, "input": [b64(x) for x in IMAGES], "pooling": "vip"}
    got = {}
    for device in ("cpu", "cuda"):
        with ThreadedServer(
            settings_for(hub.settings.store, inference={"device": device})
        ) as server:
            r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
            assert r.status_code == 200, r.text
            got[device] = torch.tensor([d["embedding"] for d in r.json()["data"]])
    # cuDNN may run the patch-embedding convolution in TF32: agreement to TF32 rounding.
    assert (got["cpu"] - got["cuda"]).abs().max().item() <= 2e-3 * got["cpu"].abs().max().item()


def test_classify(hub, local, published):
    r = httpx.post(
        f"{hub.url}/v1/classify",
        json={"model": MODEL, "head": "toy", "input": [b64(x) for x in IMAGES[:2]], "top_k": 2},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    head, info = load_head(published[MODEL], "toy")
    with torch.no_grad():
        probs = torch.softmax(head(local.embed([_pil(x) for x in IMAGES[:2]], info.pooling)), -1)
    for row, p in zip(body["data"], probs, strict=True):
        top = p.topk(2)
        assert [x["label"] for x in row["labels"]] == [info.labels[i] for i in top.indices]
        np.testing.assert_allclose(
            [x["score"] for x in row["labels"]], top.values.numpy(), atol=1e-5
        )
    privacy = body["privacy"]
    assert privacy["encoder"]["datasets"] == ["test-images"] and privacy["encoder"]["epsilon"] > 0
    assert privacy["encoder"]["unprotected_datasets"] == []
    # the head's summary carries its encoder's guarantee and names the labels used without DP
    assert privacy["head"]["datasets"] == ["test-images"] and privacy["head"][
        "unprotected_datasets"
    ] == ["toy-labels"]
    assert (
        privacy["head"]["epsilon"] is None
        and "NO guarantee for toy-labels" in privacy["head"]["headline"]
    )
    # the headers state what the labels depend on, the head's (none here), not the encoder's
    # 4.04 as they did
    assert r.headers["x-privacy-epsilon"] == "none"
    assert r.headers["x-privacy-delta"] == repr(privacy["head"]["delta"])
    missing = httpx.post(
        f"{hub.url}/v1/classify", json={"model": MODEL, "head": "nope", "input": [b64(IMAGES[0])]}
    )
    assert missing.status_code == 404 and "heads: toy" in missing.json()["error"]


def test_models_listing(hub, published):
    models = httpx.get(f"{hub.url}/v1/models").json()["data"]
    entry = next(m for m in models if m["id"] == MODEL)
    assert (
        entry["feature_dims"]
        == {
            "cls": 192,
            "avg": 192,
            "vip": 1152,
            "spatial-b4-g2": 768,
            "spatial-b8-g2": 768,
            "pixels": 32 * 32,  # every repo's, by its input size
        }
        and entry["arch"] == "vip-nano"
    )
    assert entry["heads"][0]["name"] == "toy" and entry["heads"][0]["labels"] == [
        "red",
        "green",
        "blue",
    ]
    assert entry["heads"][0]["privacy"]["unprotected_datasets"] == ["toy-labels"]
    assert entry["privacy"]["epsilon"] > 0 and entry["privacy"]["datasets"] == ["test-images"]
    one = httpx.get(f"{hub.url}/v1/models/vip/vip-nano-syn").json()
    assert one["privacy"]["epsilon"] == 0.0 and one["privacy"]["private_data"] is False
    assert httpx.get(f"{hub.url}/v1/models/vip/absent").status_code == 404


def test_the_models_listing_pages_through_every_model(hub, published):
    """``/v1/models`` gave the newest ``hub.page_size`` models and no way to reach the others;
    ``limit`` and ``offset`` page through them all, ``has_more`` saying when more follow."""
    everything = httpx.get(f"{hub.url}/v1/models").json()
    assert len(everything["data"]) >= 2 and everything["has_more"] is False
    pages, offset = [], 0
    while True:
        page = httpx.get(f"{hub.url}/v1/models", params={"limit": 1, "offset": offset}).json()
        pages += [m["id"] for m in page["data"]]
        offset += len(page["data"])
        if not page["has_more"]:
            break
    assert pages == [m["id"] for m in everything["data"]]
    for bad in ({"limit": 0}, {"offset": -1}, {"offset": 2**63}):
        assert httpx.get(f"{hub.url}/v1/models", params=bad).status_code == 422


def test_unknown_model_and_revision(hub, published):
    assert (
        httpx.post(
            f"{hub.url}/v1/embeddings", json={"model": "vip/absent", "input": [b64(IMAGES[0])]}
        ).status_code
        == 404
    )
    r = httpx.post(
        f"{hub.url}/v1/embeddings", json={"model": f"{MODEL}@nope", "input": [b64(IMAGES[0])]}
    )
    assert r.status_code == 404 and r.headers["x-error-code"] == "RevisionNotFound"


@pytest.mark.parametrize(
    "payload,status,fragment",
    [
        ({"input": ["aGVsbG8gd29ybGQ="]}, 400, "input[0]: not an image"),
        ({"input": [b64(IMAGES[0]), b64(IMAGES[0][:300])]}, 400, "input[1]: truncated or corrupt"),
        ({"input": [b64(b"%PDF-1.7 not an image")]}, 400, "input[0]: not an image"),
        ({"input": ["!!!"]}, 400, "input[0]: not valid base64"),
        ({"input": ["https://example.com/cat.jpg"]}, 400, "URLs are not fetched"),
        ({"input": [b64(BOMB)]}, 413, "input[0]: 8000x8000 pixels exceeds"),
        ({"input": [b64(IMAGES[0])] * 65}, 413, "more than the limit of 64"),
        ({"input": []}, 400, "at least one image"),
    ],
)
def test_bad_inputs(hub, published, payload, status, fragment):
    r = httpx.post(f"{hub.url}/v1/embeddings", json={"model": MODEL, **payload}, timeout=60)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]
    assert httpx.get(f"{hub.url}/healthz").status_code == 200


def test_malformed_requests(hub, published):
    deep = b'{"model": "vip/vip-nano-test", "input": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = httpx.post(
        f"{hub.url}/v1/embeddings", content=deep, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and "nested deeper" in r.json()["error"]
    r = httpx.post(
        f"{hub.url}/v1/embeddings",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422
    r = httpx.post(f"{hub.url}/v1/embeddings", json={"model": "../../etc", "input": ["x"]})
    assert r.status_code == 422


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("embeddings", f'{{"model": "{MODEL}", "input": "QUFB", "dimensions": NaN}}', "dimensions"),
        (
            "embeddings",
            f'{{"model": "{MODEL}", "input": "QUFB", "dimensions": 1e400}}',
            "dimensions",
        ),
        (
            "classify",
            f'{{"model": "{MODEL}", "head": "toy", "input": "QUFB", "top_k": -Infinity}}',
            "top_k",
        ),
        ("embeddings", f'{{"model": "{MODEL}", "input": "\\ud800"}}', "input"),
        ("embeddings", '{"model": "vip/\\udfff", "input": "QUFB"}', "model"),
        ("zero-shot", f'{{"model": "{MODEL}", "input": "QUFB", "labels": ["\\ud800"]}}', "labels"),
    ],
)
def test_non_finite_numbers_and_lone_surrogates_are_named(hub, published, path, body, field):
    """JSON that Python's parser reads but no JSON can echo (NaN, an infinity, a lone UTF-16
    surrogate) is a 422 naming the field, not a 500 while the error is written."""
    r = httpx.post(
        f"{hub.url}/v1/{path}", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422, r.text
    assert field in [part for error in r.json()["detail"] for part in error["loc"]]


def test_a_422_does_not_echo_megabytes(hub, published):
    """A request refused by its shape (no model) echoes its images cut to a prefix, not whole."""
    image = base64.b64encode(os.urandom(300_000)).decode()
    r = httpx.post(f"{hub.url}/v1/embeddings", json={"input": [image] * 8})
    assert r.status_code == 422, r.text
    assert "model" in [part for error in r.json()["detail"] for part in error["loc"]]
    assert len(r.content) < 10_000 and "400,000 characters" in r.text


def test_a_422_cuts_long_lists_and_objects_it_echoes(hub, published):
    """A request refused by its shape echoes its lists and objects cut to their first items,
    saying how many they held, as it cuts long texts (a list was echoed whole)."""
    r = httpx.post(f"{hub.url}/v1/zero-shot", json={"input": "QUFB", "labels": ["cat"] * 100})
    assert r.status_code == 422, r.text
    (echoed,) = [e["input"] for e in r.json()["detail"] if e["loc"] == ["body", "model"]]
    assert echoed["input"] == "QUFB" and echoed["labels"][-1] == "... (100 items)"
    assert echoed["labels"][:-1] == ["cat"] * (len(echoed["labels"]) - 1)
    assert len(echoed["labels"]) <= 21
    for body, told in (
        ({"tags": ["a"] * 100_000}, "(100,000 items)"),
        ({"meta": {f"k{i}": 1 for i in range(50_000)}}, "(50,000 keys)"),
    ):
        r = httpx.post(f"{hub.url}/api/repos/create", json=body)
        assert r.status_code == 422, r.text
        assert len(r.content) < 10_000 and told in r.text, r.text[:300]


@pytest.fixture(scope="module")
def limited(hub):
    settings = settings_for(
        hub.settings.store,
        inference={
            "max_request_bytes": 300_000,
            "max_image_bytes": 50_000,
            "max_images_per_request": 3,
            "max_queue_images": 4,
            "max_labels": 4,
            "max_batch_size": 2,
            "max_wait_ms": 300.0,
        },
    )
    with ThreadedServer(settings) as server:
        yield server


def test_size_limits(limited, published):
    big = image(200, 200, "BMP")  # ~120 KB: over the per-image limit
    r = httpx.post(
        f"{limited.url}/v1/embeddings", json={"model": MODEL, "input": [b64(IMAGES[0]), b64(big)]}
    )
    assert r.status_code == 413 and "input[1]: image larger than 50000 bytes" in r.json()["error"]
    r = httpx.post(f"{limited.url}/v1/embeddings", json={"model": MODEL, "input": [b64(big)] * 3})
    assert r.status_code == 413 and "request body" in r.json()["error"]
    r = httpx.post(
        f"{limited.url}/v1/embeddings", json={"model": MODEL, "input": [b64(IMAGES[0])] * 4}
    )
    assert r.status_code == 413 and "limit of 3" in r.json()["error"]


def test_overload_gets_429_with_retry_after(limited, published):
    httpx.post(
        f"{limited.url}/v1/embeddings", json={"model": MODEL, "input": [b64(IMAGES[0])]}, timeout=60
    )  # load
    statuses, retry = [], []

    def call() -> None:
        r = httpx.post(
            f"{limited.url}/v1/embeddings",
            json={"model": MODEL, "input": [b64(IMAGES[0])] * 2},
            timeout=60,
        )
        statuses.append(r.status_code)
        if r.status_code == 429:
            retry.append(r.headers.get("retry-after"))

    threads = [threading.Thread(target=call) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
    assert all(r and int(r) >= 1 for r in retry)


def _metric(url: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(rf"^{name}(\{{.*\}})? ([0-9.e+-]+)$", text, re.M)
    }


def test_access_log_line_follows_the_response_with_its_duration(hub, published, caplog):
    from uvicorn.logging import AccessFormatter

    from service.ops import ACCESS_LOGGER, log_config

    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    r = httpx.post(
        f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": [b64(IMAGES[0])]}, timeout=60
    )
    assert r.status_code == 200
    deadline = time.monotonic() + 10  # written once the response has gone out
    while not (
        records := [
            x
            for x in caplog.records
            if x.name == ACCESS_LOGGER and "/v1/embeddings" in x.getMessage()
        ]
    ):
        assert time.monotonic() < deadline, "no access log line"
        time.sleep(0.01)
    line = AccessFormatter(
        fmt=log_config()["formatters"]["vip_hub_access"]["fmt"], use_colors=False
    ).format(records[-1])
    assert re.search(
        r'127\.0\.0\.1:\d+ - "POST /v1/embeddings HTTP/1\.1" 200 OK \d+\.\d ms$', line
    ), line
    assert log_config("warning")["loggers"][ACCESS_LOGGER]["level"] == logging.WARNING


def test_concurrent_clients_share_batches(hub, published):
    settings = settings_for(
        hub.settings.store, inference={"max_wait_ms": 100.0, "max_batch_size": 16}
    )
    with ThreadedServer(settings) as server:
        httpx.post(
            f"{server.url}/v1/embeddings",
            json={"model": MODEL, "input": [b64(IMAGES[0])]},
            timeout=60,
        )
        before = sum(_metric(server.url, "vip_hub_batch_images_count").values())
        server.hold_first_batch(MODEL, 12)  # however the twelve arrive: at most two batches
        results = []

        def call(i: int) -> None:
            r = httpx.post(
                f"{server.url}/v1/embeddings",
                json={"model": MODEL, "input": [b64(IMAGES[i % 5])]},
                timeout=60,
            )
            results.append((i, r.status_code, r.json()["data"][0]["embedding"]))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 12 and all(status == 200 for _, status, _ in results)
        batches = sum(_metric(server.url, "vip_hub_batch_images_count").values()) - before
        assert batches <= 2  # requests were batched together
        text = httpx.get(f"{server.url}/metrics").text
        assert 'vip_hub_requests_total{method="POST",route="/v1/embeddings",status="200"}' in text
        assert "vip_hub_queue_seconds_bucket" in text and "vip_hub_forward_seconds_sum" in text
        # whatever batch each landed in, the same image gives the same embedding
        by_image: dict[int, list[list[float]]] = {}
        for i, _, emb in results:
            by_image.setdefault(i % 5, []).append(emb)
        for embs in by_image.values():
            np.testing.assert_allclose(embs, [embs[0]] * len(embs), atol=1e-5)


def test_concurrent_first_requests_load_a_model_once(hub, tmp_path):
    """N simultaneous first uses of a model share one load: one LoadedModel, one batcher thread,
    which the engine's stop closes."""
    import asyncio

    from service.inference.engine import InferenceEngine
    from service.metrics import Metrics

    repo_id = "load/once"
    commit = push_repo(tiny_repo_with_head(tmp_path / "once", seed=5), repo_id, token=WRITE_TOKEN)
    engine = InferenceEngine(hub.settings.inference, Metrics())

    async def scenario() -> list:
        await engine.start(hub.app.state.store)
        models = await asyncio.gather(*(engine.model(repo_id, commit) for _ in range(8)))
        threads = [t for t in threading.enumerate() if t.name == f"batcher:{models[0].label}"]
        await engine.stop()
        return [models, threads]

    models, threads = asyncio.run(scenario())
    assert all(m is models[0] for m in models) and len(engine.loaded()) == 1
    assert len(threads) == 1 and not threads[0].is_alive()


def test_a_model_evicted_while_its_request_is_decoded_still_answers_it(hub, published, monkeypatch):
    """With one model in memory, loading another evicts the first while one of its requests is
    still being decoded: that request is answered (not 503 "shutting down"), and so is the
    other model's."""
    from service.inference import engine as engine_module

    entered, gate = threading.Event(), threading.Event()
    load_rgb = engine_module.load_rgb

    def held_load_rgb(img, *args):
        if img.width == 41:  # the held request's image
            entered.set()
            gate.wait(30)
        return load_rgb(img, *args)

    settings = settings_for(hub.settings.store, inference={"max_loaded_models": 1})
    with ThreadedServer(settings) as server:
        post = lambda model, data: httpx.post(  # noqa: E731
            f"{server.url}/v1/embeddings", json={"model": model, "input": [b64(data)]}, timeout=60
        )
        assert post(MODEL, IMAGES[0]).status_code == 200  # loaded
        monkeypatch.setattr(engine_module, "load_rgb", held_load_rgb)
        statuses: dict[str, httpx.Response] = {}
        held = threading.Thread(target=lambda: statuses.update(held=post(MODEL, image(41, 30))))
        held.start()
        assert entered.wait(30)  # announced to MODEL's batcher, being decoded
        other = threading.Thread(
            target=lambda: statuses.update(other=post("vip/vip-nano-syn", IMAGES[0]))
        )
        other.start()  # loads the other model, which evicts MODEL
        deadline = time.monotonic() + 30
        while [m.repo_id for m in server.app.state.engine.loaded()] != ["vip/vip-nano-syn"]:
            assert time.monotonic() < deadline, "the other model never loaded"
            time.sleep(0.01)
        gate.set()
        held.join(60)
        other.join(60)
        assert statuses["held"].status_code == 200, statuses["held"].text
        assert statuses["other"].status_code == 200, statuses["other"].text
        deadline = time.monotonic() + 30  # loaded again, once the evicted copy has drained
        while (again := post(MODEL, IMAGES[0])).status_code == 429:
            assert time.monotonic() < deadline, again.text
            time.sleep(0.05)
        assert again.status_code == 200, again.text


def test_each_header_takes_its_own_turn_and_a_decoded_image_is_let_go(hub, published, monkeypatch):
    """A request's headers were all read in one step (Pillow's parse of four crafted 10 MB
    images held the preprocessing thread 12 s while a one-image request waited), and each image
    decoded at full size was held until the request's last one was done (6 requests of four
    4096 x 4096 PNGs held about 1 GB). Each header is now read in its own turn, and each image's
    pixels go once it is transformed."""
    from service.inference import engine as engine_module
    from service.inference.fair_pool import FairPool

    gate, entered, second = threading.Event(), threading.Event(), threading.Event()
    opened: list[int] = []
    decoded: list[Image.Image] = []
    still_held: list[int] = []
    open_image, load_rgb, submit = engine_module.open_image, engine_module.load_rgb, FairPool.submit

    def gated_open(data, *args):
        img = open_image(data, *args)
        if img.width == 41:  # the long request's first image: wait for the short one
            entered.set()
            gate.wait(30)
        opened.append(img.width)
        return img

    def noted_load(img, *args):
        still_held.append(sum(not _closed(earlier) for earlier in decoded))
        decoded.append(img)
        return load_rgb(img, *args)

    def noted_submit(pool, request):
        submit(pool, request)
        if entered.is_set():
            second.set()

    monkeypatch.setattr(engine_module, "open_image", gated_open)
    monkeypatch.setattr(engine_module, "load_rgb", noted_load)
    monkeypatch.setattr(FairPool, "submit", noted_submit)
    post = lambda widths: httpx.post(  # noqa: E731
        f"{hub.url}/v1/embeddings",
        json={"model": MODEL, "input": [b64(image(w, 30)) for w in widths]},
        timeout=60,
    )
    answers: dict[str, httpx.Response] = {}
    long = threading.Thread(target=lambda: answers.update(long=post([41, 42, 43])))
    long.start()
    assert entered.wait(30)
    short = threading.Thread(target=lambda: answers.update(short=post([44])))
    short.start()
    assert second.wait(30)  # the short request is in the ring: let the long one go on
    gate.set()
    long.join(60)
    short.join(60)
    assert answers["long"].status_code == answers["short"].status_code == 200
    assert opened == [41, 44, 42, 43]  # the short request's header took the second turn
    assert still_held == [0, 0, 0, 0]  # no image decoded before another was still held


def _closed(img: Image.Image) -> bool:
    try:
        img.im  # noqa: B018
    except ValueError:  # "Operation on closed image"
        return True
    return False


def _without_series(url: str, model: str) -> str:
    """``/metrics`` once it has no series of ``model`` (an evicted model's go once its batcher
    has stopped, in the background: within 30 s)."""
    deadline = time.monotonic() + 30
    while f'model="{model}@' in (text := httpx.get(f"{url}/metrics", timeout=30).text):
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    return text


def test_an_evicted_models_metric_series_go_with_it(hub, published):
    """Each model's series on ``/metrics`` are labelled by the commit a request named: an
    evicted model's stayed, so requests naming commit after commit grew them without bound."""
    settings = settings_for(hub.settings.store, inference={"max_loaded_models": 1})
    with ThreadedServer(settings) as server:
        for model in (MODEL, "vip/vip-nano-syn"):  # the second evicts the first
            r = httpx.post(
                f"{server.url}/v1/embeddings",
                json={"model": model, "input": [b64(IMAGES[0])]},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        text = _without_series(server.url, MODEL)
        (loaded,) = server.app.state.engine.loaded()
        assert f'model="{loaded.metrics_label}"' in text


def test_a_forward_outliving_its_models_eviction_records_no_series(hub, published, monkeypatch):
    """A batch still running when its model's eviction stops waiting for it
    (``batcher.CLOSE_WAIT_S``) finishes and answers, and records nothing: the evicted model's
    series stay gone instead of coming back with its late recordings."""
    from service.inference import batcher as batcher_module
    from service.inference.models import LoadedModel

    monkeypatch.setattr(batcher_module, "CLOSE_WAIT_S", 0.2)
    entered, gate = threading.Event(), threading.Event()
    features = LoadedModel._run_features

    def held_features(self, items, x, *args):
        if self.repo_id == MODEL:
            entered.set()
            gate.wait(30)
        return features(self, items, x, *args)

    settings = settings_for(hub.settings.store, inference={"max_loaded_models": 1})
    with ThreadedServer(settings) as server:
        post = lambda model, body: httpx.post(  # noqa: E731
            f"{server.url}/v1/embeddings", json={"model": model, **body}, timeout=60
        )
        assert post(MODEL, {"input": [b64(IMAGES[0])]}).status_code == 200  # loaded
        monkeypatch.setattr(LoadedModel, "_run_features", held_features)
        answers: dict[str, httpx.Response] = {}
        held = threading.Thread(
            target=lambda: answers.update(held=post(MODEL, {"input": [b64(IMAGES[0])]}))
        )
        held.start()
        assert entered.wait(30)  # its forward is running
        assert post("vip/vip-nano-syn", {"input": [b64(IMAGES[0])]}).status_code == 200
        assert [m.repo_id for m in server.app.state.engine.loaded()] == ["vip/vip-nano-syn"]
        _without_series(server.url, MODEL)  # the eviction stopped waiting for the forward
        gate.set()
        held.join(60)
        assert answers["held"].status_code == 200, answers["held"].text
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert f'model="{MODEL}@' not in text, text


def test_the_request_that_evicts_a_busy_model_is_not_held_by_it(hub, published, monkeypatch):
    """Loading a model evicts the least recently used one, which finishes its queued work: the
    request whose load evicted it waited for that work (up to 30 s, past its own deadline),
    its model already serving others. The evicted model now drains in the background, its
    forward still answers its request, and while it holds its memory it takes a load's place
    (``inference.max_loaded_models`` bounds loads and draining copies together)."""
    entered, gate = threading.Event(), threading.Event()
    features = LoadedModel._run_features

    def held_features(self, items, x, *args):
        if self.repo_id == MODEL:
            entered.set()
            gate.wait(60)
        return features(self, items, x, *args)

    settings = settings_for(hub.settings.store, inference={"max_loaded_models": 1})
    with ThreadedServer(settings) as server:
        post = lambda model, timeout: httpx.post(  # noqa: E731
            f"{server.url}/v1/embeddings",
            json={"model": model, "input": [b64(IMAGES[0])]},
            timeout=timeout,
        )
        assert post(MODEL, 60).status_code == 200  # loaded
        monkeypatch.setattr(LoadedModel, "_run_features", held_features)
        answers: dict[str, httpx.Response] = {}
        held = threading.Thread(target=lambda: answers.update(held=post(MODEL, 90)))
        held.start()
        assert entered.wait(30)  # its forward is running, and stays so until the gate opens
        try:
            assert post("vip/vip-nano-syn", 20).status_code == 200  # evicts MODEL
            assert held.is_alive()
            # the evicted copy still holds its memory: it takes the one load slot meanwhile
            again = post(MODEL, 20)
            assert again.status_code == 429, again.text
            assert "1 evicted ones finishing their work" in again.json()["error"]
        finally:
            gate.set()
        held.join(60)
        assert answers["held"].status_code == 200, answers["held"].text


def test_an_evicted_model_is_freed_without_waiting_for_the_garbage_collector(hub, tmp_path):
    """An evicted model held its batcher, whose forward pass was the model's own method: that
    cycle kept its weights (a GPU's memory too) until a full collection, which nothing runs, so
    a load after an eviction could run short of memory. A stopped batcher lets go of it."""
    import asyncio
    import gc
    import weakref

    from service.inference.engine import InferenceEngine
    from service.metrics import Metrics

    commits = {
        repo_id: push_repo(
            tiny_repo_with_head(tmp_path / repo_id.replace("/", "-"), seed=seed),
            repo_id,
            token=WRITE_TOKEN,
        )
        for seed, repo_id in enumerate(("load/free-a", "load/free-b"), start=7)
    }
    engine = InferenceEngine(
        hub.settings.inference.model_copy(update={"max_loaded_models": 1}), Metrics()
    )

    async def scenario() -> weakref.ref:
        await engine.start(hub.app.state.store)
        first = weakref.ref(await engine.model("load/free-a", commits["load/free-a"]))
        await engine.model("load/free-b", commits["load/free-b"])  # evicts load/free-a
        await engine.stop()  # its batcher stopped
        return first

    gc.disable()
    try:
        first = asyncio.run(scenario())
        assert first() is None, gc.get_referrers(first())
    finally:
        gc.enable()


def test_stop_waits_for_a_load_under_way_and_ends_the_preloading(hub, tmp_path, monkeypatch):
    """A load still reading the store when the engine stops is waited for (the app closes the
    store after the stop), and what it loaded is closed; a preload waiting for its repo ends."""
    import asyncio

    from service.errors import ShuttingDown
    from service.inference.engine import InferenceEngine
    from service.metrics import Metrics

    repo_id = "load/late"
    commit = push_repo(tiny_repo_with_head(tmp_path / "late", seed=6), repo_id, token=WRITE_TOKEN)
    store = hub.app.state.store
    entered, gate = threading.Event(), threading.Event()
    snapshot = store.snapshot_dir

    def slow_snapshot(*args):
        entered.set()
        gate.wait(30)
        return snapshot(*args)

    monkeypatch.setattr(store, "snapshot_dir", slow_snapshot)
    preloading = hub.settings.inference.model_copy(update={"preload": ["not/yet"]})
    engine = InferenceEngine(preloading, Metrics())

    async def scenario() -> None:
        await engine.start(store)
        load = asyncio.create_task(engine.model(repo_id, commit))
        await asyncio.to_thread(entered.wait, 30)
        stopping = asyncio.create_task(engine.stop())
        await asyncio.sleep(0.3)
        assert not stopping.done()  # the load still reads the store
        gate.set()
        await stopping
        with pytest.raises(ShuttingDown):
            await load
        assert engine._preload_task is not None and engine._preload_task.done()

    asyncio.run(scenario())
    assert engine.loaded() == []


def test_readiness_waits_for_preloaded_models(hub, tmp_path):
    settings = settings_for(hub.settings.store, inference={"preload": ["ready/later"]})
    with ThreadedServer(settings) as server:
        r = httpx.get(f"{server.url}/readyz")
        assert r.status_code == 503 and r.json()["models"]["ready/later"].startswith("waiting")
        assert httpx.get(f"{server.url}/healthz").status_code == 200
        push_repo(
            tiny_repo_with_head(tmp_path / "later"),
            "ready/later",
            endpoint=server.url,
            token=WRITE_TOKEN,
        )
        deadline = time.monotonic() + 60
        while (
            r := httpx.get(f"{server.url}/readyz")
        ).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["models"] == {"ready/later": "ready"}


@pytest.fixture
def slow_batches(monkeypatch):
    """Every batch takes at least 20 ms, so queueing tests hold on any CPU or GPU."""
    run_batch = LoadedModel.run_batch

    def slow(self, items):
        time.sleep(0.02)
        return run_batch(self, items)

    monkeypatch.setattr(LoadedModel, "run_batch", slow)


def test_deadline_and_disconnect(hub, published, slow_batches):
    # One image per batch: the last of 64 queued images waits for 63 batches (> 10 ms).
    settings = settings_for(
        hub.settings.store, inference={"request_timeout_s": 0.01, "max_batch_size": 1}
    )
    with ThreadedServer(settings) as server:
        r = httpx.post(
            f"{server.url}/v1/embeddings",
            json={"model": MODEL, "input": [b64(IMAGES[0])] * 64},
            timeout=60,
        )
        assert r.status_code == 503 and "deadline" in r.json()["error"]
    settings = settings_for(hub.settings.store, inference={"max_batch_size": 1})
    with ThreadedServer(settings) as server:
        httpx.get(f"{server.url}/v1/models/{MODEL}")
        body = json.dumps({"model": MODEL, "input": [b64(IMAGES[0])] * 64}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        deadline = time.monotonic() + 60  # wait until it is decoded and queued
        while not sum(_metric(server.url, "vip_hub_preprocess_seconds_count").values()):
            assert time.monotonic() < deadline, "the request never reached the server"
            time.sleep(0.005)
        sock.close()  # gone while most of its 64 one-image batches (>= 1.28 s) are still queued
        # One image queued behind them: once it is answered, the worker is past all of them.
        r = httpx.post(
            f"{server.url}/v1/embeddings",
            json={"model": MODEL, "input": [b64(IMAGES[0])]},
            timeout=60,
        )
        assert r.status_code == 200
        batches = sum(_metric(server.url, "vip_hub_batch_images_count").values())
        assert batches - 1 < 64  # the rest of the 64 was dropped


def test_shutdown_drains_in_flight(hub, published):
    # a deadline no loaded machine reaches: 256 one-image forward passes under a busy CPU took
    # past the default 30 s, and a request past its deadline is a 503 however the drain went
    inference = {"max_batch_size": 1, "request_timeout_s": 600}
    settings = settings_for(hub.settings.store, inference=inference)
    statuses: list[int] = []
    with ThreadedServer(settings) as server:  # leaving the block shuts the server down
        httpx.post(
            f"{server.url}/v1/embeddings",
            json={"model": MODEL, "input": [b64(IMAGES[0])]},
            timeout=60,
        )
        preprocessed = sum(_metric(server.url, "vip_hub_preprocess_seconds_count").values())

        def call() -> None:  # 64 one-image batches each: 256 forward passes queued in all
            statuses.append(
                httpx.post(
                    f"{server.url}/v1/embeddings",
                    json={"model": MODEL, "input": [b64(IMAGES[1])] * 64},
                    timeout=60,
                ).status_code
            )

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        deadline = (
            time.monotonic() + 30
        )  # stop once all four requests are in (preprocessed, queued)
        while (
            sum(_metric(server.url, "vip_hub_preprocess_seconds_count").values()) < preprocessed + 4
        ):
            assert time.monotonic() < deadline, "the requests never reached the server"
            time.sleep(0.005)
    for t in threads:
        t.join()
    assert statuses == [200] * 4


def test_auth_for_inference(hub, published, tmp_path):
    push_repo(
        tiny_repo_with_head(tmp_path / "priv"), "secret/model", token=WRITE_TOKEN, private=True
    )
    payload = {"model": "secret/model", "input": [b64(IMAGES[0])]}
    assert httpx.post(f"{hub.url}/v1/embeddings", json=payload).status_code == 404
    ok = httpx.post(
        f"{hub.url}/v1/embeddings", json=payload, headers={"Authorization": f"Bearer {READ_TOKEN}"}
    )
    assert ok.status_code == 200
    settings = settings_for(hub.settings.store, auth={"protect_inference": True})
    with ThreadedServer(settings) as server:
        r = httpx.post(
            f"{server.url}/v1/embeddings", json={"model": MODEL, "input": [b64(IMAGES[0])]}
        )
        assert r.status_code == 401
        r = httpx.post(
            f"{server.url}/v1/embeddings",
            json={"model": MODEL, "input": [b64(IMAGES[0])]},
            headers={"Authorization": f"Bearer {READ_TOKEN}"},
            timeout=60,
        )
        assert r.status_code == 200


def test_a_caveat_travels_in_the_headers(hub, tmp_path):
    """A stage accounted under Poisson sampling it did not use (a shuffled import) makes the
    summary carry a caveat, which every place that prints an epsilon prints with it: the
    ``X-Privacy-*`` headers printed the epsilon alone."""
    shuffled = dp_stage().model_copy(update={"sampling": "shuffle"})
    repo = export_encoder(
        tmp_path / "shuffled", tiny_encoder(), TINY, [synthetic_stage(), shuffled], model_name="s"
    )
    push_repo(repo, "vip/shuffled", token=WRITE_TOKEN)
    r = httpx.post(
        f"{hub.url}/v1/embeddings", json={"model": "vip/shuffled", "input": [b64(IMAGES[0])]}
    )
    assert r.status_code == 200, r.text
    caveat = r.json()["privacy"]["caveat"]
    assert caveat and "Poisson" in caveat
    assert "assuming Poisson sampling" in r.headers["x-privacy-caveat"], r.headers
    plain = httpx.post(f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": [b64(IMAGES[0])]})
    assert "x-privacy-caveat" not in plain.headers


def test_the_openai_client_with_its_optional_fields(hub, local):
    """The OpenAI client's ``user`` (an end-user identifier) was refused with 422 (extra fields
    are forbidden); it is accepted and not kept."""
    client = openai.OpenAI(base_url=f"{hub.url}/v1", api_key="EMPTY", timeout=120)
    got = client.embeddings.create(model=MODEL, input=[b64(IMAGES[0])], user="alice")
    expected = local.embed([_pil(IMAGES[0])], "avg")[0]
    np.testing.assert_allclose(got.data[0].embedding, expected.numpy(), atol=1e-5)


def test_the_index_is_read_off_the_event_loop(hub, published):
    """An inference request looked its repo up in the index on the event loop (PostgreSQL's:
    a network round trip, or a wait for a pool's connection): while it waited, the server
    answered nothing, ``/healthz`` included."""
    answer = hub.answers_while_waiting(
        hub.app.state.store,
        "get_repo",
        lambda: httpx.post(
            f"{hub.url}/v1/embeddings",
            json={"model": MODEL, "input": [b64(IMAGES[0])]},
            timeout=120,
        ),
    )
    assert answer.status_code == 200, answer.text


def test_a_model_that_fails_to_load_names_no_server_folder(hub, published, monkeypatch):
    """A load's error (a verification problem, a missing file) named the store's snapshot
    folder on the server, in the 4xx and in ``/readyz``: it names the repo and commit. The
    failure is kept for ``FAILED_LOAD_S``: each request naming the broken commit loaded (and
    verified) it again."""
    from service.inference import engine

    loads = []

    def fails(repo_id, commit, folder, *args):
        loads.append(commit)
        raise ConfigError(f"{folder}/{CONFIG_FILE}: not what its ledger binds")

    push_repo(published[MODEL], "vip/load-fails", token=WRITE_TOKEN)  # not loaded yet
    monkeypatch.setattr(engine.LoadedModel, "load", staticmethod(fails))
    payload = {"model": "vip/load-fails", "input": [b64(IMAGES[0])]}
    answers = [httpx.post(f"{hub.url}/v1/embeddings", json=payload) for _ in range(3)]
    for r in answers:
        assert r.status_code == 400 and "vip/load-fails@" in r.json()["error"], r.text
        assert str(hub.settings.store) not in r.text and "snapshots" not in r.text, r.text
    assert len({r.json()["error"] for r in answers}) == 1 and len(loads) == 1
    monkeypatch.setattr(engine, "FAILED_LOAD_S", 0.0)  # its time over: loaded again
    assert httpx.post(f"{hub.url}/v1/embeddings", json=payload).status_code == 400
    assert len(loads) == 2


def test_models_loading_at_once_are_bounded(published, tmp_path, monkeypatch):
    """Anyone may name any commit of a public repo, each a full load: loads of distinct
    commits ran at once without bound, each holding its model in memory until its eviction.
    One more than ``max_loaded_models`` loading at once is answered 429."""
    from service.inference import engine

    loading, release = threading.Event(), threading.Event()
    real = engine.LoadedModel.load

    def slow(*args):
        loading.set()
        release.wait(60)
        return real(*args)

    monkeypatch.setattr(engine.LoadedModel, "load", staticmethod(slow))
    settings = settings_for(tmp_path / "store", inference={"max_loaded_models": 1})
    with ThreadedServer(settings) as server:
        for name in ("one", "two"):
            push_repo(published[MODEL], f"vip/{name}", endpoint=server.url, token=WRITE_TOKEN)
        answers: list[httpx.Response] = []

        def embed(name: str) -> httpx.Response:
            payload = {"model": f"vip/{name}", "input": [b64(IMAGES[0])]}
            return httpx.post(f"{server.url}/v1/embeddings", json=payload, timeout=120)

        first = threading.Thread(target=lambda: answers.append(embed("one")))
        first.start()
        assert loading.wait(60)
        second = embed("two")
        assert second.status_code == 429 and "models are loading" in second.json()["error"]
        assert second.headers["retry-after"] == "1"
        release.set()
        first.join(120)
        assert answers[0].status_code == 200, answers[0].text
        assert embed("two").status_code == 200  # its turn: one in memory, the other evicted
