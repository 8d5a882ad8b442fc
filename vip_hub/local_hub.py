"""Where a hub run on this machine keeps its store and listens unless told otherwise.

One declaration for ``vip-hub serve``'s settings (``service/settings.py``), its help text
(``service/cli.py``) and the main job, which starts that server (``training/main_job.py``):
training and service never import each other, so the defaults sit below both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field

__all__ = ["CONFIG_ENV", "DEFAULT_HOST", "DEFAULT_PORT", "DEFAULT_STORE", "Port"]

CONFIG_ENV = "VIP_HUB_CONFIG"
"""The environment variable naming the server's TOML settings file (``--config``)."""

DEFAULT_STORE = Path("var/hub")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

Port = Annotated[int, Field(ge=0, le=65535)]
"""A TCP port to bind (0: any free port)."""
