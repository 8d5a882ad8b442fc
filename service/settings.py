"""All service configuration, in one pydantic-settings class.

Sources, highest priority first: arguments given in code (the CLI flags), environment
variables prefixed ``VIP_HUB_`` (nested sections with ``__``, e.g.
``VIP_HUB_INFERENCE__MAX_BATCH_SIZE=64``), a TOML file named by ``VIP_HUB_CONFIG``, then the
defaults below.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from vip_hub.device import DEVICE_HELP, check_device_name
from vip_hub.errors import ConfigError
from vip_hub.local_hub import CONFIG_ENV, DEFAULT_HOST, DEFAULT_PORT, DEFAULT_STORE, Port
from vip_hub.privacy.accounting import DEFAULT_DELTA_CAP
from vip_hub.repo_format import CARD_FILE, HEAD_LABELS, SIGNATURE_FILE, FrontMatterLimits

__all__ = [
    "AuthSettings",
    "HubSettings",
    "InferenceSettings",
    "ObjectStoreSettings",
    "Settings",
    "load_settings",
]

GIB = 1024**3
MIB = 1024**2
MAX_CAPTION_TOKENS = 127
"""The bound on ``inference.max_caption_tokens`` and on a /v1/captions request's ``max_tokens``."""
TRUSTED_KEYS_DIR = "trusted_keys"
"""A single-host store's folder of trusted public keys, inside the store unless
``hub.trusted_keys`` names another."""
REQUEST_FIELDS = 32
"""Fields a /v1 JSON body may hold beside its images and labels (its values' bound)."""


class _Section(BaseModel):
    """A section of the settings: an unknown (e.g. misspelt) key is refused, never ignored."""

    model_config = ConfigDict(extra="forbid")


class HubSettings(_Section):
    """The model hub: store protocol, uploads and web pages."""

    enabled: bool = True
    max_upload_bytes: int = Field(
        8 * GIB, gt=0, description="largest commit body, LFS object or Xet file accepted"
    )
    upload_ttl_s: float = Field(
        24 * 3600,
        gt=0,
        description="uploaded objects never committed are removed after this many seconds",
    )
    max_uncommitted_bytes: int = Field(
        64 * GIB,
        gt=0,
        description="bytes one user may hold uploaded and not yet committed (LFS objects "
        "counted from their batch reply, files rebuilt from a Xet shard from the shard, each "
        "until a commit names it or hub.upload_ttl_s passes; Xet xorbs as they arrive, until a "
        "shard rebuilds files from all of one or hub.xet_ttl_s passes unused); past it, 429",
    )
    xet_ttl_s: float = Field(
        21 * 24 * 3600,
        gt=0,
        description="Xet xorbs are kept this long after their last use: "
        "hf_xet clients deduplicate against what they uploaded for 3 weeks",
    )
    gc_grace_s: float = Field(
        24 * 3600,
        gt=0,
        description="blobs no commit names (left by a commit that failed or crashed after "
        "storing them) are removed by `vip-hub store gc` once this old",
    )
    page_size: int = Field(100, gt=0, le=1000, description="entries per page of listings")
    trusted_keys: Path | None = Field(
        None,
        description="a single-host store's folder (or file) of trusted public keys "
        "(NAME.pub), moved into the index at the first start (default: STORE/trusted_keys; "
        "one outside the store is read, never renamed); the keys whose "
        f"signatures ({SIGNATURE_FILE}) commits may carry are then managed with `vip-hub trust`, "
        "and a commit signed by any other key is refused",
    )
    require_signature: bool = Field(False, description="refuse unsigned commits too")
    max_commit_files: int = Field(
        10_000,
        gt=0,
        description="files in a commit's tree (and operations in its body); 413 beyond",
    )
    max_labels_bytes: int = Field(
        MIB, gt=0, description=f"size of a head's {HEAD_LABELS} in a commit; 413 beyond"
    )
    xet_max_expansion: int = Field(
        32,
        gt=0,
        description="a Xet shard rebuilds at most this many times the stored (compressed) bytes "
        "of the distinct chunks it reads, each from a xorb its uploader sent (413 beyond)",
    )
    max_prv_stages: int = Field(
        6,
        gt=0,
        description="DP stages a dataset page composes under PRV (its cost grows fast with "
        "them); beyond, the page says so and shows RDP and PLD",
    )
    compositions_kept: int = Field(
        256,
        gt=0,
        description="dataset-page compositions kept in memory, each computed once per change "
        "of the dataset's public releases",
    )
    max_front_matter_bytes: int = Field(
        FrontMatterLimits.max_bytes,
        gt=0,
        description=f"largest YAML front matter of a model card ({CARD_FILE}), and largest YAML "
        "file (.yaml, .yml), that a commit or /api/validate-yaml accepts (400 naming the limit)",
    )
    max_front_matter_depth: int = Field(
        FrontMatterLimits.max_depth,
        gt=0,
        description="deepest nesting of lists and mappings in a card's front matter or a YAML "
        "file (400 naming the limit)",
    )
    page_cache_entries: int = Field(
        256, gt=0, description="model pages kept rendered (each commit's is rendered once)"
    )
    delta: float = Field(
        DEFAULT_DELTA_CAP,
        gt=0,
        lt=1,
        description="the one delta at which the hub states, ranks, filters (max_epsilon) and "
        "composes (dataset pages) epsilons, each recomputed from its stage's (sigma, q, T): a "
        "publisher's own delta never changes them",
    )

    @model_validator(mode="after")
    def _grace_covers_uploads(self) -> Self:
        """A commit consumes its uploads as it stores their blobs: were those collected before
        the uploads would have expired, a client retrying a failed commit within
        ``upload_ttl_s`` would find its objects gone."""
        if self.gc_grace_s < self.upload_ttl_s:
            raise ValueError(
                f"hub.gc_grace_s ({self.gc_grace_s:g}) is below hub.upload_ttl_s "
                f"({self.upload_ttl_s:g}): a failed commit's stored objects would be collected "
                "while its uploads would still be kept"
            )
        return self

    def front_matter(self) -> FrontMatterLimits:
        """The front-matter limits commits and /api/validate-yaml hold cards to."""
        return FrontMatterLimits(self.max_front_matter_bytes, self.max_front_matter_depth)

    def commit_files_problem(self, count: int, what: str) -> str | None:
        """Why ``what`` (a preupload, a commit body, a commit's tree) holding ``count`` files is
        refused (over ``max_commit_files``), else None."""
        if count <= self.max_commit_files:
            return None
        return (
            f"{what} holds {count} files, over the limit of {self.max_commit_files} files per "
            "commit (hub.max_commit_files)"
        )


class ObjectStoreSettings(_Section):
    """Blobs in an S3-compatible object store (AWS S3, Ceph RGW, SeaweedFS, Garage) instead of
    the store folder, moved by clients through presigned URLs. Credentials come from boto3's
    usual sources (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
    ``~/.aws/``), never from these settings, and are never logged."""

    endpoint: str | None = Field(
        None,
        description="the S3 API's URL as the hub reaches it, e.g. http://s3.internal:8333 "
        "(unset: blobs stay in the store folder, the embedded default)",
    )
    public_endpoint: str | None = Field(
        None,
        description="the S3 API's URL as clients reach it, which presigned URLs name "
        "(SigV4 signs the host; default: endpoint)",
    )
    bucket: str = Field("vip-hub", description="the bucket holding blobs, uploads and staging")
    region: str = Field("us-east-1", description="the region SigV4 signs for")
    addressing_style: Literal["path", "virtual", "auto"] = Field(
        "path", description="bucket in the path (most self-hosted stores) or in the host name"
    )
    presign_ttl_s: int = Field(
        900,
        gt=0,
        le=7 * 24 * 3600,
        description="lifetime of a presigned upload or download URL",
    )
    max_staged_bytes: int = Field(
        32 * GIB,
        gt=0,
        description="bytes of presigned uploads one user may hold unverified at once (each "
        "counted from its LFS batch reply until its verify, or until the uploads' "
        "collection after hub.upload_ttl_s); an object past it is answered 429 in the batch",
    )
    multipart_chunk_bytes: int = Field(
        64 * MIB,
        ge=5 * MIB,
        description="LFS objects larger than this are uploaded in parts of this size, each "
        "through its own presigned URL (S3 takes parts of 5 MiB and more, 10,000 at most); the "
        "hub's own uploads and copies into the bucket are split the same way",
    )


class AuthSettings(_Section):
    """Tokens and organisations. The server keeps only the tokens' SHA-256 hashes."""

    tokens_file: Path | None = Field(
        None,
        description="a single-host store's tokens file, moved into the index at the first "
        "start (default: STORE/tokens.json); tokens and organisations are then managed with "
        "`vip-hub token` and `vip-hub org`",
    )
    tokens: str | None = Field(
        None,
        description="extra tokens, 'name:scope:secret' separated by ';' (e.g. from a secret store)",
    )
    orgs: dict[str, list[str]] = Field(
        default_factory=dict,
        description=(
            "organisations and their member users, e.g. {vip = ['alice']}: members write to the "
            "organisation's repos and read its private ones (beside those `vip-hub org` writes)"
        ),
    )
    inherit: list[str] = Field(
        default_factory=list,
        description="names of the settings' users and organisations that take a revoked index "
        "user's namespace, its repos and its organisation memberships on purpose (the settings' "
        "`--inherit`): without it, such a name stops the server",
    )
    protect_inference: bool = Field(False, description="require a read token on /v1/* endpoints")


class InferenceSettings(_Section):
    """Batched embeddings and classification."""

    enabled: bool = True
    device: str = Field("auto", description=f"where forward passes run: {DEVICE_HELP}")
    preload: list[str] = Field(
        default_factory=list, description="models loaded and warmed up before ready"
    )
    max_loaded_models: int = Field(
        4,
        gt=0,
        description="LRU bound on models held in memory, and on models loading at once "
        "together with evicted ones still finishing their queued work (a request for one more "
        "is answered 429 meanwhile)",
    )
    max_batch_size: int = Field(32, gt=0)
    max_wait_ms: float = Field(5.0, ge=0, description="longest wait to fill a batch")
    max_queue_images: int = Field(
        512,
        gt=0,
        description="image passes queued per model before 429: an image counts once, a "
        "/v1/zero-shot image once per label (a text-decoder pass each); a zero-shot request "
        "of more images x labels is answered 413",
    )
    request_timeout_s: float = Field(30.0, gt=0, description="deadline for a request in the queue")
    torch_threads: int = Field(
        0, ge=0, description="torch intra-op threads of the forward pass (0: all cores)"
    )
    preprocess_threads: int = Field(
        1, gt=0, description="threads decoding and preprocessing beside the forward"
    )
    max_images_per_request: int = Field(64, gt=0)
    max_image_bytes: int = Field(10 * MIB, gt=0)
    max_request_bytes: int = Field(64 * MIB, gt=0)
    max_image_pixels: int = Field(
        4096 * 4096, gt=0, description="width x height of one image, checked from its header"
    )
    max_request_pixels: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="width x height summed over a request's "
        "images, checked from their headers before any is decoded",
    )
    max_caption_tokens: int = Field(
        40,
        gt=0,
        le=MAX_CAPTION_TOKENS,
        description="most tokens a /v1/captions caption may ask for",
    )
    max_labels: int = Field(100, gt=0, description="label texts per /v1/zero-shot request")
    max_aspect_ratio: float = Field(
        16.0,
        ge=1,
        description="longer side over shorter side of one image, from its header; 400 beyond",
    )
    max_resized_pixels: int = Field(
        4 * MIB,
        gt=0,
        description="pixels of one image once resized to the model's input: a longer image is "
        "centre-cropped along its long side first (the part the centre crop drops)",
    )
    max_json_depth: int = Field(
        8, gt=0, description="JSON nesting of a /v1 body, checked before it is parsed (400)"
    )
    max_pending_requests: int = Field(
        64,
        gt=0,
        description="/v1 requests with a body served at once (read, decoded, queued or "
        "computed); more are answered 429 with Retry-After before their body is read",
    )
    max_pending_bytes: int = Field(
        256 * MIB,
        gt=0,
        description="bytes the bodies of the /v1 requests served at once hold together (a "
        "chunked body counts as max_request_bytes); one over it is answered 429 with "
        "Retry-After before it is read",
    )
    body_timeout_s: float = Field(
        60,
        gt=0,
        description="the longest an admitted /v1 body may take to arrive; a slower one is "
        "answered 408 and frees its share of max_pending_requests and max_pending_bytes (a "
        "client that opens bodies and never sends them cannot hold the inference routes)",
    )

    @property
    def max_json_commas(self) -> int:
        """Commas a /v1 JSON body may hold outside its strings (checked before it is parsed,
        413): its images and labels, and ``REQUEST_FIELDS`` fields beside them."""
        return self.max_images_per_request + self.max_labels + REQUEST_FIELDS

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        """An unknown name fails here; a missing GPU when the inference engine is created (at
        start-up, not at the first request), so that the hub's processes need no torch."""
        return check_device_name(value)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        """A request within the per-request limits must fit the shared ones, else it is refused
        forever (429, or 413 for a one-image zero-shot request of ``max_labels`` labels)."""
        for shared, single in (
            ("max_queue_images", "max_images_per_request"),
            ("max_queue_images", "max_labels"),
            ("max_pending_bytes", "max_request_bytes"),
        ):
            if getattr(self, shared) < getattr(self, single):
                raise ValueError(
                    f"inference.{shared} ({getattr(self, shared)}) is below inference.{single} "
                    f"({getattr(self, single)}): a request within the one would be refused by the "
                    "other forever"
                )
        return self


class Settings(BaseSettings):
    """Everything `vip-hub serve` reads."""

    model_config = SettingsConfigDict(
        env_prefix="VIP_HUB_", env_nested_delimiter="__", extra="forbid"
    )

    store: Path = Field(
        DEFAULT_STORE, description="the store: blobs, uploads and (by default) its SQLite index"
    )
    index: str | None = Field(
        None,
        description="postgresql://user:password@host:port/db: the store's index in "
        "PostgreSQL, so several hub processes on several hosts share one store (with an "
        "object store, each with a folder of its own; else its folder on a shared "
        "filesystem); default: SQLite inside the store",
    )
    host: str = DEFAULT_HOST
    port: Port = DEFAULT_PORT
    forwarded_allow_ips: str = Field(
        "127.0.0.1",
        min_length=1,
        description="addresses (comma-separated; '*' any) whose X-Forwarded-Proto and "
        "X-Forwarded-For the server believes: its load balancer's, so that behind one that "
        "terminates TLS the URLs it hands out (LFS and Xet actions, pages) are https; '*' only "
        "where nothing else reaches the server (a compose network)",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    drain_s: float = Field(
        120,
        gt=0,
        description="graceful drain on SIGTERM: the server stops accepting at once, then gives "
        "the requests in flight (uploads, commits, inference batches) this long to finish "
        "before it cancels them and exits",
    )
    max_body_bytes: int = Field(
        MIB,
        gt=0,
        description="largest request body of the routes without a limit of "
        "their own (hub JSON API: repo creation, preupload, LFS batch, tags, "
        "validate-yaml; pages; operations); uploads and /v1/* have theirs",
    )
    api_docs: bool = Field(
        False,
        description="serve /docs and /redoc, FastAPI's pages, which load their JavaScript from "
        "a third party (cdn.jsdelivr.net); the schema is at /openapi.json either way",
    )
    hub: HubSettings = Field(default_factory=HubSettings)
    object_store: ObjectStoreSettings = Field(default_factory=ObjectStoreSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    inference: InferenceSettings = Field(default_factory=InferenceSettings)

    def tokens_path(self) -> Path:
        """A single-host store's tokens file (adopted into the index): ``auth.tokens_file``, else
        ``tokens.json`` in the store."""
        return self.auth.tokens_file or self.store / "tokens.json"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config = os.environ.get(CONFIG_ENV)
        if config:
            if not Path(config).is_file():
                raise ConfigError(f"--config or {CONFIG_ENV} names {config}, which is not a file")
            try:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config))
            except UnicodeDecodeError as e:
                raise ConfigError(f"{config}: not UTF-8 ({e})") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{config}: not valid TOML: {e}") from None
            except OSError as e:
                raise ConfigError(f"{config}: cannot be read: {e.strerror or e}") from None
        return tuple(sources)


def load_settings(**overrides: Any) -> Settings:
    """The settings (``overrides``: the command's options); ConfigError, one line naming the
    settings file (``VIP_HUB_CONFIG``) and each bad setting with its value (a secret's
    never), for invalid ones."""
    try:
        return Settings(**overrides)
    except ValidationError as e:
        where = os.environ.get(CONFIG_ENV) or "settings"
        problems = []
        for err in e.errors(include_url=False):
            name = ".".join(str(part) for part in err["loc"])
            message = err["msg"].removeprefix("Value error, ")
            if name and not message.startswith(name):
                message = f"{name}: {message}"
            secret = err["loc"][:1] in (("auth",), ("index",))  # tokens, a database password
            if err["type"] not in ("value_error", "extra_forbidden") and not secret:
                message += f" (got {err['input']!r})"
            problems.append(message)
        raise ConfigError(f"{where}: " + "; ".join(problems)) from None
