"""Model cards as safe HTML: Markdown (no raw HTML) rendered by markdown-it-py, then
sanitised by nh3; relative links and images point at the repo's files at that revision, and an
image from another site is a link to it (pages load images from the hub only)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import urlsplit

import nh3
from huggingface_hub.repocard import REGEX_YAML_BLOCK
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markdown_it.renderer import RendererHTML
from markdown_it.token import Token
from markdown_it.utils import EnvType, OptionsDict

__all__ = ["card_body", "markdown_html"]

_md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")


def _image(
    renderer: RendererHTML, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType
) -> str:
    """An image on the hub itself as an image; one from elsewhere as a link to it, by its alt."""
    token = tokens[idx]
    src = str(token.attrGet("src") or "")
    if _relative(src) or (src.startswith("/") and not src.startswith("//")):
        return renderer.image(tokens, idx, options, env)
    alt = renderer.renderInlineAsText(token.children or [], options, env) or src
    return f'<a href="{escapeHtml(src)}">{escapeHtml(alt)}</a>'


_md.add_render_rule("image", _image)
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
    """The Markdown of a card without its YAML front matter, which is not parsed (where the card
    was written before its front matter was bounded, it is shown all the same)."""
    match = REGEX_YAML_BLOCK.search(readme)
    return readme[match.end() :] if match else readme


_LEADING_DOT_SLASHES = re.compile(r"^(?:\./)+")  # "./x" is "x"; a dot file stays


def markdown_html(text: str, file_base: str | None = None) -> str:
    """Sanitised HTML for ``text``; relative ``src``/``href`` are resolved under ``file_base``
    (as markdown-it wrote them: already percent-encoded, a fragment or query kept)."""

    def rewrite(tag: str, attr: str, value: str) -> str | None:
        if attr in ("src", "href") and file_base and _relative(value):
            return f"{file_base}/{_LEADING_DOT_SLASHES.sub('', value)}"
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
