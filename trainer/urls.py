"""Credentials in URLs: found (`has_credentials`) and hidden (`redact_url`), in one place.

Settings that are URLs (data.remote, checkpoint.uri, run dirs, tracking URIs, the DVC remote) refuse
user info: credentials come from the storage's environment (`AWS_*`) or Secret references. Every
text that may quote a URL is shown through `redact_url` before it is printed, logged or recorded.
"""

from __future__ import annotations

import re

# User info runs to the last `@` before the host's end (`/ ? #` or a space), as urllib reads it: a
# password may hold quotes and `@`.
_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]{0,31}://)([^/?#\s]{1,2048})@")
_LEADING_USERINFO = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#\s]*@")


def has_credentials(url: object) -> bool:
    """Whether `url`, or any link of an fsspec chain (`simplecache::s3://...`), carries user info
    (`user:password@` or a token before `@`)."""
    return isinstance(url, str) and any(_LEADING_USERINFO.match(link.strip()) for link in url.split("::"))


def _hide(match: re.Match) -> str:
    user, colon, _ = match.group(2).partition(":")
    return f"{match.group(1)}{user}:***@" if colon else f"{match.group(1)}***@"


def redact_url(text: object) -> object:
    """`text` with the password of every URL in it replaced by `***` (a lone user part, often a
    token, too); anything but a string is returned as is."""
    return _USERINFO.sub(_hide, text) if isinstance(text, str) else text


def credentials_refusal(field: str, url: str, where: str = "from the environment (AWS_* variables) or a Secret") -> str:
    """The message that refuses `url` for `field` (shown redacted)."""
    return f"{field}={redact_url(url)!r}: must not carry credentials (user:password@); they come {where}"
