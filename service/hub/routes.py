"""The hub half's routers, in the order they must be matched."""

import re

from fastapi import APIRouter

from . import downloads, lfs, metadata, publish, xet

router = APIRouter()
router.include_router(metadata.router, tags=["hub"])
router.include_router(publish.router, tags=["hub"])
router.include_router(xet.router, tags=["hub"])
router.include_router(lfs.router, tags=["hub"])
router.include_router(downloads.router, tags=["hub"])

STREAMED_UPLOADS = re.compile(
    r"/api/models/[^/]+/[^/]+/commit/"  # NDJSON commits: the upload limit, as the body streams
    r"|/[^/]+/[^/]+\.git/info/lfs/objects/[0-9a-f]{64}$"  # LFS PUT: the size the batch granted
    rf"|{xet.CAS_PREFIX}/[^/]+/v1/(xorbs/|shards$)"  # Xet xorbs and shards: their own bounds
)
"""Request paths whose routes stream their bodies to disk under their own limits."""

__all__ = ["STREAMED_UPLOADS", "router"]
