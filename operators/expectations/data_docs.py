"""GX Data Docs views that compile each Jinja template once per process: GX's own views, with one
shared bytecode cache instead of a Jinja environment per view (a changed template recompiles).

Named in the site config by `operators.validation.run_expectations`; loaded by GX when it builds a
site, never by a DAG file. Why, and what it saves: docs/design/data-docs.md.
"""

from __future__ import annotations

from types import CodeType
from typing import Any

from great_expectations.render.view import DefaultJinjaIndexPageView, DefaultJinjaPageView
from jinja2.bccache import Bucket, BytecodeCache


class InMemoryBytecodeCache(BytecodeCache):
    """Jinja bytecode cache in a dict: {template key: (source checksum, code object)}."""

    def __init__(self) -> None:
        self._code: dict[str, tuple[str, CodeType]] = {}

    def load_bytecode(self, bucket: Bucket) -> None:
        checksum, code = self._code.get(bucket.key, (None, None))
        if code is not None and checksum == bucket.checksum:
            bucket.code = code

    def dump_bytecode(self, bucket: Bucket) -> None:
        if bucket.code is not None:
            self._code[bucket.key] = (bucket.checksum, bucket.code)

    def clear(self) -> None:
        self._code.clear()


#: Shared by every view in the process. The key is the template's name and file (custom view
#: folders included), the checksum its source; every view's Environment has the same settings.
BYTECODE = InMemoryBytecodeCache()


class CachedJinjaPageView(DefaultJinjaPageView):
    """GX's page view (suite and validation pages) with the shared bytecode cache."""

    # Named arguments, not *args: GX passes a view only the arguments its __init__ names.
    def __init__(self, custom_styles_directory: str | None = None, custom_views_directory: str | None = None) -> None:
        super().__init__(custom_styles_directory=custom_styles_directory, custom_views_directory=custom_views_directory)
        self.env.bytecode_cache = BYTECODE


class CachedJinjaIndexPageView(DefaultJinjaIndexPageView):
    """GX's index page view with the shared bytecode cache."""

    # Named arguments, not *args: GX passes a view only the arguments its __init__ names.
    def __init__(self, custom_styles_directory: str | None = None, custom_views_directory: str | None = None) -> None:
        super().__init__(custom_styles_directory=custom_styles_directory, custom_views_directory=custom_views_directory)
        self.env.bytecode_cache = BYTECODE


def site_config(base_directory: str) -> dict[str, Any]:
    """A SiteBuilder config: GX's default sections and index on the local filesystem at
    `base_directory`, rendered with the views above; no how-to buttons."""
    view = {"module_name": __name__, "class_name": CachedJinjaPageView.__name__}
    return {
        "class_name": "SiteBuilder",
        "show_how_to_buttons": False,
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": base_directory},
        "site_index_builder": {
            "class_name": "DefaultSiteIndexBuilder",
            "view": {"module_name": __name__, "class_name": CachedJinjaIndexPageView.__name__},
        },
        # Merged by GX into its default sections: only the view changes.
        "site_section_builders": {section: {"view": view} for section in ("expectations", "validations", "profiling")},
    }
