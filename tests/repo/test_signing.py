"""Signed provenance: keys, signing at export, `vip-hub verify --key`, and the hub that checks
signatures against its operator's trusted keys and shows who signed."""

from __future__ import annotations

import base64
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from support.helpers import TINY, dp_stage, synthetic_stage, tiny_encoder
from support.live import WRITE_TOKEN, ThreadedServer, settings_for

from service.store.shared import trust_key
from vip_hub import export_encoder
from vip_hub.cli.main import main
from vip_hub.errors import (
    ConfigError,
    MissingInputError,
    SignatureError,
    UnsafePathError,
    UntrustedSignerError,
)
from vip_hub.repo.files import update_repo
from vip_hub.repo.push import push_repo
from vip_hub.repo.signing import create_key, load_keys, sign_repo, verify_signature
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import (
    CARD_FILE,
    GITATTRIBUTES_FILE,
    LEDGER_FILE,
    SIGNATURE_FILE,
    WEIGHTS_FILE,
    WEIGHTS_SUFFIX,
)

LFS_ATTRIBUTES = f"*{WEIGHTS_SUFFIX} filter=lfs diff=lfs merge=lfs -text\n"
"""What a git clone's ``.gitattributes`` holds for the repo's tensor files."""


@pytest.fixture
def cli(capsys):
    """``vip-hub ARGS`` in this process: exit status, stdout, stderr."""

    def run(*args: str | Path) -> SimpleNamespace:
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


@pytest.fixture
def alice(tmp_path: Path) -> tuple[Path, Path]:
    """A key pair outside any repo: (private key, public key)."""
    private, public = create_key(tmp_path / "keys", "alice")
    return private, public.path


def _repo(folder: Path, seed: int = 0) -> Path:
    return export_encoder(
        folder, tiny_encoder(seed), TINY, [synthetic_stage(), dp_stage()], model_name=folder.name
    )


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_key_create_keeps_the_private_key_private(tmp_path, cli):
    made = cli("key", "create", "--dir", tmp_path / "k", "--name", "bob")
    assert made.returncode == 0, made.stderr
    private, public = tmp_path / "k" / "bob.key", tmp_path / "k" / "bob.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in private.read_bytes() and b"PUBLIC KEY" in public.read_bytes()
    assert load_keys([public])[0].fingerprint in made.stdout
    again = cli("key", "create", "--dir", tmp_path / "k", "--name", "bob")
    assert again.returncode == 1 and "exists" in again.stderr  # never overwritten by accident
    assert cli("key", "create", "--dir", tmp_path / "k", "--name", "../x").returncode == 1


def test_key_create_never_writes_through_a_link(tmp_path, cli):
    """A link placed where the key pair goes is replaced, never written through (it clobbered
    the file it named, or created it), and a dangling one counts as an existing key."""
    keys, precious = tmp_path / "k", tmp_path / "precious.txt"
    keys.mkdir()
    (keys / "bob.pub").symlink_to(tmp_path / "absent.txt")
    made = cli("key", "create", "--dir", keys, "--name", "bob")
    assert made.returncode == 1 and "exists" in made.stderr
    assert not (tmp_path / "absent.txt").exists()
    precious.write_text("mine")
    for name in ("bob.key", "bob.pub"):
        (keys / name).unlink(missing_ok=True)
        (keys / name).symlink_to(precious)
    assert cli("key", "create", "--dir", keys, "--name", "bob", "--overwrite").returncode == 0
    assert precious.read_text() == "mine"
    assert not (keys / "bob.pub").is_symlink() and not (keys / "bob.key").is_symlink()
    assert stat.S_IMODE((keys / "bob.key").stat().st_mode) == 0o600
    assert load_keys([keys / "bob.pub"])[0].name == "bob"
    assert sorted(p.name for p in keys.iterdir()) == ["bob.key", "bob.pub"]  # no temp files


def test_sign_and_verify_roundtrip(tmp_path, alice, cli):
    repo = _repo(tmp_path / "repo")
    fingerprint = sign_repo(repo, alice[0])
    signed = json.loads((repo / SIGNATURE_FILE).read_text())
    assert signed["verificationMaterial"]["publicKey"]["hint"] == fingerprint
    assert verify_signature(repo, load_keys([alice[1]])).name == "alice"
    assert verify_repo(repo).ok  # the signature is no ledger artifact
    out = cli("verify", repo, "--key", alice[1])
    assert out.returncode == 0, out.stdout
    assert f"signed by alice ({fingerprint[:16]})" in out.stdout and "WARN" not in out.stdout
    assert cli("verify", repo, "--key", alice[1].parent).returncode == 0  # a folder of *.pub
    missing = cli("verify", repo, "--key", tmp_path / "nope")
    assert missing.returncode == 1 and "no such public key file or folder" in missing.stderr
    unchecked = cli("verify", repo)
    assert unchecked.returncode == 0
    assert f"signed ({SIGNATURE_FILE}) but not checked" in unchecked.stdout


def test_a_key_inside_the_repo_is_refused(tmp_path):
    repo = _repo(tmp_path / "repo")
    private, _ = create_key(repo / "keys", "oops")
    with pytest.raises(ConfigError, match="inside the repo"):
        sign_repo(repo, private)


def test_a_folder_given_as_a_key_file_is_a_one_line_error(tmp_path, alice, cli):
    """``--key`` or ``trust add`` naming the key folder instead of a key file: an error naming
    it (was an IsADirectoryError traceback)."""
    repo, keys = _repo(tmp_path / "repo"), alice[0].parent
    signed = cli("sign", repo, "--key", keys)
    assert signed.returncode == 1 and f"{keys}: cannot read the private key file" in signed.stderr
    trusted = cli("trust", "add", "alice", keys, "--store", tmp_path / "store")
    assert trusted.returncode == 1
    assert f"{keys}: cannot read the public key file" in trusted.stderr
    sign_repo(repo, alice[0])
    (keys / "old.pub").mkdir()  # a folder of keys holding a folder named like one
    checked = cli("verify", repo, "--key", keys)
    assert checked.returncode == 1 and "old.pub: cannot read the public key file" in checked.stderr


def test_unsigned_repo_verifies_with_a_warning(tmp_path, alice, cli):
    repo = _repo(tmp_path / "repo")
    assert verify_signature(repo, load_keys([alice[1]])) is None
    out = cli("verify", repo, "--key", alice[1])
    assert out.returncode == 0
    assert (
        f"WARN  unsigned: no {SIGNATURE_FILE}, so nothing says who trained or published these files"
        in out.stdout
    )
    report = json.loads(cli("verify", repo, "--key", alice[1], "--json").stdout)
    assert report["ok"] and any(w.startswith("unsigned") for w in report["warnings"])


def test_a_signature_required_fails_an_unsigned_repo(tmp_path, alice, cli):
    """``--require-signature``: a signed repo whose signature was deleted, then a file edited,
    fails (it verified with a warning); a --key that does not exist is named even when the repo
    is unsigned (it was never read); the option without --key is refused."""
    repo = _repo(tmp_path / "repo")
    sign_repo(repo, alice[0])
    (repo / SIGNATURE_FILE).unlink()
    _flip_last_byte(repo / CARD_FILE)
    assert cli("verify", repo, "--key", alice[1]).returncode == 0  # a warning alone
    out = cli("verify", repo, "--key", alice[1], "--require-signature")
    assert out.returncode == 1 and f"FAIL  {SIGNATURE_FILE}: unsigned" in out.stdout, out.stdout
    missing = cli("verify", repo, "--key", tmp_path / "nobody.pub")
    assert missing.returncode == 1 and "nobody.pub" in missing.stderr
    assert cli("verify", repo, "--require-signature").returncode == 1


def test_one_byte_changed_after_signing_fails(tmp_path, alice, cli):
    repo = _repo(tmp_path / "repo")
    sign_repo(repo, alice[0])
    _flip_last_byte(repo / CARD_FILE)
    with pytest.raises(
        SignatureError,
        match=rf"differ from what alice \(\w+\) signed \(changed: {re.escape(CARD_FILE)}\)",
    ):
        verify_signature(repo, load_keys([alice[1]]))
    out = cli("verify", repo, "--key", alice[1])
    assert out.returncode == 1
    assert f"FAIL  {SIGNATURE_FILE}: the files differ from what alice" in out.stdout


def test_a_consistent_ledger_rewrite_verifies_but_its_signature_fails(tmp_path, alice, cli):
    """The rewrite the issue names (q/4, sigma x 2, T = 1): every copy agrees and every epsilon
    follows, so `verify` alone passes; the trainer's signature does not."""
    repo = _repo(tmp_path / "repo")
    sign_repo(repo, alice[0])
    signature = (repo / SIGNATURE_FILE).read_bytes()
    honest = dp_stage()
    update_repo(
        repo,
        replace_component="encoder",
        add_stages=[synthetic_stage(), dp_stage(batch=50 / 4, sigma=2.0, steps=1)],
    )
    assert not (
        repo / SIGNATURE_FILE
    ).exists()  # an update drops the signature it no longer matches
    assert verify_repo(repo).ok and verify_repo(repo).ledger.guarantees[0].epsilon < honest.epsilon
    (repo / SIGNATURE_FILE).write_bytes(signature)  # the forger keeps the trainer's signature
    out = cli("verify", repo, "--key", alice[1])
    assert out.returncode == 1
    assert f"FAIL  {SIGNATURE_FILE}: the files differ from what alice" in out.stdout
    for name in (LEDGER_FILE, CARD_FILE, WEIGHTS_FILE):
        assert name in out.stdout


def test_wrong_key_or_a_forged_signature_fails(tmp_path, alice):
    repo = _repo(tmp_path / "repo")
    sign_repo(repo, alice[0])
    _, bob = create_key(tmp_path / "other", "bob")
    with pytest.raises(UntrustedSignerError, match="not a trusted key"):
        verify_signature(repo, [bob])
    bundle = json.loads((repo / SIGNATURE_FILE).read_text())
    bundle["verificationMaterial"]["publicKey"]["hint"] = (
        bob.fingerprint
    )  # claims bob, was made by alice
    (repo / SIGNATURE_FILE).write_text(json.dumps(bundle))
    with pytest.raises(SignatureError, match="not a valid signature by bob"):
        verify_signature(repo, [bob])
    (repo / SIGNATURE_FILE).write_text("not json")
    with pytest.raises(SignatureError, match="not a signature bundle"):
        verify_signature(repo, [bob])


@pytest.mark.parametrize(
    "bundle",
    [
        {"verificationMaterial": {"publicKey": {"hint": ["a"]}}},
        {"verificationMaterial": "x"},
        {"verificationMaterial": {"publicKey": [1]}},
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_a_malformed_signature_is_a_named_problem(tmp_path, alice, cli, bundle):
    repo = _repo(tmp_path / "repo")
    text = bundle if isinstance(bundle, str) else json.dumps(bundle)
    (repo / SIGNATURE_FILE).write_text(text)
    with pytest.raises(SignatureError, match="not a signature bundle"):
        verify_signature(repo, load_keys([alice[1]]))
    out = cli("verify", repo, "--key", alice[1])
    assert out.returncode == 1
    assert f"FAIL  {SIGNATURE_FILE}: not a signature bundle" in out.stdout


def _tiny_export(out: Path, seed: int = 0):
    """A training run's ``write(key)``: a tiny encoder exported to ``out``, signed by the key."""
    return lambda key: export_encoder(
        out,
        tiny_encoder(seed),
        TINY,
        [synthetic_stage()],
        model_name="r",
        overwrite=True,
        signing_key=key,
    )


def test_training_run_signs_its_export(tmp_path, alice, monkeypatch):
    from training.skeleton.config import RunConfig
    from training.skeleton.distributed import Dist
    from training.skeleton.run import Run

    out = tmp_path / "run-repo"
    for key, env in ((str(alice[0]), None), (None, str(alice[0]))):
        if env:
            monkeypatch.setenv("VIP_HUB_SIGNING_KEY", env)
        dist = Dist.from_env("cpu")
        try:
            run = Run(RunConfig(out=str(out), signing_key=key), dist)
            run.export(_tiny_export(out))
        finally:
            dist.close()
        assert verify_signature(out, load_keys([alice[1]])).name == "alice"
        assert "signing_key" not in run.settings  # another key resumes the same run


def test_a_training_run_refuses_a_key_it_cannot_sign_with_before_it_trains(tmp_path, monkeypatch):
    """The key was first read once the export had replaced --out: after the whole training, the
    earlier (signed) repo there was gone, an unsigned one in its place, and the run failed."""
    from training.skeleton.config import RunConfig
    from training.skeleton.distributed import Dist
    from training.skeleton.run import Run

    out, not_pem, k1 = tmp_path / "run-repo", tmp_path / "not.key", tmp_path / "k1.key"
    not_pem.write_text("not a key")
    k1.write_bytes(  # EC, but not a curve model-signing signs with: was found after the export
        ec.generate_private_key(ec.SECP256K1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cases = [
        (str(tmp_path / "missing.key"), None, MissingInputError, "no such private key file"),
        (None, str(tmp_path / "missing.key"), MissingInputError, "no such private key file"),
        (str(not_pem), None, ConfigError, "not an unencrypted PEM private key"),
        (str(k1), None, ConfigError, "cannot sign with it .*secp256k1"),
    ]
    for key, env, error, message in cases:
        if env:
            monkeypatch.setenv("VIP_HUB_SIGNING_KEY", env)
        dist = Dist.from_env("cpu")
        try:
            with pytest.raises(error, match=message):
                Run(RunConfig(out=str(out), signing_key=key), dist)
        finally:
            dist.close()
    assert not out.with_name(out.name + ".run").exists()  # refused before its run folder


def test_a_training_run_signs_its_repo_before_it_replaces_the_earlier_one(tmp_path, alice):
    """The export replaced --out, then signed: a key gone (or a signing that failed) by then left
    an unsigned repo where the signed one had been. It now signs in the staging folder: the
    earlier repo stays whole, its signature valid, unless the new one comes signed."""
    from training.skeleton.config import RunConfig
    from training.skeleton.distributed import Dist
    from training.skeleton.run import Run

    out, key = tmp_path / "run-repo", tmp_path / "rotated.key"
    key.write_bytes(alice[0].read_bytes())
    export_encoder(out, tiny_encoder(), TINY, [synthetic_stage()], model_name="r", signing_key=key)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    dist = Dist.from_env("cpu")
    try:
        run = Run(RunConfig(out=str(out), signing_key=str(key)), dist)
        key.unlink()  # rotated away while the run trained
        with pytest.raises(MissingInputError, match="no such private key file"):
            run.export(_tiny_export(out, seed=1))
    finally:
        dist.close()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert verify_signature(out, load_keys([alice[1]])).name == "alice"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    # signed in its staging folder, under the name it is released as
    bundle = json.loads((out / SIGNATURE_FILE).read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    assert [s["name"] for s in statement["subject"]] == [out.name]


def test_an_update_signs_the_repo_it_writes(tmp_path, alice):
    """``update_repo`` (a head added, as DP fine-tuning's export does) with a key leaves the
    repo signed over its new files; without one, unsigned (the old signature is removed)."""
    repo = _repo(tmp_path / "repo")
    sign_repo(repo, alice[0])
    update_repo(repo, add_files={"notes.txt": b"hello"}, signing_key=alice[0])
    assert verify_signature(repo, load_keys([alice[1]])).name == "alice"
    update_repo(repo, add_files={"notes.txt": b"again"})
    assert not (repo / SIGNATURE_FILE).exists()


@pytest.fixture(scope="module")
def trusted(hub, tmp_path_factory) -> tuple[Path, Path]:
    """Alice's key pair, trusted by the module's hub (its operator's key list in the index)."""
    private, public = create_key(tmp_path_factory.mktemp("alice"), "alice")
    trust_key(hub.app.state.store.index, "alice", public.path)
    return private, public.path


def test_hub_accepts_a_trusted_signature_and_shows_the_signer(hub, trusted, tmp_path):
    repo = _repo(tmp_path / "signed")
    fingerprint = sign_repo(repo, trusted[0])
    commit = push_repo(repo, "writer/signed", token=WRITE_TOKEN)
    store = hub.app.state.store
    record = store.signature(commit)
    assert record is not None and (record.signer, record.fingerprint) == ("alice", fingerprint)
    assert SIGNATURE_FILE in store.tree("writer/signed", commit)
    html = httpx.get(f"{hub.url}/writer/signed").text
    assert "Signed by <strong>alice</strong>" in html and fingerprint[:16] in html
    # what a reader downloads verifies against alice's key
    local = Path(
        HfApi(token=WRITE_TOKEN).snapshot_download("writer/signed", local_dir=tmp_path / "download")
    )
    assert verify_signature(local, load_keys([trusted[1]])).name == "alice"
    # the hub's attestation is in its index, not among the signed files
    assert set(store.tree("writer/signed", commit)) == {
        p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()
    }


def test_hub_shows_an_unsigned_repo_as_unsigned(hub, trusted, tmp_path):
    commit = push_repo(_repo(tmp_path / "plain"), "writer/plain", token=WRITE_TOKEN)
    assert hub.app.state.store.signature(commit) is None
    assert (
        "<strong>Unsigned.</strong> Nothing says who trained this model"
        in httpx.get(f"{hub.url}/writer/plain").text
    )


def test_hub_refuses_untrusted_and_invalid_signatures(hub, trusted, tmp_path):
    mallory, _ = create_key(tmp_path / "mallory", "mallory")
    repo = _repo(tmp_path / "untrusted")
    sign_repo(repo, mallory)
    with pytest.raises(HfHubHTTPError) as refused:
        push_repo(repo, "writer/untrusted", token=WRITE_TOKEN)
    assert (
        refused.value.response.status_code == 403
        and "not a trusted key" in refused.value.response.text
    )
    assert not HfApi().list_repo_refs("writer/untrusted").branches  # nothing stored

    forged = _repo(tmp_path / "forged", seed=1)
    sign_repo(forged, trusted[0])
    bundle = json.loads((forged / SIGNATURE_FILE).read_text())
    sig = bytearray(base64.b64decode(bundle["dsseEnvelope"]["signatures"][0]["sig"]))
    sig[-1] ^= 1  # alice's key hint, a signature alice did not make
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    (forged / SIGNATURE_FILE).write_text(json.dumps(bundle))
    with pytest.raises(HfHubHTTPError) as refused:
        push_repo(forged, "writer/forged", token=WRITE_TOKEN)
    assert refused.value.response.status_code == 403
    assert f"{SIGNATURE_FILE}: not a valid signature by alice" in refused.value.response.text


def test_hub_refuses_files_changed_after_signing(hub, trusted, tmp_path):
    repo = _repo(tmp_path / "changed", seed=2)
    sign_repo(repo, trusted[0])
    signature = (repo / SIGNATURE_FILE).read_bytes()
    update_repo(repo, add_files={"notes.txt": b"added after signing\n"})
    (repo / SIGNATURE_FILE).write_bytes(signature)
    with pytest.raises(HfHubHTTPError) as refused:
        push_repo(repo, "writer/changed", token=WRITE_TOKEN)
    text = refused.value.response.text
    assert refused.value.response.status_code == 403 and "the files differ from what alice" in text
    assert "added: notes.txt" in text


def test_a_hub_that_requires_signatures_refuses_unsigned_commits(tmp_path, cli):
    store = tmp_path / "store"
    private, public = create_key(tmp_path / "keys", "carol")
    with ThreadedServer(settings_for(store, hub={"require_signature": True})) as server:
        repo = _repo(tmp_path / "repo")
        with pytest.raises(HfHubHTTPError) as refused:
            push_repo(repo, "writer/required", endpoint=server.url, token=WRITE_TOKEN)
        assert (
            refused.value.response.status_code == 403
            and "signed repos only" in refused.value.response.text
        )
        # the operator trusts carol while the server runs: her next commit goes through
        added = cli("trust", "add", "carol", public.path, "--store", store)
        assert added.returncode == 0 and public.fingerprint in added.stdout
        assert cli("trust", "list", "--store", store).stdout == f"carol\t{public.fingerprint}\n"
        sign_repo(repo, private)
        commit = push_repo(repo, "writer/required", endpoint=server.url, token=WRITE_TOKEN)
        assert server.app.state.store.signature(commit).signer == "carol"
        assert (
            cli("trust", "add", "carol", public.path, "--store", store).returncode == 1
        )  # no silent replace
        assert cli("trust", "remove", "carol", "--store", store).returncode == 0
        assert cli("trust", "list", "--store", store).stdout == ""


def test_hidden_files_are_unsigned_on_both_sides(tmp_path, alice):
    """Signing leaves hidden files out (``repo_files``); a tree given as a mapping (the hub's)
    holding one, as a git clone or an LFS upload does, was refused as "leaving .gitattributes
    unsigned", and a hidden file model-signing does not ignore as changing the signed files."""
    repo = _repo(tmp_path / "repo")
    sign_repo(repo, alice[0])
    (tmp_path / GITATTRIBUTES_FILE).write_text(LFS_ATTRIBUTES)
    (tmp_path / "notes.txt").write_text("a download's cache\n")
    tree = {
        **{p.relative_to(repo).as_posix(): p for p in repo.rglob("*")},
        GITATTRIBUTES_FILE: tmp_path / GITATTRIBUTES_FILE,
        ".cache/huggingface/notes.txt": tmp_path / "notes.txt",
    }
    assert verify_signature(tree, load_keys([alice[1]])).name == "alice"
    (repo / GITATTRIBUTES_FILE).write_bytes((tmp_path / GITATTRIBUTES_FILE).read_bytes())
    assert verify_signature(repo, load_keys([alice[1]])).name == "alice"  # as in a folder


def test_a_signature_that_ignores_a_repo_file_is_refused(tmp_path, alice, cli):
    """model-signing lets a signer list paths as ignored, and its verifier honours the list, so
    a card signed that way could be rewritten under a valid signature: the file is named as
    unsigned, before and after the rewrite."""
    from model_signing import hashing, signing

    repo = _repo(tmp_path / "repo")
    ignoring = hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE, CARD_FILE])
    signing.Config().use_elliptic_key_signer(private_key=alice[0]).set_hashing_config(
        ignoring
    ).sign(repo, repo / SIGNATURE_FILE)
    keys = load_keys([alice[1]])
    with pytest.raises(SignatureError, match=f"leaves {CARD_FILE} unsigned"):
        verify_signature(repo, keys)
    (repo / CARD_FILE).write_text((repo / CARD_FILE).read_text() + "\nRewritten after signing.\n")
    with pytest.raises(SignatureError, match=f"leaves {CARD_FILE} unsigned"):
        verify_signature(repo, keys)
    out = cli("verify", repo, "--key", alice[1])
    assert out.returncode == 1
    assert f"FAIL  {SIGNATURE_FILE}: leaves {CARD_FILE} unsigned" in out.stdout


def test_a_mapping_path_out_of_the_repo_is_refused_and_links_nothing(tmp_path, alice):
    """A ``..`` key of a mapping made a link outside the signature's temporary folder."""
    repo = _repo(tmp_path / "repo")
    sign_repo(repo, alice[0])
    escape = f"vip-hub-escape-{tmp_path.name}"
    tree = {p.relative_to(repo).as_posix(): p for p in repo.rglob("*")}
    with pytest.raises(UnsafePathError, match=re.escape(f"../../{escape}")):
        verify_signature({**tree, f"../../{escape}": repo / CARD_FILE}, load_keys([alice[1]]))
    assert not os.path.lexists(Path(tempfile.gettempdir(), escape))


def test_hub_accepts_a_signed_commit_beside_its_gitattributes(hub, trusted, tmp_path):
    """A hub repo holding a ``.gitattributes`` (an upload of a git clone) refused every later
    signed commit: its check of the whole tree found the file unsigned."""
    repo = _repo(tmp_path / "attrs", seed=3)
    push_repo(repo, "writer/attrs", token=WRITE_TOKEN)
    HfApi(token=WRITE_TOKEN).upload_file(
        path_or_fileobj=LFS_ATTRIBUTES.encode(),
        path_in_repo=GITATTRIBUTES_FILE,
        repo_id="writer/attrs",
    )
    update_repo(repo, add_files={"notes.txt": b"signed\n"}, signing_key=trusted[0])
    commit = push_repo(repo, "writer/attrs", token=WRITE_TOKEN)
    store = hub.app.state.store
    assert store.signature(commit).signer == "alice"
    assert GITATTRIBUTES_FILE in store.tree("writer/attrs", commit)
