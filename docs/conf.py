"""Sphinx configuration of lightprune's documentation: guide pages in Markdown (MyST), an API reference from the
docstrings (autodoc, Google style through napoleon). It builds offline and warning-free, from the repository root:

    sphinx-build -W --keep-going -c docs . docs/_build/html

The source folder is the repository root, narrowed by ``include_patterns`` to ``docs/`` and the Markdown files at
the root (BENCHMARKS.md, CHANGELOG.md...), so every relative link means the same file on GitHub as in the built
docs.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # the checkout's package, whether or not it is installed

import lightprune  # noqa: E402

project = "lightprune"
author = "lightprune contributors"
copyright = "lightprune contributors, Apache-2.0"
version = release = lightprune.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]  # no intersphinx: the build is offline
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
include_patterns = [
    "docs/**",
    "BENCHMARKS.md",
    "CHANGELOG.md",
    "CONTRIBUTING.md",
    "RELIABILITY.md",
    "examples/*/README.md",
]
exclude_patterns = ["docs/_build", "docs/_extra", "docs/conf.py", ".*", "**/.*", "build", "dist"]
root_doc = "docs/index"

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True  # defaults as written in the source (a tuple of classes has no parseable repr)
autodoc_default_options = {"members": True, "show-inheritance": True}

myst_heading_anchors = 3  # links to a page's sections (page.md#section) resolve
html_theme = "alabaster"
html_static_path: list[str] = []
html_extra_path = ["_extra"]  # index.html at the top of the output, pointing at docs/index.html
