"""GPU node readiness, checked without a GPU.

- The `gpu` extra resolves (pip's dry-run report, metadata only) to one coherent CUDA stack: one CUDA major
  across torch and CuPy (and a GPU faiss, were there one), no CPU faiss beside a GPU faiss, vLLM's torch pin
  satisfied. Needs PyPI; fails the day a dependency update breaks the set.
- scripts/setup.sh never replaces an installed (GPU) torch; scripts/setup_gpu.sh removes stale GPU packages.
- benchmarks/gpu_check.sh: one line and a non-zero exit without a CUDA device, a loud SKIPPED with
  --allow-skip, and a part that aborts is reported while the others still run.
- The HF LLM backend picks bf16 on CUDA; the "identical up to ties" comparison helpers.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


# -- the gpu extra resolves to one CUDA major ------------------------------------------------------------------

#: packages known to carry another CUDA major inside a coherent stack, and why they are harmless
KNOWN_OTHER_MAJOR = {
    # nvidia-cutlass-dsl 4.x requires its cu12 libs unconditionally; vLLM asks for nvidia-cutlass-dsl[cu13],
    # which adds the cu13 libs that are used on a CUDA 13 stack (allowed only when those are present too)
    "nvidia-cutlass-dsl-libs-cu12": "nvidia-cutlass-dsl-libs-cu13",
}


def _gpu_requirements() -> list[str]:
    """What `pip install -e ".[gpu]"` asks for: the base dependencies plus the gpu extra."""
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(proj["dependencies"]) + list(proj["optional-dependencies"]["gpu"])


def _index_reachable() -> str | None:
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/vllm/"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=20):
            return None
    except Exception as e:  # noqa: BLE001
        return f"{url}: {type(e).__name__}: {e}"


def _cuda_major(name: str, version: str) -> int | None:
    """CUDA major a distribution is built for, from its name or (CUDA toolkit packages) its version."""
    m = re.fullmatch(r"cupy-cuda(\d+)x", name) or re.search(r"-cu(\d+)$", name)
    if m:
        return int(m.group(1))
    if name in ("cuda-toolkit", "nvidia-cuda-runtime", "cuda-bindings", "nvidia-cuda-nvrtc"):
        return int(version.split(".")[0])
    return None


def check_cuda_stack(report: dict[str, Any]) -> list[str]:
    """Problems with a pip install report (empty when the set is coherent)."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.version import Version

    env = {**default_environment(), **report.get("environment", {})}
    pkgs = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"] for i in report["install"]}
    problems: list[str] = []

    def reqs(name: str) -> list[Requirement]:
        out = []
        for r in pkgs[name].get("requires_dist") or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                out.append(req)
        return out

    for need in ("torch", "vllm"):
        if need not in pkgs:
            return [f"{need} is not in the resolved set"]
    torch_v = Version(pkgs["torch"]["version"])
    for r in reqs("vllm"):
        if r.name == "torch" and torch_v not in r.specifier:
            problems.append(f"vllm {pkgs['vllm']['version']} wants torch{r.specifier}, resolved {torch_v}")
    # torch's CUDA major, from what its wheel depends on
    torch_major = None
    for r in reqs("torch"):
        n = r.name.lower()
        if n == "cuda-toolkit" or n == "nvidia-cuda-runtime" or n.startswith("nvidia-cuda-runtime-cu"):
            pinned = pkgs.get(n, {}).get("version") or str(next(iter(r.specifier)).version)
            torch_major = _cuda_major(n, pinned)
            break
    if torch_major is None:
        return problems + [f"torch {torch_v} resolved to a build without CUDA dependencies (a CPU build)"]
    cupys = sorted(n for n in pkgs if n.startswith("cupy-cuda"))
    if len(cupys) != 1:
        problems.append(f"expected exactly one CuPy package, got {cupys or 'none'}")
    gpu_faiss = sorted(n for n in pkgs if n.startswith("faiss-gpu"))
    if gpu_faiss and "faiss-cpu" in pkgs:
        problems.append(f"faiss-cpu beside {gpu_faiss}: both own faiss/__init__.py")
    for n in gpu_faiss:  # their CUDA major: name suffix, or what they depend on (faiss-gpu-cuvs -> libcuvs-cu13)
        majors = {_cuda_major(n, pkgs[n]["version"])} | {_cuda_major(r.name.lower(), "") for r in reqs(n)
                                                          if re.search(r"-cu\d+$", r.name.lower())}
        majors.discard(None)
        if majors != {torch_major}:
            problems.append(f"{n} is built for CUDA {sorted(majors) or '?'}, torch for CUDA {torch_major}")
    for n, meta in sorted(pkgs.items()):
        major = _cuda_major(n, meta["version"])
        if major is None or major == torch_major:
            continue
        if KNOWN_OTHER_MAJOR.get(n) in pkgs:
            continue
        problems.append(f"{n} {meta['version']} is built for CUDA {major}, torch {torch_v} for CUDA {torch_major}")
    return problems


def _fake_report(**pkgs: tuple[str, list[str]]) -> dict[str, Any]:
    return {"environment": {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64"},
            "install": [{"metadata": {"name": n.replace("_", "-"), "version": v, "requires_dist": r}}
                        for n, (v, r) in pkgs.items()]}


def test_stack_checker_catches_mixed_majors() -> None:
    """The checker itself: the known bad mixes are caught, the coherent set passes."""
    torch13 = ("2.14.0", ['cuda-toolkit[cudart]==13.0.3; platform_system == "Linux"', "filelock"])
    vllm = ("0.33.0", ["torch==2.14.0"])
    ok = dict(torch=torch13, vllm=vllm, cuda_toolkit=("13.0.3", []), cupy_cuda13x=("14.2.0", []),
              faiss_cpu=("1.15.1", []))
    assert check_cuda_stack(_fake_report(**ok)) == []
    mixed = {k: v for k, v in ok.items() if k != "cupy_cuda13x"}
    mixed.update(cupy_cuda12x=("13.6.0", []), faiss_gpu_cu12=("1.14.1.post1", []))
    bad = check_cuda_stack(_fake_report(**mixed))
    assert any("faiss-cpu beside" in p for p in bad)
    assert any("cupy-cuda12x" in p and "CUDA 12" in p for p in bad)
    assert any("faiss-gpu-cu12" in p for p in bad)
    assert any("torch" in p for p in check_cuda_stack(_fake_report(**{**ok, "vllm": ("0.33.0", ["torch==2.13.0"])})))
    cpu_torch = check_cuda_stack(_fake_report(**{**ok, "torch": ("2.14.0", ["filelock"])}))
    assert any("CPU build" in p for p in cpu_torch)


#: set by tests/conftest.py when it started the resolution below in the background at the suite's start: the
#: folder it writes (pip's network-bound wait then holds no test worker)
PREFETCH_ENV = "MEMGAS_TEST_GPU_EXTRA_PREFETCH"
PIP_TIMEOUT_S = 400  # network-bound (26 s of CPU in 142 s, 2026-12-02); 150 s in a CI run


def resolve_gpu_extra(out: Path) -> None:
    """Resolve the gpu extra with pip (a dry run) into ``out``: report.json, stderr.txt, then rc (written
    last, so its presence says the rest is complete)."""
    report = out / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--disable-pip-version-check", "--report", str(report), *_gpu_requirements()]
    # fast-deps reads each wheel's metadata with HTTP range requests: an index without PEP 658 metadata
    # files otherwise makes pip download every wheel whole (vLLM's and CUDA torch's: >1 GB, most of the
    # test's time). The same resolver decides; only the metadata's transport differs. A pip that no longer
    # knows the feature resolves without it.
    fast = [*cmd[:4], "--use-feature=fast-deps", *cmd[4:]]
    try:
        p = subprocess.run(fast, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        if p.returncode != 0 and "fast-deps" in p.stderr and "invalid choice" in p.stderr:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired:
        rc, err = "timeout", f"pip could not resolve the gpu extra within {PIP_TIMEOUT_S} s"
    (out / "stderr.txt").write_text(err)
    (out / "rc").write_text(str(rc))


def _resolution(tmp_path: Path) -> tuple[str, str, Path]:
    """(rc, stderr, report path): the suite's background resolution when it started one, else one now."""
    started = os.environ.get(PREFETCH_ENV)
    out = Path(started) if started and Path(started, "started").exists() else None
    if out is None:
        out = tmp_path
        resolve_gpu_extra(out)
    deadline = time.monotonic() + 2 * PIP_TIMEOUT_S + 60  # the fast try, then perhaps the plain one
    while not (out / "rc").exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the background resolution of the gpu extra ({out}) did not finish")
        time.sleep(1)
    return (out / "rc").read_text(), (out / "stderr.txt").read_text(), out / "report.json"


@pytest.mark.slow
def test_gpu_extra_resolves_to_one_cuda_major(tmp_path: Path) -> None:
    why = _index_reachable()
    if why:
        pytest.skip(f"package index unreachable, cannot resolve the gpu extra: {why}")
    rc, err, report = _resolution(tmp_path)
    assert rc == "0", f"pip could not resolve the gpu extra:\n{err[-3000:]}"
    problems = check_cuda_stack(json.loads(report.read_text()))
    assert not problems, "the gpu extra resolves to an incoherent CUDA stack:\n  " + "\n  ".join(problems)


# -- setup scripts (decision logic, with a stand-in for the venv's python) ---------------------------------------

SHIM = r"""#!/usr/bin/env bash
# stand-in for .venv/bin/python: logs pip calls, answers version probes from FAKE_* variables
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; echo "pip $*" >> "$SHIM_LOG"; exit 0; fi
if [ "$1" = "--version" ]; then echo "Python 3.11.7"; exit 0; fi
if [ "$1" = "-c" ]; then
  case "$2" in
    *'"faiss-cpu"'*) echo 1.15.1;;
    *'"cupy-cuda13x"'*) echo 14.2.0;;
    *) case "${@: -1}" in
         torch) [ -n "${FAKE_TORCH:-}" ] && echo "$FAKE_TORCH";;
         vllm) [ -n "${FAKE_VLLM:-}" ] && echo "$FAKE_VLLM";;
       esac;;
  esac
  exit 0
fi
body="$(cat)"
case "$body" in *"import torch"*) echo "verify ran" >> "$SHIM_LOG";; *) printf '%s\n' "${FAKE_STALE:-}";; esac
"""


def _run_setup(tmp_path: Path, script: str, **fake: str) -> list[str]:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts" / script)
    py = tmp_path / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True, exist_ok=True)
    py.write_text(SHIM)
    py.chmod(0o755)
    log = tmp_path / "pip.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "SHIM_LOG": str(log), **{f"FAKE_{k.upper()}": v for k, v in fake.items()}}
    env["PATH"] = "/nonexistent:" + env["PATH"]  # nvidia-smi absent or present: either is fine
    p = subprocess.run(["bash", str(tmp_path / "scripts" / script)], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_setup_installs_cpu_torch_on_a_fresh_venv(tmp_path: Path) -> None:
    pips = _run_setup(tmp_path, "setup.sh")
    assert "pip install -q torch==2.13.0" in pips
    assert any(c.startswith("pip install -q -e .[dev]") for c in pips)


def test_setup_keeps_an_installed_gpu_stack(tmp_path: Path) -> None:
    pips = _run_setup(tmp_path, "setup.sh", torch="2.14.0", vllm="0.33.0")
    assert not any("torch==" in c for c in pips), pips
    assert any(c.startswith("pip install -q -e .[gpu,dev]") for c in pips), pips


def test_setup_keeps_an_installed_cpu_torch(tmp_path: Path) -> None:
    pips = _run_setup(tmp_path, "setup.sh", torch="2.13.0+cpu")
    assert not any("torch==" in c for c in pips), pips
    assert any(c.startswith("pip install -q -e .[dev]") for c in pips), pips


def test_setup_gpu_removes_stale_gpu_packages(tmp_path: Path) -> None:
    pips = _run_setup(tmp_path, "setup_gpu.sh", stale="cupy-cuda12x faiss-gpu-cu12")
    assert "pip uninstall -q -y cupy-cuda12x faiss-gpu-cu12" in pips
    i = pips.index("pip install -e .[gpu,dev]")
    assert any("--force-reinstall --no-deps faiss-cpu==1.15.1 cupy-cuda13x==14.2.0" in c for c in pips[i:]), pips
    assert "verify ran" in pips
    assert (tmp_path / ".venv" / ".memgas-setup-stamp").exists()


def test_setup_gpu_on_a_clean_venv(tmp_path: Path) -> None:
    pips = _run_setup(tmp_path, "setup_gpu.sh")
    assert not any("uninstall" in c or "force-reinstall" in c for c in pips), pips
    assert "pip install -e .[gpu,dev]" in pips and "verify ran" in pips


# -- gpu_check ---------------------------------------------------------------------------------------------------


def _has_cuda_device() -> bool:
    from memgas.kernels.backend import get_xp

    if get_xp("auto")[1] == "cuda":
        return True
    try:
        import torch

        return torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001
        return False


def _gpu_check_sh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def test_gpu_check_without_device_fails_in_one_line() -> None:
    if _has_cuda_device():
        pytest.skip("a CUDA device is present: the no-device behaviour cannot be observed here")
    p = _gpu_check_sh()
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr == ""
    lines = p.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: FAIL: no CUDA device"), p.stdout


def test_gpu_check_allow_skip_says_skipped() -> None:
    if _has_cuda_device():
        pytest.skip("a CUDA device is present: the no-device behaviour cannot be observed here")
    p = _gpu_check_sh("--allow-skip")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 1 and "SKIPPED" in lines[0] and "NOTHING WAS CHECKED" in lines[0], p.stdout


def test_gpu_check_reports_an_aborting_part_and_runs_the_rest() -> None:
    """Each part runs in its own process: an abort (as faiss-gpu-cu12 does on an H200) is reported, the others
    still run. The CPU smoke mode exercises the same runner without a GPU."""
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                        "--parts", "topk,router,ppr"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MEMGAS_GPU_CHECK_ABORT": "router"})
    out = p.stdout
    assert p.returncode == 1, out + p.stderr
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and "**" in line}
    assert set(rows) == {"topk", "router", "ppr"}, out
    assert "**ABORTED**" in rows["router"] and "SIGABRT" in rows["router"], rows["router"]
    assert "**PASS**" in rows["topk"] and "**PASS**" in rows["ppr"], out
    assert out.strip().splitlines()[-1] == "gpu_check: FAIL: router ABORTED"


# -- HF LLM dtype on CUDA, agreement helpers --------------------------------------------------------------------


def test_llm_dtype_auto_is_bf16_on_cuda() -> None:
    from memgas.pipeline.models.llms import resolve_llm_dtype

    assert resolve_llm_dtype("auto", "cuda", bf16_supported=True) == "bfloat16"
    assert resolve_llm_dtype("auto", "cuda:1", bf16_supported=False) == "float16"
    assert resolve_llm_dtype("auto", "cpu") == "float32"
    assert resolve_llm_dtype("float32", "cuda", bf16_supported=True) == "float32"
    with pytest.raises(ValueError):
        resolve_llm_dtype("fp8", "cuda")


def test_hf_backend_loads_bf16_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """`llm.backend: hf` on a CUDA machine: the model is loaded in bf16 straight onto the GPU (no GPU needed to
    check what is asked of the loader)."""
    import torch

    from memgas.pipeline.config import LLMConfig
    from memgas.pipeline.models import llms
    from memgas.pipeline.models.factory import make_llm

    calls = []

    def fake_load(path: str, gguf_file: Any, dtype_name: str, device: str = "cpu") -> tuple[Any, Any]:
        calls.append((path, gguf_file, dtype_name, device))
        model = SimpleNamespace(device=torch.device("cuda"), config=SimpleNamespace(max_position_embeddings=4096),
                                generation_config=SimpleNamespace(eos_token_id=2))
        return model, SimpleNamespace(pad_token_id=0, eos_token_id=2)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(llms, "load_transformers", fake_load)
    llm = make_llm(LLMConfig(backend="hf", model="Qwen/Qwen2.5-7B-Instruct"))
    assert calls == [("Qwen/Qwen2.5-7B-Instruct", None, "bfloat16", "cuda")]
    assert llm.dtype == "bfloat16"


def test_same_up_to_ties() -> None:
    from memgas.kernels.backend import same_up_to_ties, scores_up_to_ties

    s = np.array([[3.0, 2.0, 2.0, 1.0], [3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 2.0 - 1e-7, 0.0]])
    ref = np.array([[0, 1, 2, 3]] * 3)
    swapped = np.array([[0, 2, 1, 3]] * 3)
    np.testing.assert_array_equal(same_up_to_ties(swapped, ref, s), [True, False, False])
    np.testing.assert_array_equal(same_up_to_ties(swapped, ref, s, tol=1e-6), [True, False, True])
    np.testing.assert_array_equal(same_up_to_ties(ref, ref, s), [True, True, True])
    assert scores_up_to_ties(np.array([[1.0, -np.inf]]), np.array([[1.0, -np.inf]])).all()


if __name__ == "__main__":  # tests/conftest.py: the resolution in the background, into the folder given
    resolve_gpu_extra(Path(sys.argv[1]))
