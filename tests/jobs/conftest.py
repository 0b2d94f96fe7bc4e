from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLE_LOCOMO = REPO / "data" / "sample" / "locomo_sample.json"


def memgas_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def run_memgas(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run the installed console script as a user would."""
    exe = Path(sys.executable).with_name("memgas")
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=memgas_env(),
                          cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"memgas {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def sample_locomo() -> Path:
    return SAMPLE_LOCOMO


@pytest.fixture(scope="session")
def cli():
    """``cli("stats", bank, check=False)`` runs the installed `memgas` console script."""
    return run_memgas


@pytest.fixture(scope="session")
def memgas_exe() -> tuple[str, dict[str, str], Path]:
    """(path of the console script, its environment, the repo root) for tests that spawn and kill it."""
    return str(Path(sys.executable).with_name("memgas")), memgas_env(), REPO
