"""The documentation: the site builds from docs/ with warnings as errors, and the README is a front door whose links
all lead somewhere."""

import os
import re
import subprocess
import sys

from conftest import ROOT


def test_the_docs_site_builds_with_no_warning(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    # Every page of the nav was written, and the API page rendered the docstrings it names.
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "from_caffe" in api and "Train from a solver .prototxt" in api


def test_the_readme_is_short_and_its_links_lead_to_files_of_the_repository():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(text.splitlines()) < 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links to the documentation"
    missing = [link for link in links if "://" not in link and not os.path.exists(os.path.join(ROOT, link))]
    assert missing == []
    # The two commands, as the README says them.
    assert "make demo" in text and "make test" in text
