"""The documentation site builds without a warning, documents the whole public API, and its
config reference is what the config schema gives today, with a meaning for every key."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

from helpers import ROOT

import zoo
import zoo.plugin


def test_the_site_builds_strictly_and_documents_every_public_name(tmp_path):
    # mkdocs.yml sets `strict` and `validation`: a broken link or anchor, a page missing from
    # the nav and an API reference that does not resolve each fail the build.
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for module, page in [(zoo, "api"), (zoo.plugin, "plugin")]:
        html = (tmp_path / "reference" / page / "index.html").read_text()
        anchors = set(re.findall(r'id="([\w.]+)"', html))
        # A function whose name a package of zoo takes too (`zoo.export`, the command line) is
        # documented where it is defined (`zoo.exporting.export`).
        missing = [
            name
            for name in module.__all__
            if {f"{module.__name__}.{name}", defined_as(module, name)}.isdisjoint(anchors)
        ]
        assert not missing, f"docs/reference/{page}.md does not document {missing}"


def defined_as(module, name: str) -> str:
    """The full name of `module.name` in the module that defines it."""
    value = getattr(module, name)
    return f"{getattr(value, '__module__', module.__name__)}.{name}"


def test_the_config_reference_is_up_to_date():
    # A process of its own: the tests register models of their own in this one.
    result = subprocess.run(
        [sys.executable, "docs/make_config_reference.py", "--check"],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_config_key_without_a_meaning_is_named(tmp_path):
    (tmp_path / "undocumented_plugin.py").write_text(
        textwrap.dedent(
            """
            from zoo.plugin import Splits, register_data


            @register_data("undocumented")
            def undocumented(
                size: int = 4,
                seed: int = 0,  # the seed of the points
            ) -> Splits:
                raise NotImplementedError
            """
        )
    )
    check = (
        "import sys; sys.path[:0] = sys.argv[1:]; import undocumented_plugin; "
        "import make_config_reference; sys.exit(make_config_reference.main(['--check']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, str(tmp_path), str(ROOT / "docs")],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "have no meaning" in result.stdout, result.stdout
    assert f"data.size (undocumented in {tmp_path / 'undocumented_plugin.py'})" in result.stdout
    assert "data.seed" not in result.stdout
