"""The dataset page and the rankings no publisher can bend: one delta the hub fixes, each stage's
epsilon recomputed from (sigma, q, T), a stage counted once however many repos carry it (its
training run's random id), and stages outside the dataset name's namespace shown apart. Against
a live server, with releases published through `vip-hub push`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant
from support.helpers import TINY, synthetic_stage, tiny_encoder
from support.live import WRITE_TOKEN

from service.store import AddFile, CommitRecord, HubStore
from vip_hub import Dataset, DPStage, export_encoder
from vip_hub.privacy.ledger import new_run_id
from vip_hub.repo.push import push_repo
from vip_hub.repo.verify import repo_files
from vip_hub.repo_format import CARD_LEDGER_KEY

N = 10_000
SIGMA, Q, STEPS = 1.0, 0.01, 500
"""At delta 1e-5 about epsilon 1.65 (RDP); at delta 0.1 about 0.18."""


def shown_up(shown: float, eps: float) -> bool:
    """The page shows ``eps`` with 2 decimals, rounded up (a claim shown stays an upper bound)."""
    return eps - 1e-9 <= shown <= eps + 0.01 + 1e-9


def stage(dataset: str, run_id: str | None, delta: float | None = None) -> DPStage:
    """The mechanism on ``dataset`` (each test its own, in the namespace ``pages``, an
    organisation the test writer belongs to)."""
    return DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(name=dataset, size=N),
        sample_rate=Q,
        noise_multiplier=SIGMA,
        steps=STEPS,
        clipping_norm=1.0,
        noised_tensors={"unreleased:test": 1_000},
        delta=delta,
        run_id=run_id,
    )


def publish(
    tmp_path: Path, repo_id: str, dp: DPStage, seed: int = 0, private: bool = False
) -> None:
    folder = export_encoder(
        tmp_path / repo_id.replace("/", "--"),
        tiny_encoder(seed),
        TINY,
        [synthetic_stage(), dp],
        model_name=repo_id.split("/")[1],
    )
    push_repo(folder, repo_id, token=WRITE_TOKEN, private=private)


def rdp_epsilon(runs: int, delta: float = 1e-5) -> float:
    """``runs`` independent copies of the mechanism composed, by dp_accounting (not our code)."""
    acc = RdpAccountant()
    event = dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(SIGMA))
    for _ in range(runs):
        acc.compose(event, STEPS)
    return acc.get_epsilon(delta)


def owner_figure(url: str, dataset: str) -> tuple[float, str]:
    """The owner's composed RDP epsilon and delta, as ``dataset``'s page states them."""
    page = httpx.get(f"{url}/datasets/{dataset}", timeout=60)
    assert page.status_code == 200, page.text
    headline = page.text.split('id="owner-composition"')[1].split("</p>")[0]
    eps = float(headline.split("ε = ")[1].split(" (RDP)")[0])
    return eps, headline.split("at δ = ")[1].split("<")[0].strip()


def model_ids(url: str, **params: object) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/api/models", params=params, timeout=60).json()}


def test_a_copy_at_a_large_delta_neither_bends_the_page_nor_passes_max_epsilon(
    hub, tmp_path: Path
) -> None:
    """The attack of issue 34.3: a copy of a real release restated at delta 0.1 (its epsilon
    recomputed, so it verifies) must not lower the dataset page's figure, be counted again, or
    pass ``max_epsilon`` below the release's epsilon at the hub's delta."""
    name = "pages/faces"
    real = stage(name, new_run_id())
    publish(tmp_path, "pages/faces-encoder", real)
    before, delta = owner_figure(hub.url, name)
    assert delta == "1e-05"
    assert shown_up(before, rdp_epsilon(1))

    copy = stage(name, real.run_id, delta=0.1)
    assert copy.epsilon < 0.5 < real.epsilon  # the copy verifies: its epsilon follows at 0.1
    publish(tmp_path, "pages/faces-copy", copy)  # in the owner's namespace
    publish(tmp_path, "other/faces-copy", copy)  # and outside it
    assert owner_figure(hub.url, name) == (before, "1e-05")  # one stage, at the hub's delta

    cheap = model_ids(hub.url, max_epsilon=0.5)
    assert not cheap & {"pages/faces-encoder", "pages/faces-copy", "other/faces-copy"}
    listed = {
        m["id"]: m for m in httpx.get(f"{hub.url}/api/models", params={"sort": "epsilon"}).json()
    }
    for repo in ("pages/faces-encoder", "pages/faces-copy", "other/faces-copy"):
        assert listed[repo]["vip_hub"]["epsilon"] == pytest.approx(real.epsilon, abs=1e-6), repo
        assert listed[repo]["vip_hub"]["delta"] == 1e-5 + real.truncation_delta, repo
    index = httpx.get(hub.url + "/", params={"max_epsilon": "0.5"}).text
    assert "faces-copy" not in index

    page = httpx.get(f"{hub.url}/datasets/{name}", timeout=60).text
    assert "weak δ</span>" in page  # the copies state delta 0.1 > 1/(10n)
    assert "above 1/(10n)" in httpx.get(f"{hub.url}/pages/faces-copy", timeout=60).text
    assert "above 1/(10n)" not in httpx.get(f"{hub.url}/pages/faces-encoder", timeout=60).text


def test_independent_runs_count_twice_and_copies_once(hub, tmp_path: Path) -> None:
    """Two runs with identical settings are two stages (their random run ids differ); a release
    trained further or copied carries its stage's id and counts once."""
    name = "pages/twice"
    first, second = stage(name, new_run_id()), stage(name, new_run_id())
    publish(tmp_path, "pages/twice-1", first)
    publish(tmp_path, "pages/twice-2", second, seed=1)
    publish(tmp_path, "pages/twice-1-copy", first, seed=2)
    eps, _ = owner_figure(hub.url, name)
    assert shown_up(eps, rdp_epsilon(2))
    assert eps < rdp_epsilon(3) - 0.1


def test_stages_outside_the_dataset_namespace_are_shown_apart(hub, tmp_path: Path) -> None:
    """Another publisher's stages on the name neither raise nor lower the owner's figure; they are
    listed in their own section, with what everything together would compose to."""
    name = "pages/apart"
    publish(tmp_path, "pages/apart", stage(name, new_run_id()))
    alone, _ = owner_figure(hub.url, name)
    for i in range(2):
        publish(tmp_path, f"other/apart-{i}", stage(name, new_run_id()), seed=i + 1)
    assert owner_figure(hub.url, name)[0] == alone
    page = httpx.get(f"{hub.url}/datasets/{name}", timeout=60).text
    owners, others = page.split('id="other-publishers"')
    assert "/other/apart-0" not in owners and "/pages/apart" in owners
    assert "/other/apart-0" in others and "/other/apart-1" in others
    together = float(others.split("ε = ")[1].split(" (RDP)")[0])
    assert shown_up(together, rdp_epsilon(3))


def test_names_that_read_alike_are_one_dataset_on_its_page(hub, tmp_path: Path) -> None:
    """Releases naming one dataset in spellings that read alike (case, a Cyrillic look-alike)
    compose on one page, whichever spelling is asked for; a private repo's spelling shows nowhere
    and adds nothing."""
    publish(tmp_path, "pages/alike-1", stage("pages/alike", new_run_id()))
    publish(tmp_path, "pages/alike-2", stage("pages/Alike", new_run_id()), seed=1)
    publish(tmp_path, "pages/alike-3", stage("pages/\u0430like", new_run_id()), seed=2)
    publish(tmp_path, "pages/alike-4", stage("pages/ALIKE", new_run_id()), seed=3, private=True)
    for asked in ("pages/alike", "pages/Alike", "Pages/ALike"):
        eps, _ = owner_figure(hub.url, asked)
        assert shown_up(eps, rdp_epsilon(3)), asked
        page = httpx.get(f"{hub.url}/datasets/{asked}", timeout=60).text
        spellings = page.split('id="spellings"')[1].split("</p>")[0]
        assert all(f"<code>{n}</code>" in spellings for n in ("pages/alike", "pages/Alike"))
        assert "<code>pages/\u0430like</code>" in spellings
        assert "ALIKE" not in page and "alike-4" not in page
    # another publisher's spelling is listed apart, as the exact name's would be
    publish(tmp_path, "other/alike", stage("pages/alike", new_run_id()), seed=4)
    others = httpx.get(f"{hub.url}/datasets/pages/Alike", timeout=60).text
    assert "/other/alike" in others.split('id="other-publishers"')[1]


def test_the_page_composes_every_release_and_computes_once_per_dataset(
    hub, tmp_path: Path, monkeypatch
) -> None:
    """The page read the first 1,000 releases only (its ε understated past them), and computed
    its composition again for each spelling of the URL that reads as the same dataset (a way to
    make every request recompute). It now reads page after page, and keys the composition on
    the dataset's identity."""
    import service.pages.routes as routes

    monkeypatch.setattr(routes, "_PAGE", 2)
    name = "pages/paged"
    for i in range(5):
        publish(tmp_path, f"pages/paged-{i}", stage(name, new_run_id()), seed=i)
    computed = lambda: hub.app.state.metrics.registry.get_sample_value(  # noqa: E731
        "vip_hub_compositions_total"
    )
    eps, _ = owner_figure(hub.url, name)
    assert shown_up(eps, rdp_epsilon(5))
    before = computed()
    for asked in ("pages/PAGED", "Pages/paged", name):
        assert owner_figure(hub.url, asked)[0] == eps
    assert computed() == before


def test_a_namespace_that_only_reads_as_the_owners_is_another_publisher(hub, tmp_path) -> None:
    """Namespaces are unique whatever their case, not their separators: ``pa-ges`` may be another
    user than ``pa_ges``, whose dataset name reads alike (one dataset: the stages compose), so on
    ``pa_ges``'s page its releases are another publisher's; on its own name's page, its own."""
    publish(tmp_path, "pa-ges/lookalike", stage("pa_ges/lookalike", new_run_id()))
    page = httpx.get(f"{hub.url}/datasets/pa_ges/lookalike", timeout=60).text
    owners, others = page.split('id="other-publishers"')
    assert "/pa-ges/lookalike" not in owners and "/pa-ges/lookalike" in others
    page = httpx.get(f"{hub.url}/datasets/PA-ges/lookalike", timeout=60).text
    assert 'id="other-publishers"' not in page and "/pa-ges/lookalike" in page


def test_an_import_without_run_id_is_identified_by_its_mechanism() -> None:
    """Stages without a run id (imports, older ledgers) count once per mechanism, whatever delta,
    name or texts a copy restates; any other mechanism is another stage."""
    name = "pages/imported"
    imported = stage(name, None)
    restated = stage(name, None, delta=0.1).model_copy(
        update={"name": "copied", "description": "x"}
    )
    assert imported.identity == restated.identity
    assert stage(name, None).model_copy(update={"steps": STEPS + 1}).identity != imported.identity
    assert stage(name, new_run_id()).identity != stage(name, new_run_id()).identity
    assert "run_id" not in imported.model_dump(mode="json")  # written as before the field


def _committed(store: HubStore, tmp_path: Path, dp: DPStage) -> CommitRecord:
    """A tiny encoder trained by ``dp`` committed to ``pages/r`` of ``store``, as a push would."""
    folder = export_encoder(
        tmp_path / "r", tiny_encoder(), TINY, [synthetic_stage(), dp], model_name="r"
    )
    store.create_repo("pages/r")
    ops = []
    for rel, path in repo_files(folder).items():
        ops.append(AddFile(rel, tmp := store.blobs.new_temp()))
        tmp.write_bytes(path.read_bytes())
    return store.commit("pages/r", ops)


def test_a_commit_whose_ledger_a_later_rule_refuses_keeps_its_figures(
    tmp_path: Path, caplog
) -> None:
    """A commit indexed before a rule this hub's version added (here: NaN in a ledger, refused
    since 2026-11-30) neither stops the store from opening at another delta nor breaks a listing:
    its indexed figures stay, the log and its caveat say why."""
    from service.settings import HubSettings

    dp = stage("pages/older", new_run_id()).model_copy(update={"sampling": "shuffle"})
    with HubStore(tmp_path / "store") as store:
        committed = _committed(store, tmp_path, dp)
        (row,) = store.index.rows("SELECT card_data FROM commits")
        card = json.loads(row["card_data"])
        card[CARD_LEDGER_KEY]["stages"][1].setdefault("hyperparameters", {})["lr"] = float("nan")
        store.index.execute("UPDATE commits SET card_data = ?", [json.dumps(card)])
    with HubStore(tmp_path / "store", limits=HubSettings(delta=1e-3)) as store:
        (_, record), *_ = store.list_models()
        assert (record.epsilon, record.delta) == (committed.epsilon, committed.delta)
        assert "fails this hub's checks" in (record.caveat or "")
    assert f"commit {committed.sha} keeps its indexed epsilon" in caplog.text


def test_an_index_stated_at_another_delta_is_restated_when_the_hub_opens(tmp_path: Path) -> None:
    """The index ranks and filters at the hub's delta: commits indexed under another ``delta``
    setting (or before the hub fixed one) are recomputed when the store opens, from the ledger
    the index keeps (no blob read)."""
    from service.settings import HubSettings
    from vip_hub.privacy.accounting import epsilon

    dp = stage("pages/restated", new_run_id())
    store = HubStore(tmp_path / "store", limits=HubSettings(delta=1e-3))
    at_1e3 = _committed(store, tmp_path, dp)
    assert at_1e3.delta == 1e-3 + dp.truncation_delta  # the sampler's truncation included
    assert at_1e3.epsilon == pytest.approx(epsilon(SIGMA, Q, STEPS, 1e-3), abs=1e-5)
    (store.root / "blobs").rename(store.root / "blobs-away")
    _, record = HubStore(tmp_path / "store").list_models()[0]  # the default delta, 1e-5
    assert (record.epsilon, record.delta) == (dp.epsilon, 1e-5 + dp.truncation_delta)
    reopened = HubStore(tmp_path / "store")  # at the delta it is stated at: nothing recomputed
    reopened.index.execute("UPDATE commits SET epsilon = 99.0")
    assert HubStore(tmp_path / "store").list_models()[0][1].epsilon == 99.0
    assert HubStore(tmp_path / "store", limits=HubSettings(delta=1e-3)).list_models()[0][
        1
    ].epsilon == pytest.approx(at_1e3.epsilon)


def test_a_replica_not_yet_restarted_commits_at_the_delta_the_index_is_stated_at(
    tmp_path: Path,
) -> None:
    """A replica still on the old ``delta`` committed its row at that delta after another, at
    the new one, had restated the index: the row kept an epsilon too low (4.04 where the hub's
    delta gives 5.26) for good. A commit states its row at the index's delta, and an operator's
    command (``store gc`` without the server's settings) no longer restates the index."""
    from service.settings import HubSettings

    dp = stage("pages/rolling", new_run_id())
    old = HubStore(tmp_path / "store")  # the default delta, 1e-5
    HubStore(tmp_path / "store", limits=HubSettings(delta=1e-3))  # restarted: restates
    committed = _committed(old, tmp_path, dp)
    assert committed.delta == 1e-3 + dp.truncation_delta, committed.delta
    command = HubStore(tmp_path / "store", restate=False)  # an operator's, at the default delta
    (row,) = command.index.rows("SELECT delta FROM commits")
    assert row["delta"] == 1e-3 + dp.truncation_delta
