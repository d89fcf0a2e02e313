"""The book: the README as its front page, the chapters' overview (notebooks/README.md), one page per
chapter, the exercises (exercises/README.md) and the pages of the records the README links
(profiles/). Sphinx with myst-nb (the stack Jupyter Book 1 is built on) and the Jupyter Book theme.

    make book        # build/book/html/index.html; reads what is committed, executes nothing

A chapter's page shows its notebook as committed (notebooks/NN_*.ipynb): the outputs of one
execution for the book, whose first output names the machine, the commit, the date and the
settings (notebooks/nb/provenance.py). myst-nb renders those stored outputs and never runs a
chapter here (nb_execution_mode "off"); `make book-execute` runs them. A chapter whose notebook
is stale, not executed or executed other than for the book (notebooks/build.py's problems) gets
a box at its top saying so, and the build prints a warning for it.

Sphinx reads from the repository's root (the pages link each other and profiles/'s charts by
their paths in the repository, as GitHub shows them), only the files include_patterns names.

A link to a source file (a chapter's "read stages/kernels/sync.py") opens that file as a page of
the book, its code highlighted with numbered lines (`_code/<its path>.html`), where Sphinx would
offer the file as a download: the reader reads the code the chapter points at without leaving
the book. A path the text names in code (`stages/kernels/sync.py`) becomes such a link too (or a
link to the page, where it names one of the book's pages), and one that names no file of the
repository is a warning. Each page is the file as it is when the book is built.
"""

from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent
ROOT = CONF.parents[1]
sys.path.insert(0, str(ROOT))

from docutils import nodes  # noqa: E402
from pygments.lexers import get_lexer_for_filename  # noqa: E402
from pygments.util import ClassNotFound  # noqa: E402
from sphinx import addnodes  # noqa: E402
from sphinx.util import logging  # noqa: E402

from notebooks import build as chapters  # noqa: E402

logger = logging.getLogger(__name__)

project = "Why is an LLM slow?"
html_title = project
extensions = ["myst_nb"]
root_doc = "README"
include_patterns = ["README.md", "notebooks/README.md", "notebooks/[0-9][0-9]_*.ipynb", "exercises/README.md",
                    "profiles/*.md", "profiles/**/*.md"]
exclude_patterns = [".venv", ".git", ".numba_cache*", "models", "build", "**/.ipynb_checkpoints", "tests",
                    "notebooks/src", "notebooks/nb", "notebooks/book"]
suppress_warnings = ["toc.not_included",      # profiles/'s pages are reached by the README's links, not the menu
                    "mystnb.unknown_mime_type"]  # the JSON beside a caption or findings is for the tests

nb_execution_mode = "off"                    # render the committed outputs; `make book-execute` executes
nb_render_markdown_format = "gfm"            # the chapters' Markdown outputs hold tables
nb_merge_streams = True
smartquotes = False                          # a flag's "--" and the code quoted in tables stay as typed
myst_heading_anchors = 3

html_theme = "sphinx_book_theme"
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "use_download_button": True,
    "footer_content_items": [],        # the theme's default footer says "By Author name not set"
}
html_static_path = [str(CONF / "static")]
html_css_files = ["book.css"]
templates_path = [str(CONF / "templates")]
html_additional_pages = {"index": "redirect.html"}      # index.html opens the front page
html_context = {"front_page": f"{root_doc}.html"}
html_show_sourcelink = False
html_sourcelink_suffix = ""            # the theme's "download source" gives the chapter's .ipynb, as committed

CHAPTERS = [f"notebooks/{p.stem}" for p in chapters.sources()]
OVERVIEW = "notebooks/README"
EXERCISES = "exercises/README"

# A Markdown link [label](target) to a folder of the repository: the book has no page for a folder.
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")

def folder_links_as_text(docname: str, text: str) -> str:
    """Links to a folder of the repository become its name in code: the book has no page for a folder."""
    here = (ROOT / docname).parent

    def one(m):
        label, target = m.group(1), m.group(2)
        if "://" in target or target.startswith(("#", "mailto:")):
            return m.group(0)
        path = (here / target.split("#")[0]).resolve()
        if path.is_dir():
            return label if "`" in label else f"`{label}`"
        return m.group(0)
    return LINK.sub(one, text)


def front_page(text: str) -> str:
    """The README with the book's menu: the chapters' overview, every chapter, the exercises."""
    toc = "\n".join([OVERVIEW, *CHAPTERS, *([EXERCISES] if (ROOT / f"{EXERCISES}.md").exists() else [])])
    return text + f"\n\n```{{toctree}}\n:hidden:\n:caption: The course\n\n{toc}\n```\n"


def chapter_with_state(app, docname: str, text: str) -> str:
    """A chapter's notebook, with a box at its top where it is not the book's execution of its
    source now (notebooks/build.py problems); the page is read again when its source changes."""
    name = docname.split("/")[-1]
    path, source = ROOT / f"{docname}.ipynb", ROOT / "notebooks" / "src" / f"{name}.py"
    app.env.note_dependency(str(source))
    found = chapters.problems(path, source)
    if not found:
        return text
    for problem in found:
        logger.warning(f"{docname}: {problem}", location=docname)
    nb = json.loads(text)
    items = "\n".join(f"- {p}" for p in found)
    box = {"cell_type": "markdown", "id": f"{name}-book-state", "metadata": {},
           "source": f"```{{admonition}} This page is not the book's execution of this chapter\n:class: warning\n\n"
                     f"{items}\n```"}
    nb["cells"].insert(1, box)
    return json.dumps(nb)


CODE = "_code"       # the source files' pages: _code/<path in the repository>.html


SOURCE = (".py", ".cu", ".c", ".h", ".sh", ".toml")    # the code a page shows; a record (.json) stays a file


def code_lexer(path: str) -> str | None:
    """The Pygments lexer of a source file the book shows as a page, or None: a file to download."""
    if not path.endswith(SOURCE):
        return None
    try:
        return get_lexer_for_filename(path).aliases[0]
    except ClassNotFound:
        return None


def source_links_as_pages(app, doctree, docname):
    """A link to a source file points at its page (source_pages), not at a copy to download."""
    for node in list(doctree.findall(addnodes.download_reference)):
        path = Path(app.env.relfn2path(node["reftarget"], node.get("refdoc", docname))[0]).as_posix()
        if code_lexer(path) is None:
            continue
        link = nodes.reference("", "", *node.children, internal=True,
                               refuri=app.builder.get_relative_uri(docname, f"{CODE}/{path}"))
        node.replace_self(link)


# A code span that names a file of the repository by its path from the root: `stages/kernels/sync.py`
# (not a pattern or a placeholder: `profiles/bench/ttft_*.json`, `notebooks/NN_<name>.ipynb`).
NAMED = re.compile(r"[a-z_]+/[A-Za-z0-9_./-]+\.[A-Za-z0-9]+")
NOT_IN_REPO = ("build", "models")     # folders of files made or fetched, which the repository does not hold


def repo_path(text: str) -> str | None:
    """The repository path a code span's text names (under one of the repository's folders), or None."""
    text = text.strip()
    top = text.split("/")[0]
    return text if NAMED.fullmatch(text) and top not in NOT_IN_REPO and (ROOT / top).is_dir() else None


def named_path(literal) -> str | None:
    """The repository path a code span outside any link (and outside a title) names, or None."""
    if any(isinstance(a, (nodes.reference, nodes.title, addnodes.download_reference)) for a in _ancestors(literal)):
        return None
    return repo_path(literal.astext())


def _ancestors(node):
    while node.parent is not None:
        node = node.parent
        yield node


def book_page(app, path: str) -> str | None:
    """The book's page of a repository file (a chapter's notebook, a Markdown page), if it has one."""
    doc = str(Path(path).with_suffix(""))
    return doc if doc in app.env.found_docs and path.endswith((".md", ".ipynb")) else None


def collect_named_files(app, doctree):
    """The source files a page names in code, which get pages of their own (source_pages)."""
    named = app.env.__dict__.setdefault("named_files", {})
    named[app.env.docname] = {p for lit in doctree.findall(nodes.literal) if (p := named_path(lit)) is not None
                              and (ROOT / p).is_file() and not book_page(app, p) and code_lexer(p)}


def forget_named_files(app, env, docname):
    env.__dict__.get("named_files", {}).pop(docname, None)


def merge_named_files(app, env, docnames, other):
    env.__dict__.setdefault("named_files", {}).update(other.__dict__.get("named_files", {}))


def named_files_as_links(app, doctree, docname):
    """A code span that names a file links to the file's page (or to its page in the book); one that
    names no file of the repository is a warning (the text names a file that moved or went)."""
    for literal in list(doctree.findall(nodes.literal)):
        path = named_path(literal)
        if path is None:
            continue
        if not (ROOT / path).is_file():
            logger.warning(f"{docname}: `{path}` names no file of the repository", location=literal)
            continue
        page = book_page(app, path) or (f"{CODE}/{path}" if code_lexer(path) else None)
        if page is not None:
            link = nodes.reference("", "", internal=True, refuri=app.builder.get_relative_uri(docname, page))
            literal.replace_self(link)
            link += literal


def source_pages(app):
    """One page per source file a page links to or names in code: its path as the title, its code
    with numbered lines, each line an anchor (#L-12)."""
    named = set().union(*app.env.__dict__.get("named_files", {}).values())
    for path in sorted({Path(p).as_posix() for p in app.env.dlfiles} | named):
        lexer = code_lexer(path)
        if lexer is None or not (ROOT / path).is_file():
            continue
        text = (ROOT / path).read_text()
        lines = text.count("\n")
        code = app.builder.highlighter.highlight_block(text, lexer, linenos="table", lineanchors="L",
                                                       anchorlinenos=True)
        body = (f'<div class="code-page">\n<h1><code>{html.escape(path)}</code></h1>\n'
                f'<p>The file as it was when this book was built: {lines} lines.</p>\n{code}</div>')
        yield f"{CODE}/{path}", {"title": path, "body": body, "parents": []}, "page.html"


def on_source_read(app, docname, source):
    if docname in CHAPTERS:
        source[0] = chapter_with_state(app, docname, source[0])
        return
    text = folder_links_as_text(docname, source[0])
    source[0] = front_page(text) if docname == root_doc else text


def setup(app):
    app.connect("source-read", on_source_read)
    app.connect("doctree-resolved", source_links_as_pages)
    app.connect("doctree-read", collect_named_files)
    app.connect("env-purge-doc", forget_named_files)
    app.connect("env-merge-info", merge_named_files)
    app.connect("doctree-resolved", named_files_as_links)
    app.connect("html-collect-pages", source_pages)
