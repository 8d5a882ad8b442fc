"""Bad settings (a TOML file, VIP_HUB_* variables, options) fail the service's commands with
one line naming the file, the setting and the value, never a traceback; unknown settings and
limits that contradict each other are refused rather than ignored."""

from __future__ import annotations

import pytest

from vip_hub.cli.main import main


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.setenv("VIP_HUB_CONFIG", "")  # --config sets it; restored (unset) after the test
    return monkeypatch


@pytest.mark.parametrize(
    "text, message",
    [
        (b"port = 99999\n", "port: Input should be less than or equal to 65535 (got 99999)"),
        (b'port = "\xff"\n', "not UTF-8"),
        (b"port = [\n", "not valid TOML"),
        (b"[hub]\npage_sise = 5\n", "hub.page_sise: Extra inputs are not permitted"),
        (b'[auth]\ntokens = ["bob:write:SECRET"]\n', "auth.tokens: Input should be a valid string"),
        (
            b"[inference]\nmax_queue_images = 4\n",
            "inference.max_queue_images (4) is below inference.max_images_per_request (64)",
        ),
        (
            b"[inference]\nmax_labels = 600\n",
            "inference.max_queue_images (512) is below inference.max_labels (600)",
        ),
        (
            b"[hub]\ngc_grace_s = 60\n",
            "hub.gc_grace_s (60) is below hub.upload_ttl_s (86400)",
        ),
        (
            b"[inference]\nmax_pending_bytes = 1024\n",
            "inference.max_pending_bytes (1024) is below inference.max_request_bytes",
        ),
    ],
)
def test_a_bad_settings_file_is_one_line_naming_it(tmp_path, capsys, clean_env, text, message):
    config = tmp_path / "hub.toml"
    config.write_bytes(text)
    assert main(["store", "check", "--store", str(tmp_path / "s"), "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"vip-hub store: error: {config}: ") and message in err, err
    assert "SECRET" not in err  # a token's value is never shown


def test_bad_variables_and_options_are_one_line(tmp_path, capsys, clean_env):
    store = ["--store", str(tmp_path / "s")]
    clean_env.setenv("VIP_HUB_HUB__BOGUS", "1")
    assert main(["token", "list", *store]) == 1
    assert "hub.bogus: Extra inputs are not permitted" in capsys.readouterr().err
    clean_env.delenv("VIP_HUB_HUB__BOGUS")
    clean_env.setenv("VIP_HUB_INFERENCE__MAX_BATCH_SIZE", "many")
    assert main(["token", "list", *store]) == 1
    err = capsys.readouterr().err
    assert "inference.max_batch_size: Input should be a valid integer" in err, err
    clean_env.delenv("VIP_HUB_INFERENCE__MAX_BATCH_SIZE")
    assert main(["token", "list", *store, "--config", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path}, which is not a file" in err, err
    clean_env.setenv("VIP_HUB_CONFIG", "")
    assert main(["token", "create", "--name", "ann", *store]) == 0  # good settings


@pytest.mark.parametrize("name", ["a/b", " ", "ali ce", "a\nb", "a:b", "..", "x" * 97])
def test_a_token_is_made_only_for_a_valid_user_name(tmp_path, capsys, clean_env, name):
    store = ["--store", str(tmp_path / "s")]
    assert main(["token", "create", "--name", name, *store]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"vip-hub token: error: invalid user {name!r}"), err
    assert not (tmp_path / "s").exists()  # nothing stored
