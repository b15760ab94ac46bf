"""The front door and the documentation site: README.md stays short and every link in it resolves;
the reference pages are what the code generates (tools/gen_docs.py); ``mkdocs build --strict``
passes (a broken link or a page missing from the nav fails it); the README's experiment runs."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys

from .reliability.common import ROOT, subprocess_env
import pytest

README = ROOT / "README.md"


def test_the_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= 250


def test_every_link_of_the_readme_resolves():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local and all((ROOT / link).exists() for link in local), [x for x in local if not (ROOT / x).exists()]


def test_the_generated_reference_pages_are_current():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_docs.py"), "--check"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_every_config_key_has_a_description():
    """Each field of each config section has the text the config page shows for it: ``#`` comment
    lines right above it in gr_functional/config.py, or a ``#`` comment after it on its line."""
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    gen_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_docs)
    missing = [f"{section}.{f.name}" for section, cls in gen_docs.schema.SECTIONS.items()
               for f in dataclasses.fields(cls) if not gen_docs._field_comments(cls).get(f.name, "").strip()]
    assert not missing, f"config keys without a description (write a # comment above them): {missing}"


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=subprocess_env(NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


@pytest.mark.slow
def test_the_readme_experiment_runs(tmp_path):
    """The twelve-line experiment of the README, as a reader would paste it."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    [script] = [b for b in blocks if b.startswith("import gr_functional as grf")]
    (tmp_path / "experiment.py").write_text(script)
    proc = subprocess.run([sys.executable, str(tmp_path / "experiment.py")], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "'hr@10'" in proc.stdout
