"""Ray readiness without a GPU or a shared filesystem: GPU requests of kernel tasks, tasks that never open
the bank, and a real two-node local Ray cluster running the job end to end."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from memgas.jobs import main_job
from memgas.jobs import stages as S
from memgas.jobs.executor import run_task, stage_fn
from memgas.jobs.stage import StageContext
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SETTINGS = ["data.limit=1", "reading.enabled=false", "retrieval.methods=[session,memgas,memgas-no-gmm]",
            "ray.shard_size=1"]


def _cfg(out: Path, *extra: str) -> MemgasConfig:
    return MemgasConfig.load(REPO / "configs" / "demo.yaml", [f"output_dir={out}", *SETTINGS, *extra])


def _rankings(run_dir: Path) -> list[dict]:
    fps = json.loads((run_dir / "metrics.json").read_text())["run"]["fingerprints"]
    results = Bank(run_dir / "results")
    parts = [p for p in results.parts("rankings") if p.startswith(f"rank-{fps['rank']}-")]
    t = results.read("rankings", parts=parts)
    return t.sort_by([("method", "ascending"), ("query_id", "ascending"), ("rank", "ascending")]).to_pylist()


@pytest.fixture(scope="module")
def indexed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("indexed")
    main_job.run(_cfg(out), use_ray=False)
    return out


class _ProbeStage(S.AssociateStage):
    """The association stage's scheduling (its num_gpus), with a run that reports what Ray gave it."""

    @staticmethod
    def run(model, payload, params):
        import ray

        return {"probe": pa.table({"gpu_ids": [json.dumps([str(g) for g in ray.get_gpu_ids()])],
                                   "cuda_visible": [os.environ.get("CUDA_VISIBLE_DEVICES", "")]})}


def test_kernel_tasks_request_gpus_and_see_the_ids_ray_gives_them(tmp_path) -> None:
    import ray

    cfg = _cfg(tmp_path, "retrieval.device=cuda", "ray.num_gpus_per_task=0.5")
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, configure_logging=False)
    try:
        ctx = StageContext(cfg, Bank.create(tmp_path / "bank"), None, use_ray=True)
        stage = _ProbeStage()
        assert stage.num_gpus(ctx) == 0.5
        remote = ray.remote(run_task).options(num_cpus=0, num_gpus=stage.num_gpus(ctx))
        outs = ray.get([remote.remote(stage_fn(stage), {}, {}) for _ in range(4)])
        for out in outs:
            ids = json.loads(out["probe"]["gpu_ids"][0].as_py())
            assert len(ids) == 1 and ids[0] in ("0", "1")
            assert out["probe"]["cuda_visible"][0].as_py() == ids[0]
        # device auto on a cluster that declares GPUs resolves to cuda (and to cpu without them)
        assert S.resolve_device(StageContext(_cfg(tmp_path), ctx.bank, None, use_ray=True), "auto") == "cuda"
    finally:
        ray.shutdown()
    assert S.resolve_device(StageContext(_cfg(tmp_path), ctx.bank, None, use_ray=False), "auto") == "cpu"


def test_tasks_never_open_the_bank(tmp_path, indexed) -> None:
    """The driver reads a shard's inputs; the bank is then moved away; the task still computes the same table."""
    import ray

    cfg = _cfg(indexed)
    bank = Bank(indexed / "bank")
    results = Bank(indexed / "results")
    ctx = StageContext(cfg, bank, results, use_ray=False)
    main_job.resolve_runtime(ctx)
    main_job.compute_fingerprints(ctx)
    want: dict[str, pa.Table] = {}
    payloads = {}
    for stage in (S.AssociateStage(), S.RankStage()):
        unit = stage.plan(ctx)[0]
        payloads[stage.name] = (stage, stage.inputs(ctx, unit), stage.params(ctx))
        want[stage.name] = ctx.store(stage).read(stage.check_table, parts=[unit["part"]])
    moved = tmp_path / "elsewhere"
    shutil.move(str(indexed), str(moved))
    try:
        ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False)
        try:
            for name, (stage, payload, params) in payloads.items():
                got = ray.get(ray.remote(run_task).remote(stage_fn(stage), payload, params))[stage.check_table]
                assert got.equals(want[name].select(got.column_names)), name
        finally:
            ray.shutdown()
    finally:
        shutil.move(str(moved), str(indexed))


def test_cpu_encoding_and_llm_free_generation_run_one_single_threaded_actor_per_cpu(tmp_path, indexed) -> None:
    """encoder.actors auto on CPU: one actor per Ray CPU, one torch thread each, and the vectors the bank
    holds; a number of actors keeps llm.threads; a CUDA encoder keeps ray.model_actors."""
    import numpy as np
    import pyarrow.compute as pc
    import ray

    from memgas.jobs.executor import _pool_for

    stage = S.EncodeStage()
    bank = Bank(indexed / "bank")
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        ctx = StageContext(_cfg(indexed), bank, Bank(indexed / "results"), use_ray=True)
        main_job.resolve_runtime(ctx)
        main_job.compute_fingerprints(ctx)
        assert ctx.resolved["encoder"]["device"] == "cpu"
        assert stage.actor_count(ctx) == 2 and stage.model_config(ctx)["threads"] == 1
        gen = S.GenerateStage()  # the LLM-free generator holds no model: one 1-thread actor per CPU too
        assert ctx.cfg.generation.generator == "llm-free"
        assert gen.actor_count(ctx) == 2 and gen.model_config(ctx)["threads"] == 1
        with_llm = StageContext(_cfg(indexed, "generation.generator=llm+fallback"), bank, None, use_ray=True)
        main_job.resolve_runtime(with_llm)
        assert gen.actor_count(with_llm) == 1 and gen.model_config(with_llm)["threads"] is None
        pool = _pool_for(stage, ctx, S.FACTORY, {}, n_units=10)
        try:
            assert len(pool.actors) == 2
            assert ray.get([a.torch_threads.remote() for a in pool.actors]) == [1, 1]
            key = S.encoder_key(ctx)
            have = bank.read("embeddings", ["text_hash", "vector"], filter=pc.field("encoder") == key)
            hashes = have["text_hash"].to_pylist()[:40]
            payload = stage.inputs(ctx, {"part": "probe", "hashes": hashes})
            got = ray.get(pool.actors[1].call.remote(stage_fn(stage), payload, stage.params(ctx)))["embeddings"]
            want = np.asarray(have["vector"].to_pylist()[:40], np.float32)
            assert got["text_hash"].to_pylist() == hashes
            np.testing.assert_allclose(np.asarray(got["vector"].to_pylist(), np.float32), want, atol=1e-5)
        finally:
            pool.close()
        fixed = StageContext(_cfg(indexed, "encoder.actors=3", "llm.threads=2"), bank, None, use_ray=True)
        main_job.resolve_runtime(fixed)
        assert stage.actor_count(fixed) == 3 and stage.model_config(fixed)["threads"] == 2
        gpu = StageContext(_cfg(indexed, "encoder.device=cuda", "ray.model_actors=4"), bank, None, use_ray=True)
        main_job.resolve_runtime(gpu)
        assert stage.actor_count(gpu) == 4 and stage.model_config(gpu)["threads"] is None
    finally:
        ray.shutdown()
    # without Ray the one in-process model uses the cores it is given (llm.threads)
    local = StageContext(_cfg(indexed), bank, None, use_ray=False)
    main_job.resolve_runtime(local)
    assert stage.model_config(local)["threads"] is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_local_cluster_runs_the_job(tmp_path, indexed) -> None:
    ray_exe = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    nodes = [subprocess.Popen([ray_exe, "start", "--head", f"--port={port}", "--num-cpus=1", "--block",
                               "--include-dashboard=false"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)]
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(1)
        nodes.append(subprocess.Popen([ray_exe, "start", f"--address=127.0.0.1:{port}", "--num-cpus=1", "--block"],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
        time.sleep(10)
        out = tmp_path / "cluster"
        exe = str(Path(sys.executable).with_name("memgas"))
        args = [exe, "run", "configs/demo.yaml", "--address", f"127.0.0.1:{port}", "--set", f"output_dir={out}"]
        for s in SETTINGS:
            args += ["--set", s]
        proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _rankings(out) == _rankings(indexed)
    finally:
        for p in reversed(nodes):
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
        # `ray start` records its address for later ray.init() calls; ours is gone, so is the record
        current = Path("/tmp/ray/ray_current_cluster")
        if current.exists() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()
