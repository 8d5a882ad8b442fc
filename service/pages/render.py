"""Model cards as safe HTML: Markdown (no raw HTML) rendered by markdown-it-py, then
sanitised by nh3; relative links and images point at the repo's files at that revision."""

from __future__ import annotations

from urllib.parse import quote, urlsplit

import nh3
from markdown_it import MarkdownIt

from vip_hub.repo.card import load_card

__all__ = ["card_body", "markdown_html"]

_md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
_TAGS = {
    "a",
    "abbr",
    "b",
    "blockquote",
    "br",
    "code",
    "del",
    "em",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "hr",
    "i",
    "img",
    "li",
    "ol",
    "p",
    "pre",
    "strong",
    "table",
    "tbody",
    "td",
    "th",
    "thead",
    "tr",
    "ul",
}
_ATTRS = {
    "a": {"href", "title"},
    "img": {"src", "alt", "title"},
    "th": {"align"},
    "td": {"align"},
    "code": {"class"},
}


def card_body(readme: str) -> str:
    """The Markdown of a card without its YAML front matter."""
    return load_card(readme).text


def markdown_html(text: str, file_base: str | None = None) -> str:
    """Sanitised HTML for ``text``; relative ``src``/``href`` are resolved under ``file_base``."""

    def rewrite(tag: str, attr: str, value: str) -> str | None:
        if attr in ("src", "href") and file_base and _relative(value):
            return f"{file_base}/{quote(value.lstrip('./'))}"
        return value

    return nh3.clean(
        _md.render(text),
        tags=_TAGS,
        attributes=_ATTRS,
        attribute_filter=rewrite,
        url_schemes={"http", "https", "mailto"},
        link_rel="noopener noreferrer nofollow",
    )


def _relative(url: str) -> bool:
    parts = urlsplit(url)
    return not (parts.scheme or parts.netloc or url.startswith(("/", "#")))
