"""An install without torch, as the service, the SDK and the CLI are installed beside a model server.

`block_torch(folder)` writes a sitecustomize there that makes `import torch` and `import transformers`
fail in every Python process started with that folder first on PYTHONPATH (`env_without_torch`), and
notes each process it loaded in and each import it refused, so a test can tell that the blocker was
really in place and that nothing tried.
"""

from __future__ import annotations

import os
from pathlib import Path

REFUSED = ("torch", "transformers")

SITECUSTOMIZE = f"""
import os, sys

here = os.path.dirname(os.path.abspath(__file__))
open(os.path.join(here, f"started-{{os.getpid()}}"), "w").close()


class RefuseHeavyImports:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in {REFUSED!r}:
            return None
        with open(os.path.join(here, f"refused-{{os.getpid()}}"), "a") as f:
            f.write(name + "\\n")
        raise ModuleNotFoundError(f"No module named {{name!r}} (refused by the test)", name=name)


sys.meta_path.insert(0, RefuseHeavyImports())
"""


def block_torch(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return folder


def pythonpath_with(folder: Path) -> str:
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))


def env_without_torch(folder: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath_with(block_torch(folder))}


def started_in(folder: Path, pid: int) -> bool:
    return (folder / f"started-{pid}").exists()


def refused_imports(folder: Path) -> list[str]:
    return [line for f in sorted(folder.glob("refused-*")) for line in f.read_text().split()]
