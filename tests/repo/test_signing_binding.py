"""What a signature and `verify` bind, attacked by someone who can edit a published repo folder:
every file a loader reads is one `verify` checks and the signature covers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from support.helpers import TINY, dp_stage, synthetic_stage, tiny_encoder, tiny_repo_with_head

from vip_hub import export_encoder
from vip_hub.cli.main import main
from vip_hub.errors import TamperedFileError, UnsafePathError
from vip_hub.privacy.ledger import PrivacyLedger, privacy_headline
from vip_hub.repo.card import ledger_rows
from vip_hub.repo.heads import list_heads
from vip_hub.repo.signing import create_key, load_keys, sign_repo, verify_signature
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import CARD_FILE, HEADS_DIR


@pytest.fixture
def alice(tmp_path: Path) -> tuple[Path, Path]:
    """A key pair outside any repo: (private key, public key)."""
    private, public = create_key(tmp_path / "keys", "alice")
    return private, public.path


def _signed_repo(folder: Path, private_key: Path) -> Path:
    repo = export_encoder(
        folder, tiny_encoder(), TINY, [synthetic_stage(), dp_stage()], model_name=folder.name
    )
    sign_repo(repo, private_key)
    return repo


def test_a_head_added_through_a_linked_folder_is_refused(tmp_path, alice, capsys):
    """A folder link is not walked, so its files were neither verified nor signed, yet the head
    loader (``list_heads``, the inference service) follows it: a head added after signing, here
    hidden in the repo itself, was served as the trainer's."""
    repo = _signed_repo(tmp_path / "repo", alice[0])
    donor = tiny_repo_with_head(tmp_path / "donor")
    shutil.copytree(donor / HEADS_DIR / "toy", repo / ".payload")
    (repo / HEADS_DIR).mkdir()
    (repo / HEADS_DIR / "toy").symlink_to(Path("..", ".payload"), target_is_directory=True)
    assert list_heads(repo) == ["toy"]  # what a loader of this folder serves
    with pytest.raises(UnsafePathError, match=r"heads/toy: a link to a folder"):
        verify_repo(repo)
    with pytest.raises(UnsafePathError, match=r"heads/toy: a link to a folder"):
        verify_signature(repo, load_keys([alice[1]]))
    assert main(["verify", str(repo), "--key", str(alice[1])]) == 1
    assert "heads/toy: a link to a folder" in capsys.readouterr().err
    with pytest.raises(UnsafePathError, match=r"heads/toy: a link to a folder"):
        sign_repo(repo, alice[0])  # a signature that leaves out what is loaded


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda tags: [t for t in tags if t != "differential-privacy"] + ["no-private-data"],
            "tags claim no-private-data, which its ledger does not give",
        ),
        (
            lambda tags: [t for t in tags if t != "differential-privacy"],
            "tags leave out differential-privacy, which its ledger gives",
        ),
    ],
)
def test_card_tags_that_the_ledger_does_not_give_fail_verify(tmp_path, change, message):
    """The hub answers a model's tags from its card's front matter (``/api/models``): tags that
    say a repo trained on private data used none passed verify, the ledger copy beside them
    intact."""
    repo = export_encoder(
        tmp_path / "repo", tiny_encoder(), TINY, [synthetic_stage(), dp_stage()], model_name="r"
    )
    _, front, body = (repo / CARD_FILE).read_text(encoding="utf-8").split("---\n", 2)
    data = yaml.safe_load(front)
    data["tags"] = change(data["tags"])
    (repo / CARD_FILE).write_text(
        "---\n" + yaml.safe_dump(data, sort_keys=False) + "---\n" + body, encoding="utf-8"
    )
    report = verify_repo(repo)
    assert [str(p) for p in report.problems] == [f"{CARD_FILE}: {message}"]
    assert report.problems[0].kind is TamperedFileError


@pytest.mark.parametrize(
    "change",
    [
        lambda body, ledger: body.replace(
            privacy_headline(ledger.summary()).split(",")[0], "ε = 0.1"
        ),
        lambda body, ledger: body.replace(f"| {ledger_rows(ledger)[-1][-1]} |", "| 0.1 |"),
        lambda body, ledger: "\n".join(
            line for line in body.splitlines() if not line.startswith("| Guarantee assumes |")
        ),
    ],
    ids=["headline", "ledger row", "assumptions"],
)
def test_card_text_that_misstates_the_ledger_fails_verify(tmp_path, change):
    """Users read the guarantee off the card's text: an ε edited in its headline or in its
    ledger table, or the row of what it assumes removed, passed verify, the ledger copy in its
    front matter intact."""
    repo = export_encoder(
        tmp_path / "repo", tiny_encoder(), TINY, [synthetic_stage(), dp_stage()], model_name="r"
    )
    assert verify_repo(repo).ok
    ledger = PrivacyLedger.read(repo)
    _, front, body = (repo / CARD_FILE).read_text(encoding="utf-8").split("---\n", 2)
    changed = change(body, ledger)
    assert changed != body
    (repo / CARD_FILE).write_text("---\n" + front + "---\n" + changed, encoding="utf-8")
    report = verify_repo(repo)
    assert [p.where for p in report.problems] == [CARD_FILE], report.problems
    assert "which its ledger gives" in str(report.problems[0])
    assert report.problems[0].kind is TamperedFileError
