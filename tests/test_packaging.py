"""How the package installs: an editable install (``pip install -e .``) puts the clone itself
on ``sys.path``, so a clone folder named ``vlm_focus`` in the working directory (running Python
from the folder that holds the clone) cannot shadow the package as an empty namespace package.

setuptools' default for a flat layout is an import hook consulted after every ``sys.path``
entry, and a folder without ``__init__.py`` on the path wins over it; a path entry holding the
real package wins over the folder. The test builds the editable wheel of this ``pyproject.toml``
(no download) and imports through its ``.pth`` file, beside a folder named ``vlm_focus``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_editable_install_is_not_shadowed_by_a_folder_named_vlm_focus(tmp_path):
    clone = tmp_path / "clone"
    (clone / "vlm_focus").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, clone)
    (clone / "vlm_focus" / "__init__.py").write_text("wrap = 'the package'\n")
    build = "import setuptools.build_meta as b; b.build_editable('dist')"
    done = subprocess.run([sys.executable, "-c", build], cwd=clone, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(next((clone / "dist").glob("*.whl"))) as wheel:
        wheel.extractall(site)
    (pth,) = site.glob("*.pth")
    assert pth.read_text().strip() == str(clone)  # the clone is a sys.path entry
    user = tmp_path / "where_the_clone_sits"
    (user / "vlm_focus").mkdir(parents=True)  # a clone folder named after the package
    code = f"import site; site.addsitedir({str(site)!r}); import vlm_focus; print(vlm_focus.wrap)"
    # -S: only this install's .pth, not the environment's own editable install
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=user, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "the package", done.stderr[-2000:]
