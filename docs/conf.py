"""Sphinx configuration of mpi4dask's documentation (MyST Markdown pages, numpydoc API reference).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (CI runs exactly this).
"""

import os
import sys

# the checkout's own package, installed or not
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import mpi4dask  # noqa: E402

project = "mpi4dask"
author = "mpi4dask developers"
copyright = "mpi4dask developers"
version = release = mpi4dask.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "numpydoc",
    "sphinxarg.ext",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# numpydoc: no autosummary tables of members (every public name has its own entry)
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types

# No network at build time: no intersphinx; names of other projects stay plain text.
nitpicky = False

html_theme = "pydata_sphinx_theme"
html_title = f"mpi4dask {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_static_path = []
