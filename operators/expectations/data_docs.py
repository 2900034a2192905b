"""GX Data Docs views that compile each Jinja template once per process.

GX's `DefaultJinjaView` gives every view its own Jinja `Environment`, and a site build makes a
new view per section (expectations, validations, profiling, index), so one build of the digits
docs compiled ~50 templates (about 60% of the build) and the next build compiled them all
again. These views are GX's own, with one in-memory bytecode cache shared by all of them: a
template is compiled the first time any view loads it, and later loads reuse the compiled code
(Jinja still reads the source and checks its checksum, so a changed template recompiles). The
pages are the same; `operators.validation.run_expectations` names these classes in the site
config.

Imports GX: loaded by GX itself when it builds a site, never by a DAG file.
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
