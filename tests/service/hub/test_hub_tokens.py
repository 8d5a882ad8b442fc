"""Tokens created or revoked while the server runs take effect on the next request."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
from support.live import ThreadedServer, settings_for

from vip_hub.cli.main import main


def test_tokens_created_and_revoked_while_running(tmp_path, capsys):
    store = tmp_path / "store"

    def _vip_hub(*args: str) -> SimpleNamespace:
        """``vip-hub ARGS`` (the command's own entry point, in this process)."""
        code = main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    with ThreadedServer(settings_for(store, auth={"tokens": None})) as server:
        made = _vip_hub(
            "token", "create", "--name", "alice", "--scope", "write", "--store", str(store)
        )
        assert made.returncode == 0, made.stderr
        secret = made.stdout.strip()
        who = httpx.get(
            f"{server.url}/api/whoami-v2", headers={"Authorization": f"Bearer {secret}"}
        )
        assert who.status_code == 200 and who.json()["name"] == "alice"  # no restart needed

        listed = _vip_hub("token", "list", "--store", str(store))
        assert (
            listed.returncode == 0
            and listed.stdout.startswith("alice\twrite\t")
            and secret not in listed.stdout
        )

        revoked = _vip_hub("token", "revoke", "--name", "alice", "--store", str(store))
        assert revoked.returncode == 0, revoked.stderr
        gone = httpx.get(
            f"{server.url}/api/whoami-v2", headers={"Authorization": f"Bearer {secret}"}
        )
        assert gone.status_code == 401

        again = _vip_hub("token", "revoke", "--name", "alice", "--store", str(store))
        assert again.returncode == 1 and again.stderr.strip().endswith(
            "no token named 'alice' in the hub's tokens"
        )
        index = server.app.state.store.index
        index.update_state("auth", lambda _: "{not json")  # the last valid tokens stay in force
        assert (
            httpx.get(
                f"{server.url}/api/whoami-v2", headers={"Authorization": f"Bearer {secret}"}
            ).status_code
            == 401
        )
        assert httpx.get(f"{server.url}/healthz").status_code == 200
