"""Sphinx configuration: Markdown pages (MyST) and an API reference generated from the docstrings (autodoc).

Build with warnings as errors, from the repository root:

    sphinx-build -W -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document the checkout, installed or not

import autofit  # noqa: E402

project = "autofit"
author = "the autofit authors"
copyright = "the autofit authors"  # noqa: A001 - Sphinx's name
release = autofit.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # "#how-the-step-is-defined"-style links between pages

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"  # a dataclass's signature lists its fields

html_theme = "alabaster"
html_title = f"autofit {release}"
html_static_path: list[str] = []
