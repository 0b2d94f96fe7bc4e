"""worker_path.installed_packages_first: a directory ahead of site-packages that holds a folder named like an
installed package (this repository's kernels/, on a Ray worker's path) is moved behind site-packages, so the
installed package is the one imported; the directory stays on the path. In a fresh interpreter: find_spec
answers from sys.modules once a package is imported, and transformers imports the installed `kernels`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHECK = """
import importlib.util, json, sys
shadow, other = sys.argv[1], sys.argv[2]
sys.path[:0] = [shadow, other]
before = importlib.util.find_spec("kernels").origin
from memgas.jobs.worker_path import installed_packages_first
installed_packages_first()
site = next(i for i, p in enumerate(sys.path) if p.endswith("site-packages"))
print(json.dumps({"before": before, "after": importlib.util.find_spec("kernels").origin,
                  "mine": importlib.util.find_spec("mine").origin, "site": site,
                  "shadow": sys.path.index(shadow), "other": sys.path.index(other)}))
"""


def test_a_folder_named_like_an_installed_package_no_longer_shadows_it(tmp_path: Path) -> None:
    shadow, other = tmp_path / "repo", tmp_path / "other"
    for d in (shadow / "kernels", shadow / "mine", other):
        d.mkdir(parents=True)
    (shadow / "kernels" / "__init__.py").write_text("raise ImportError('the shadowing folder')\n")
    (shadow / "mine" / "__init__.py").write_text("")  # named like nothing installed: it stays importable
    p = subprocess.run([sys.executable, "-c", CHECK, str(shadow), str(other)], capture_output=True, text=True,
                       cwd=tmp_path, check=True)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert Path(r["before"]).parent == shadow / "kernels"  # the shadowing: what a Ray worker met
    assert "site-packages" in r["after"] and Path(r["mine"]).parent == shadow / "mine"
    assert r["shadow"] > r["site"] > r["other"]  # moved behind, not dropped; the other entry left in place
