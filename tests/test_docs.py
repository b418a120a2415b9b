"""The documentation: the site builds from docs/ with warnings as errors, and the README is a front door whose links
all lead somewhere."""

import os
import re
import subprocess
import sys

from conftest import ROOT


# What the docs' own environment (requirements-docs.txt, `make docs`) lacks: the library's dependencies and the library
# itself, which mkdocstrings reads as source, never imports.
NOT_IN_THE_DOCS_ENV = ("deepspark", "tensorflow", "pyspark", "numpy", "caffe")


def test_the_docs_site_builds_with_no_warning_offline_and_without_the_library(tmp_path):
    blocked = tmp_path / "docs_env"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text("import sys\n" + "".join(
        f"sys.modules[{name!r}] = None  # as in the docs' own venv\n" for name in NOT_IN_THE_DOCS_ENV))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(blocked)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    # Every page of the nav was written, and the API page rendered the docstrings it names.
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "from_caffe" in api and "Train from a solver .prototxt" in api
    # Net's attributes have text, not the code that sets them.
    assert "list(self._model.feeds)" not in api and "the names of the input blobs" in api
    # The code is coloured as the site is built: no script or style from another site (a CDN), none needed offline.
    remote = {m for page in (tmp_path / "site").rglob("*.html")
              for m in re.findall(r'<(?:script|link)[^>]*(?:src|href)="(https?://[^"]*)"', page.read_text())}
    assert not remote, remote
    spark = (tmp_path / "site" / "spark" / "index.html").read_text()
    assert '<div class="highlight"' in spark and 'style="color' in spark


def test_the_readme_is_short_and_its_links_lead_to_files_of_the_repository():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(text.splitlines()) < 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links to the documentation"
    missing = [link for link in links if "://" not in link and not os.path.exists(os.path.join(ROOT, link))]
    assert missing == []
    # The two commands, as the README says them.
    assert "make demo" in text and "make test" in text
