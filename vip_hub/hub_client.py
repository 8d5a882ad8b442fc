"""What the hub client (huggingface_hub) raises when a hub cannot be used, said as this
library's errors, in one place: a hub that cannot be reached, one that answers no JSON (a web
page at ``HF_ENDPOINT``), a request it refuses, and ``HF_HUB_OFFLINE``."""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

from .errors import ConfigError

__all__ = ["check_endpoint", "hub_errors"]


def _transport_errors() -> tuple[type[Exception], ...]:
    """What the hub client raises when no answer came (refused, timed out, no URL): the
    HTTPError of httpx2 (huggingface_hub 2) and of httpx (huggingface_hub 1), where installed."""
    errors = []
    for module in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError, AttributeError):
            errors.append(importlib.import_module(module).HTTPError)
    return tuple(errors)


def check_endpoint(endpoint: str) -> None:
    """ConfigError unless ``endpoint`` (``--endpoint`` or ``HF_ENDPOINT``) is an http(s) URL with a
    host and a valid port: the hub client raised a bare ValueError or InvalidURL on one."""
    try:
        endpoint.encode()  # a byte the shell could not decode: a lone surrogate
        parts = urlsplit(endpoint)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 (raises ValueError for a port that is no number in range)
    except ValueError as e:  # (UnicodeEncodeError is one)
        raise ConfigError(f"hub endpoint {endpoint!r} (--endpoint, HF_ENDPOINT): {e}") from None
    if not valid:
        raise ConfigError(
            f"hub endpoint {endpoint!r} (--endpoint, HF_ENDPOINT) is no http(s) URL with a host"
        )


@contextlib.contextmanager
def hub_errors(what: str, endpoint: str | None = None) -> Iterator[None]:
    """Run a hub client call, its failures raised as ConfigError naming ``what`` was being done
    and the hub (``endpoint``, else ``HF_ENDPOINT``'s)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

    where = endpoint or constants.ENDPOINT
    try:
        yield
    except OfflineModeIsEnabled:
        raise ConfigError(
            f"{what}: HF_HUB_OFFLINE is set, so the hub at {where} may not be asked; unset it"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{what}: the hub at {where} answered with something that is not JSON ({e}): is "
            "--endpoint (or HF_ENDPOINT) a hub, not a web page?"
        ) from None
    except (HfHubHTTPError, HFValidationError) as e:  # refused by the hub, or before sending
        raise ConfigError(f"{what}: {' '.join(str(e).split())}") from None
    except _transport_errors() as e:
        raise ConfigError(
            f"{what}: cannot reach the hub at {where} ({type(e).__name__}: {e})"
        ) from None
