"""The book (`make book`), built from the committed notebooks and read in a headless Chromium as a
reader reads it: every chapter's page loads, shows its charts (images the browser decoded) and the
caption that names the machine, commit and date of its figures, no link or image inside the
book is broken (every page reachable from the front page is visited and each internal link, file
and anchor checked; the source files' pages, one template many times over, are loaded once per
folder depth and otherwise read from their files), and a link to a source file opens the book's
page of that file, showing it as it is, never a download. Each check is shown failing on a planted
copy of the site: a broken image, a removed page, a link to nowhere and to a missing anchor, a
caption taken away, source pages that show other code, a link that offers a source file as a
download, a path in code that names no file.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from dataclasses import dataclass, field
from html import unescape
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlparse

import pytest

from app.report import browser as headless

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("myst_nb", reason="the book's tools are in requirements-book.txt (`make setup` installs them)")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load("notebooks_build", ROOT / "notebooks" / "build.py")
conf = _load("book_conf", ROOT / "notebooks" / "book" / "conf.py")
CHAPTERS = {p.stem: p for p in build.sources()}          # name -> committed notebook
IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    reason = headless.missing()
    if reason:
        pytest.skip(f"no headless browser: {reason} (`make browser` installs Debian's chromium and chromium-driver)")
    driver = headless.chromium(tmp_path_factory.mktemp("chromium"), flags=["--allow-file-access-from-files"])
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The book built as `make book` builds it (notebooks/build.py build_book), into a folder of its own."""
    out = tmp_path_factory.mktemp("book")
    build.build_book(out)
    return out / "html"


# ---- reading the site in the browser ---------------------------------------------------------------

# every image made eager and decoded (a lazy one below the fold is not loaded otherwise); what is on the page
READ_PAGE = """
const done = arguments[arguments.length - 1];
const imgs = Array.from(document.images);
imgs.forEach(i => { i.loading = 'eager'; });
Promise.all(imgs.map(i => i.decode().then(() => true, () => false))).then(decoded => done({
  h1: (document.querySelector('h1') || {}).textContent || '',
  ids: Array.from(document.querySelectorAll('[id]')).map(e => e.id)
        .concat(Array.from(document.querySelectorAll('a[name]')).map(e => e.name)),
  links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
  assets: Array.from(document.querySelectorAll('link[href], script[src]')).map(e => e.href || e.src),
  images: imgs.map((i, k) => [i.currentSrc || i.src, decoded[k] && i.complete && i.naturalWidth > 0,
                              !!i.closest('article, main')]),
  captions: Array.from(document.querySelectorAll('.chapter-provenance')).map(e => e.innerText),
  code: (document.querySelector('.code-page td.code pre') || {}).textContent || null,
  named: Array.from(document.querySelectorAll('article code'))
           .filter(c => !c.closest('a, pre, h1, h2, h3, h4, .code-page')).map(c => c.textContent.trim()),
}));
"""


REDIRECT = re.compile(r'http-equiv="refresh" content="0; url=([^"]+)"')    # index.html -> the front page


@dataclass
class Page:
    h1: str = ""
    ids: set = field(default_factory=set)
    links: list = field(default_factory=list)
    assets: list = field(default_factory=list)
    images: list = field(default_factory=list)      # (src, loaded, in the page's content)
    captions: list = field(default_factory=list)
    code: str | None = None                         # a source file's page: the code it shows
    named: list = field(default_factory=list)       # the text's code spans outside links


PLACEHOLDER = "Author name not set"          # what Sphinx prints for an author nobody set


def _file(url: str) -> Path:
    return Path(unquote(urlparse(url).path))


def read_page(browser, path: Path) -> Page:
    browser.get(path.as_uri())
    return Page(**{k: (set(v) if k == "ids" else v) for k, v in browser.execute_async_script(READ_PAGE).items()})


def read_file(path: Path) -> Page:
    """A page read from its HTML file, not in the browser: its links and assets (resolved as the
    browser resolves them), ids and code. For the source files' pages, one template many times
    over: the browser loads one of them per folder depth (a link written relative to the depth
    breaks for all of that depth at once), and each load costs a fifth of a second."""
    text, base = path.read_text(), path.as_uri()
    hrefs = re.findall(r'<a\s[^>]*?href="([^"]*)"', text)
    assets = re.findall(r'<(?:link|script)\s[^>]*?(?:href|src)="([^"]*)"', text)
    code = re.search(r'<td class="code">.*?<pre>(.*?)</pre>', text, re.S)
    return Page(h1=unescape(re.sub(r"<[^>]+>", "", (re.search(r"<h1>(.*?)</h1>", text, re.S) or [""])[0])),
                ids=set(re.findall(r'\sid="([^"]*)"', text)),
                links=[urljoin(base, unescape(h)) for h in hrefs], assets=[urljoin(base, unescape(a)) for a in assets],
                code=unescape(re.sub(r"<[^>]+>", "", code.group(1))) if code else None)


def crawl(browser, html: Path, only: tuple[str, ...] = ()) -> tuple[dict[Path, Page], list[str]]:
    """Every page reachable from the front page by links inside the book (or those of its pages
    under the folders `only` names, and the front page), read in the browser (the source files'
    pages: one per depth, the others from their files, read_file); and the problems met on the
    way: a link or asset that leaves the book or finds no file, a link to an anchor its page lacks,
    an image that did not load."""
    root = html.resolve()
    pages: dict[Path, Page] = {}
    problems, queue, anchors, depths = [], [], [], set()
    refresh = REDIRECT.search((root / "index.html").read_text()) if (root / "index.html").is_file() else None
    if refresh is None or not (root / refresh.group(1)).is_file():
        problems.append(f"index.html opens no front page ({refresh.group(1) if refresh else 'no redirect'})")
    else:
        queue.append(root / refresh.group(1))
    while queue:
        path = queue.pop(0)
        if path in pages:
            continue
        where = path.relative_to(root)
        if where.parts[0] == conf.CODE and len(where.parts) in depths:
            pages[path] = page = read_file(path)
        else:
            pages[path] = page = read_page(browser, path)
            if where.parts[0] == conf.CODE:
                depths.add(len(where.parts))
        if where.parts[0] != conf.CODE and PLACEHOLDER in path.read_text():     # (a code page may quote it)
            problems.append(f"{where}: shows Sphinx's placeholder '{PLACEHOLDER}' (the theme's footer: conf.py)")
        for src, loaded, _ in page.images:
            if not loaded:
                problems.append(f"{where}: image {src} did not load")
        for url in page.links + page.assets:
            target, fragment = urldefrag(url)
            if urlparse(target).scheme in ("http", "https", "mailto", "javascript", "data"):
                continue                                    # outside the book: not this test's (offline) business
            file = _file(target)
            if not file.is_relative_to(root):
                problems.append(f"{where}: link {url} leaves the book")
            elif not file.is_file():
                problems.append(f"{where}: link {file.relative_to(root)} finds no file")
            elif file.suffix == ".html" and (not only or file.relative_to(root).parts[0] in only):
                queue.append(file)
                if fragment:
                    anchors.append((where, file, fragment))
    for where, file, fragment in anchors:
        if fragment not in pages[file].ids:
            problems.append(f"{where}: link {file.relative_to(root)}#{fragment} finds no such anchor")
    return pages, problems


def chapter_problems(pages: dict[Path, Page], html: Path) -> list[str]:
    """Each chapter has its page, titled with its number, showing at least as many decoded images
    in its content as its notebook has charts, and a caption that names the machine and commit
    its notebook's provenance holds."""
    root, problems = html.resolve(), []
    for name, notebook in CHAPTERS.items():
        page = pages.get(root / "notebooks" / f"{name}.html")
        if page is None:
            problems.append(f"{name}: no page reached from the front page")
            continue
        if not page.h1.strip().startswith(name[:2]):
            problems.append(f"{name}: its page's title is {page.h1!r}")
        nb = json.loads(notebook.read_text())
        charts = sum(1 for c in nb["cells"] for o in c.get("outputs", []) if set(o.get("data", {})) & set(IMAGE_MIMES))
        shown = sum(1 for _, loaded, in_content in page.images if loaded and in_content)
        if shown < charts:
            problems.append(f"{name}: {shown} image(s) shown, its notebook has {charts} chart(s)")
        p = build.book_provenance(nb) or {}
        if not any(p.get("machine", "?") in c and (p.get("commit") or "?")[:7] in c for c in page.captions):
            problems.append(f"{name}: no caption naming the machine and commit of its figures "
                            f"({p.get('machine')}, {(p.get('commit') or '')[:7]}); captions: {page.captions}")
    return problems


def source_problems(pages: dict[Path, Page], html: Path) -> list[str]:
    """No link offers a source file as a download (Sphinx's _downloads/): it opens the file's
    page (conf.py source_pages), and each such page shows the file as it is in the repository.
    A code span that names a source file or a page by its path is a link (conf.py
    named_files_as_links); one that is not names a file the repository does not have."""
    root, problems = html.resolve(), []
    for path, page in pages.items():
        where = path.relative_to(root)
        for text in page.named:
            if conf.repo_path(text) and (conf.code_lexer(text) or text.endswith((".md", ".ipynb"))):
                problems.append(f"{where}: `{text}` is not a link: no such file in the repository?")
        for url in page.links:
            file = _file(urldefrag(url)[0])
            if "_downloads" in file.parts and conf.code_lexer(file.name):
                problems.append(f"{where}: link to {file.name} offers a download, not its page")
        if where.parts[0] == conf.CODE:
            source = ROOT / where.relative_to(conf.CODE).with_suffix("")        # x.py.html -> x.py
            if page.code is None or page.code.rstrip("\n") != source.read_text().rstrip("\n"):
                problems.append(f"{where}: does not show {source.relative_to(ROOT)} as it is")
    return problems


# ---- the checks ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def read(site, browser):
    return crawl(browser, site)


def test_every_chapter_page_shows_its_charts_and_their_provenance(site, read):
    pages, _ = read
    problems = chapter_problems(pages, site)
    assert not problems, "\n".join(problems)
    assert site.resolve() / "README.html" in pages, "the front page"


def test_no_link_or_image_inside_the_book_is_broken(read):
    pages, problems = read
    assert len(pages) > len(CHAPTERS)
    assert not problems, "\n".join(problems)


def test_a_link_to_a_source_file_opens_the_file_in_the_book(site, read):
    pages, _ = read
    shown = [p for p in pages if p.relative_to(site.resolve()).parts[0] == conf.CODE]
    assert len(shown) >= len(CHAPTERS), f"the chapters link {len(shown)} source file(s) the crawl reached"
    problems = source_problems(pages, site)
    assert not problems, "\n".join(problems)


def test_each_check_fails_on_a_planted_site(site, browser, tmp_path):
    """A copy of the site, spoiled nine ways; each spoiling is reported, by the check that owns it."""
    planted = tmp_path / "html"
    shutil.copytree(site, planted)
    chapters = planted / "notebooks"
    names = list(CHAPTERS)
    broken_img, removed, bad_links, no_caption = names[2], names[5], names[12], names[3]

    page = chapters / f"{broken_img}.html"
    text = page.read_text()
    assert 'src="../_images/' in text, f"{broken_img} has no chart to break"
    page.write_text(text.replace('src="../_images/', 'src="../_images/planted-missing-', 1))
    (chapters / f"{removed}.html").unlink()
    page = chapters / f"{bad_links}.html"
    page.write_text(page.read_text().replace(
        "</article>", f'<a href="planted-nowhere.html">x</a><a href="{names[2]}.html#planted-no-anchor">y</a>'
                      "</article>", 1))
    page = chapters / f"{no_caption}.html"
    page.write_text(page.read_text().replace('class="chapter-provenance"', 'class="planted"')
                    .replace("</article>", f"</article><footer>By {PLACEHOLDER}</footer>", 1))
    # every source page of one depth shows other code and links to nowhere: the browser reads the
    # first of them the crawl reaches, and the others from their files (read_file); each is reported
    deep = sorted((planted / conf.CODE).glob("*/*/*.html"))
    for page in deep:
        page.write_text(page.read_text().replace('<td class="code">', '<td class="code"><pre>planted</pre>', 1)
                        .replace("</article>", '<a href="planted-nowhere.html">z</a></article>', 1))
    page = chapters / f"{names[1]}.html"                # a link that offers its file as a download again
    offered = re.search(rf'href="(\.\./{conf.CODE}/[^"#]+\.py\.html)"', page.read_text())
    assert offered, f"{names[1]} links no source file"
    page.write_text(page.read_text().replace(offered.group(1), "../_downloads/planted/" +
                                             Path(offered.group(1)).name.removesuffix(".html"), 1)
                    .replace("</article>", "<p><code>common/planted_gone.py</code></p></article>", 1))

    pages, problems = crawl(browser, planted, only=("notebooks", conf.CODE))
    chapters_found = chapter_problems(pages, planted)
    sources_found = source_problems(pages, planted)
    assert any(f"{broken_img}.html: image" in p and "planted-missing-" in p for p in problems), problems
    assert any(p.startswith(f"{broken_img}: ") and "image(s) shown" in p for p in chapters_found), chapters_found
    assert any(f"{removed}.html finds no file" in p for p in problems), problems
    assert any(p.startswith(f"{removed}: no page") for p in chapters_found), chapters_found
    assert any(f"{bad_links}.html: link notebooks/planted-nowhere.html finds no file" in p for p in problems), problems
    assert any("#planted-no-anchor finds no such anchor" in p for p in problems), problems
    assert any(p.startswith(f"{no_caption}: no caption") for p in chapters_found), chapters_found
    assert any(f"{no_caption}.html: shows Sphinx's placeholder" in p for p in problems), problems
    reached = [page for page in deep if page.resolve() in pages]        # from a chapter, or from another such page
    assert len(reached) >= 2, reached
    for page in reached:
        where = page.relative_to(planted)
        assert any(f"{where}: does not show" in p for p in sources_found), (where, sources_found)
        assert any(f"{where}: link {where.parent}/planted-nowhere.html finds no file" in p for p in problems), \
            (where, problems)
    assert all(p.split(":")[0].count("/") == 3 for p in sources_found if "does not show" in p), sources_found
    assert any(f"{names[1]}.html: link to" in p and "offers a download" in p for p in sources_found), sources_found
    assert any(f"{names[1]}.html: `common/planted_gone.py` is not a link" in p for p in sources_found), sources_found
