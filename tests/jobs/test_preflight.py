"""GPU settings checked before any work, in every mode.

Every device, backend and GPU request that a config implies, for every stage of the command's slice (run /
index / answer / serve), is checked before the first stage: one line, exit 2 for a setting that cannot work,
exit 3 for a missing device or package. This machine is the real test environment: torch without CUDA, no
vLLM, no CuPy, no llama.cpp (the checks are skipped where a package is there). Called in-process through
``memgas.jobs.cli.main`` (the ``cli`` fixture); "no stage ran" is checked on disk: no run directory, an
unchanged bank. The one case that needs a Ray cluster (a GPU request the cluster cannot meet) is in
tests/jobs/test_ray_cluster.py.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memgas.pipeline.config import ConfigError, MemgasConfig
from memgas.pipeline.ingest import ingest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
SMALL = REPO / "tests" / "fixtures" / "locomo_small.json"

#: the settings of the issue, each as --set arguments
ENCODER_CUDA = ["encoder.device=cuda"]
KERNELS_CUDA = ["retrieval.device=cuda"]
VLLM = ["llm.backend=vllm", "generation.generator=llm"]  # the generator and the reader use the LLM
JUSTMEM_VLLM = ["llm.backend=vllm", "justmem.extractor=llm", "reading.enabled=false", "generation.generator=llm-free"]

NO_CUDA = "torch sees no CUDA device"
NO_CUPY = "retrieval.device=cuda needs CuPy, which is not installed"
NO_VLLM = "llm.backend=vllm needs the package 'vllm', which is not installed"

#: (id, command, --set settings, exit code, words the one error line must hold)
CASES: list[tuple[str, str, list[str], int, str]] = [
    ("run-no-ray-encoder-cuda", "run --no-ray", ENCODER_CUDA, 3, f"encoder.device=cuda but {NO_CUDA} (stages encode, card-encode)"),
    ("run-no-ray-kernels-cuda", "run --no-ray", KERNELS_CUDA, 3, f"{NO_CUPY} (stages associate, rank, card-rank)"),
    ("run-no-ray-vllm", "run --no-ray", VLLM, 3, f"{NO_VLLM} (stages generate, read, card-read)"),
    ("run-no-ray-justmem-vllm", "run --no-ray", JUSTMEM_VLLM, 3, f"{NO_VLLM} (stages cards)"),
    ("run-no-ray-gpu-yaml", "run-gpu --no-ray", [], 3, f"encoder.device=cuda but {NO_CUDA} (stages encode)"),
    ("run-no-ray-onnx-on-cuda", "run --no-ray", ["encoder.device=cuda", "encoder.runtime=onnx"], 2,
     "encoder.runtime='onnx' runs on CPU only; use runtime=torch on cuda (stages encode, card-encode)"),
    ("run-no-ray-openai-without-url", "run --no-ray", ["llm.backend=openai"], 2,
     "llm.backend=openai needs llm.base_url"),
    # under Ray: refused before Ray starts
    ("run-ray-kernels-cuda", "run", KERNELS_CUDA, 3, f"{NO_CUPY} (stages associate, rank, card-rank)"),
    ("run-ray-justmem-vllm", "run", JUSTMEM_VLLM, 2,
     "llm.backend=vllm runs on a GPU but ray.num_gpus_per_model_actor=0 gives its actors none (stages cards)"),
    ("run-ray-justmem-vllm-gpus", "run", [*JUSTMEM_VLLM, "ray.num_gpus_per_model_actor=1"], 3, f"{NO_VLLM} (stages cards)"),
    ("index-no-ray-encoder-cuda", "index --no-ray", ENCODER_CUDA, 3, f"encoder.device=cuda but {NO_CUDA} (stages encode, card-encode)"),
    ("index-no-ray-kernels-cuda", "index --no-ray", KERNELS_CUDA, 3, f"{NO_CUPY} (stages associate)"),
    ("index-no-ray-vllm", "index --no-ray", VLLM, 3, f"{NO_VLLM} (stages generate)"),
    ("index-no-ray-justmem-vllm", "index --no-ray", JUSTMEM_VLLM, 3, f"{NO_VLLM} (stages cards)"),
    ("index-ray-kernels-cuda", "index", KERNELS_CUDA, 3, f"{NO_CUPY} (stages associate)"),
    ("answer-no-ray-kernels-cuda", "answer --no-ray", KERNELS_CUDA, 3, f"{NO_CUPY} (stages rank, card-rank)"),
    ("answer-no-ray-vllm", "answer --no-ray", VLLM, 3, f"{NO_VLLM} (stages read, card-read)"),
    ("answer-ray-kernels-cuda", "answer", KERNELS_CUDA, 3, f"{NO_CUPY} (stages rank, card-rank)"),
    # answer's stages use neither the encoder nor (reading off) the LLM: nothing to refuse; the unindexed
    # bank is (exit 2, "run `memgas index`"), and that command refuses the setting (rows above)
    ("answer-no-ray-encoder-cuda", "answer --no-ray", ENCODER_CUDA, 2, "run `memgas index` with the same config"),
    ("answer-no-ray-justmem-vllm", "answer --no-ray", JUSTMEM_VLLM, 2, "run `memgas index` with the same config"),
    ("serve-vllm", "serve", VLLM, 3, f"{NO_VLLM} (stages serve)"),
    ("serve-justmem-vllm", "serve", JUSTMEM_VLLM, 3, f"{NO_VLLM} (stages serve)"),
    ("serve-openai-without-url", "serve", ["llm.backend=openai"], 2, "llm.backend=openai needs llm.base_url"),
    ("serve-llama-cpp", "serve", ["llm.backend=llama-cpp"], 3,
     "llm.backend=llama-cpp needs the package 'llama_cpp', which is not installed"),
]


@pytest.fixture(scope="module")
def ingested(tmp_path_factory) -> Path:
    bank = tmp_path_factory.mktemp("preflight") / "bank"
    ingest(SMALL, "locomo", bank, progress=False)
    return bank


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file and directory under ``path``: a bank a stage wrote to shows here."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def _argv(command: str, sets: list[str], bank: Path, out: Path) -> list[str]:
    words = command.split()
    name, flags = words[0], words[1:]
    if name == "run":
        head = ["run", str(DEMO), "--set", f"output_dir={out}", "--set", f"data.path={SMALL}"]
    elif name == "run-gpu":  # the shipped GPU config, on the bundled small file
        head = ["run", str(REPO / "configs" / "gpu.yaml"), "--set", f"output_dir={out}", "--set", f"data.path={SMALL}"]
    elif name == "index":
        head = ["index", str(bank), "--config", str(DEMO)]
    elif name == "answer":
        head = ["answer", str(bank), "--config", str(DEMO), "--out", str(out)]
    else:
        head = ["serve", "--config", str(DEMO), "--port", "0"]
    return [*head, *flags, *[a for s in sets for a in ("--set", s)]]


def _installed(needle: str) -> bool:
    """Whether this machine has what the row says is missing (then the row cannot be checked here)."""
    for what, module in ((NO_CUPY, "cupy"), (NO_VLLM, "vllm"), ("'llama_cpp'", "llama_cpp")):
        if what in needle and importlib.util.find_spec(module) is not None:
            return True
    if NO_CUDA in needle:
        import torch

        return torch.cuda.is_available()
    return False


@pytest.mark.parametrize("command, sets, code, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gpu_settings_are_refused_before_any_work(cli, ingested, tmp_path, command, sets, code, needle) -> None:
    if _installed(needle):
        pytest.skip("this machine has the device or package the row is about")
    bank = tmp_path / "bank"
    shutil.copytree(ingested, bank)
    before = _tree(bank)
    out = tmp_path / "out"
    argv = _argv(command, sets, bank, out)
    proc = cli(*argv, check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if " error: " in line]
    assert proc.returncode == code, proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith(f"memgas {argv[0]}: error: "), errors[0]
    assert needle in errors[0], errors[0]
    # no stage ran: the bank as it was (index, answer), no run directory (run, answer) where the pre-flight
    # refused; an unindexed bank is found once answer has claimed its directory, with no stage run there
    assert _tree(bank) == before
    if "memgas index" in needle:
        assert not list(out.rglob("_stages/*.json")) and not (out / "run_record.json").exists()
    else:
        assert not out.exists(), sorted(p.name for p in out.iterdir())


def _needs(command: str, *sets: str) -> dict[str, tuple[str, ...]]:
    from memgas.jobs import preflight

    return preflight.needs(MemgasConfig.load(DEMO, list(sets)), command)


def test_needs_follow_the_stages_of_each_command() -> None:
    """What each stage of a command's slice computes with, derived from the stages (the demo: LLM-free
    generator and JustMem, reading on, no judge)."""
    # JustMem is its own branch: its encoder, ranker and reader are stages of their own
    assert _needs("run") == {"encoder": ("encode", "card-encode"), "llm": ("read", "card-read"),
                             "kernels": ("associate", "rank", "card-rank")}
    assert _needs("index") == {"encoder": ("encode", "card-encode"), "kernels": ("associate",)}
    assert _needs("answer") == {"llm": ("read", "card-read"), "kernels": ("rank", "card-rank")}
    assert _needs("serve") == {"llm": ("serve",)}
    assert _needs("run", "generation.generator=llm+fallback", "justmem.extractor=llm", "justmem.planner=llm",
                  "evaluation.judge=true")["llm"] == ("generate", "cards", "plan", "read", "card-read", "judge")
    assert _needs("index", "generation.generator=llm+fallback") == {"encoder": ("encode", "card-encode"), "llm": ("generate",),
                                                                   "kernels": ("associate",)}
    # JustMem stages run only with a JustMem method; reading off: no reader
    assert "llm" not in _needs("run", "justmem.extractor=llm", "retrieval.methods=[memgas]", "reading.methods=[memgas]",
                               "reading.enabled=false")



def test_a_stage_whose_output_nothing_reads_asks_for_nothing() -> None:
    """A stage the config enables but whose tables no running step reads does not run (runner.unused_stages),
    so its model is not asked for: JustMem's methods alone run no MemGAS index, whose LLM generator would
    otherwise refuse an openai backend without a URL. The same setting is refused where the generator runs."""
    justmem_alone = ("retrieval.methods=[justmem]", "reading.enabled=false", "generation.generator=llm")
    assert _needs("run", *justmem_alone) == {"encoder": ("card-encode",), "kernels": ("card-rank",)}
    assert _needs("index", *justmem_alone) == {"encoder": ("card-encode",)}
    from memgas.jobs import preflight

    no_url = ("llm.backend=openai", "llm.base_url=")
    preflight.check(MemgasConfig.load(DEMO, [*justmem_alone, *no_url]), "run", use_ray=False)
    with pytest.raises(ConfigError, match=r"needs llm.base_url .*\(stages generate\)"):
        preflight.check(MemgasConfig.load(DEMO, ["retrieval.methods=[memgas]", *justmem_alone[1:], *no_url]), "run",
                        use_ray=False)

def _ray_problems(command: str, *sets: str) -> list[str]:
    from memgas.jobs import preflight

    return preflight.config_problems(MemgasConfig.load(DEMO, list(sets)), command, use_ray=True)


def test_gpu_work_without_gpus_under_ray_is_a_config_problem_of_the_stages_that_run() -> None:
    """Under Ray a worker that requests no GPU sees none: vLLM or a CUDA encoder with no GPUs per model actor,
    CUDA kernels with no GPUs per task are refused, for the stages of the command only; the same with GPUs
    is fine."""
    assert _ray_problems("run") == []
    assert [p.split(" but ")[0] for p in _ray_problems("run", "llm.backend=vllm")] == ["llm.backend=vllm runs on a GPU"]
    assert [p.split(" but ")[0] for p in _ray_problems("run", "encoder.device=cuda")] == ["encoder.device=cuda"]
    assert [p.split(" but ")[0] for p in _ray_problems("run", "retrieval.device=cuda", "ray.num_gpus_per_task=0")] == [
        "retrieval.device=cuda"]
    assert _ray_problems("run", "llm.backend=vllm", "encoder.device=cuda", "retrieval.device=cuda",
                         "ray.num_gpus_per_model_actor=1") == []
    # vLLM that nothing uses (LLM-free generator and JustMem, no reading) needs no GPU
    assert _ray_problems("run", "llm.backend=vllm", "generation.generator=llm-free", "reading.enabled=false") == []
    # ...but the JustMem extractor uses it
    assert len(_ray_problems("run", *JUSTMEM_VLLM)) == 1
    # answer's stages never run the encoder; index's never the reader
    assert _ray_problems("answer", "encoder.device=cuda") == []
    assert _ray_problems("index", "llm.backend=vllm") == []
    # auto devices are never refused: they resolve to what can run
    assert _ray_problems("run", "encoder.device=auto", "retrieval.device=auto", "ray.num_gpus_per_task=0") == []
    from memgas.jobs import preflight

    with pytest.raises(ConfigError, match="encoder.device=cuda"):
        preflight.check(MemgasConfig.load(DEMO, ["encoder.device=cuda"]), "run", use_ray=True)


def test_the_cpu_llm_backend_without_lm_format_enforcer_is_refused(monkeypatch) -> None:
    """lm-format-enforcer is installed by `make setup`, so its absence is simulated: without it, a failed import
    inside every LLM call was counted as a backend failure (exit 4, retried for ever) instead of exit 3 here."""
    from memgas.jobs import preflight
    from memgas.pipeline.config import MemgasConfig

    cfg = MemgasConfig.load(DEMO, ["justmem.planner=llm", "retrieval.methods=[justmem]", "reading.enabled=false"])
    assert not [p for p in preflight.environment_problems(cfg, "index", use_ray=False) if "lm-format-enforcer" in p]
    monkeypatch.setattr(preflight, "_installed", lambda module: module != "lmformatenforcer")
    problems = preflight.environment_problems(cfg, "index", use_ray=False)
    assert problems == ["llm.backend=transformers-gguf needs the package 'lm-format-enforcer', which is not "
                        "installed (stages plan); make setup installs it (pyproject.toml)"]



#: what `memgas index` does before its first stage, under Ray and without: pre-flight, the runtimes, every
#: step's fingerprint, the profiler's GPU peak; then the heavy packages it imported
_INDEX_START = """
import sys
from memgas.jobs import preflight
from memgas.jobs.placement import resolve_stage_runtimes
from memgas.jobs.profiling import gpu_peak_bytes
from memgas.jobs.runner import compute_fingerprints
from memgas.jobs.stage import StageContext
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig

cfg = MemgasConfig.load(sys.argv[1], ["retrieval.device=auto"])
for use_ray in (True, False):
    preflight.check(cfg, "index", use_ray)
    ctx = StageContext(cfg, Bank(sys.argv[2]), None, use_ray=use_ray)
    resolve_stage_runtimes(ctx)
    compute_fingerprints(ctx)
    gpu_peak_bytes()
print(sorted(m for m in ("torch", "sklearn", "transformers", "sentence_transformers", "pandas") if m in sys.modules))
"""

#: a process that has not imported torch, on a machine with a GPU device file: torch is asked
_DEVICE_FILE = """
import sys
from memgas.jobs import placement

placement.glob.glob = lambda pattern: [pattern] if pattern == "/dev/nvidia*" else []
print(placement.local_cuda_devices(), "torch" in sys.modules)
"""


def _python(code: str, *args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-P", "-c", code, *args], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_a_command_that_loads_no_model_imports_neither_torch_nor_sklearn_nor_pandas(ingested: Path) -> None:
    """torch (1-2 s) was imported only to learn that there is no GPU, sklearn (~1 s) for a stop-word list the
    planner's name does not use, pandas (~0.2 s) with the evaluation's package for a prompt digest: none is,
    where no GPU device file exists (where one does, torch is asked as before, and answers)."""
    from memgas.jobs.placement import no_gpu_device_files

    assert _python(_INDEX_START, str(DEMO), str(ingested))[-1] == ("[]" if no_gpu_device_files() else "['torch']")


def test_without_a_gpu_device_file_torch_sees_no_gpu_and_with_one_it_is_asked() -> None:
    import torch

    from memgas.jobs.placement import no_gpu_device_files

    if no_gpu_device_files():  # the probe answers 0 only where torch does
        assert torch.cuda.device_count() == 0 and not torch.cuda.is_available()
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert _python(_DEVICE_FILE)[-1] == f"{seen} True"


#: the models the demo's LLM-free actors hold (generate, cards, plan), built as the executor builds them, with
#: the GPU peak every actor stage reports
_LLM_FREE_ACTORS = """
import sys
from memgas.jobs.executor import ModelHost
from memgas.jobs.placement import placement, resolve_stage_runtimes
from memgas.jobs.stage import StageContext
from memgas.jobs.stages.cards import CardsStage
from memgas.jobs.stages.generate import GenerateStage
from memgas.jobs.stages.plan import PlanStage
from memgas.pipeline.config import MemgasConfig

ctx = StageContext(MemgasConfig.load(sys.argv[1], []), None, None, use_ray=False)
resolve_stage_runtimes(ctx)
for stage in (GenerateStage(), CardsStage(), PlanStage()):
    ModelHost(stage.model, placement(stage, stage.active(ctx), ctx).config).gpu_memory()
print("torch" in sys.modules)
"""


def test_an_actor_that_holds_no_model_does_not_import_torch() -> None:
    """The LLM-free generator's and JustMem's actors imported torch to set its threads and to ask for a GPU
    peak (1-2 s of each actor's start): where no GPU device file exists, they do neither."""
    from memgas.jobs.placement import no_gpu_device_files

    assert _python(_LLM_FREE_ACTORS, str(DEMO))[-1] == str(not no_gpu_device_files())
