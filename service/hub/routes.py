"""The hub half's routers, in the order they must be matched."""

from fastapi import APIRouter

from . import downloads, lfs, metadata, publish, xet

router = APIRouter()
router.include_router(metadata.router, tags=["hub"])
router.include_router(publish.router, tags=["hub"])
router.include_router(xet.router, tags=["hub"])
router.include_router(lfs.router, tags=["hub"])
router.include_router(downloads.router, tags=["hub"])

__all__ = ["router"]
