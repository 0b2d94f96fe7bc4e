"""Ray readiness without a GPU or a shared filesystem: GPU requests of kernel tasks, tasks that never open
the bank, and a real two-node local Ray cluster running the job end to end."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from memgas.jobs import keys, main_job, runner, tables
from memgas.jobs.executor import run_task, stage_fn, task_options
from memgas.jobs.ray_session import QUIET_WORKER_ENV, forwarded_env, init_ray, worker_env
from memgas.jobs.placement import kernel_device, num_gpus, placement, resolve_stage_runtimes
from memgas.jobs.stage import StageContext
from memgas.jobs.history_index.prefixes import stored_segments
from memgas.jobs.stages.associate import AssociateStage, current_coverage
from memgas.jobs.stages.encode import EncodeStage
from memgas.jobs.stages.generate import GenerateStage
from memgas.jobs.stages.nodes import NodesStage
from memgas.jobs.stages.rank import RankStage
from memgas.pipeline.bank import Bank, key_order
from memgas.pipeline.config import MemgasConfig

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
#: the smallest file on which every stage does real work (tests/fixtures/make_locomo_small.py): the
#: cluster run is about Ray placement, not data volume
SETTINGS = [f"data.path={REPO / 'tests' / 'fixtures' / 'locomo_small.json'}", "data.limit=1", "reading.enabled=false", "retrieval.methods=[session,memgas,memgas-no-gmm]",
            "ray.shard_size=1", "evaluation.plots=false"]


def _cfg(out: Path, *extra: str) -> MemgasConfig:
    return MemgasConfig.load(REPO / "configs" / "demo.yaml", [f"output_dir={out}", *SETTINGS, *extra])


def _rankings(run_dir: Path) -> list[dict]:
    fps = json.loads((run_dir / "metrics.json").read_text())["run"]["fingerprints"]
    results = Bank(run_dir / "results")
    parts = [p for p in results.parts("rankings") if p.startswith(f"rank-{fps['rank']}-")]  # MemGAS methods only
    t = results.read("rankings", parts=parts)
    return t.sort_by([("method", "ascending"), ("query_id", "ascending"), ("rank", "ascending")]).to_pylist()


@pytest.fixture(scope="module")
def indexed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("indexed")
    main_job.run(_cfg(out), use_ray=False)
    return out


class _ProbeStage(AssociateStage):
    """The association stage's scheduling (its num_gpus), with a run that reports what Ray gave it."""

    @staticmethod
    def run(model, payload, params):
        import ray

        return {"probe": pa.table({"gpu_ids": [json.dumps([str(g) for g in ray.get_gpu_ids()])],
                                   "cuda_visible": [os.environ.get("CUDA_VISIBLE_DEVICES", "")],
                                   "pid": [os.getpid()]})}


def test_kernel_tasks_request_gpus_and_see_the_ids_ray_gives_them(tmp_path) -> None:
    import ray

    cfg = _cfg(tmp_path, "retrieval.device=cuda", "ray.num_gpus_per_task=0.5")
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, configure_logging=False)
    try:
        ctx = StageContext(cfg, Bank.create(tmp_path / "bank"), None, use_ray=True)
        stage = _ProbeStage()
        gpus = num_gpus(stage, stage.active(ctx), ctx)
        assert gpus == 0.5
        remote = ray.remote(run_task).options(num_cpus=0, num_gpus=gpus)
        outs = ray.get([remote.remote(stage_fn(stage), {}, {}) for _ in range(4)])
        for out in outs:
            ids = json.loads(out["probe"]["gpu_ids"][0].as_py())
            assert len(ids) == 1 and ids[0] in ("0", "1")
            assert out["probe"]["cuda_visible"][0].as_py() == ids[0]
        # the executor's GPU tasks run one per worker process (a reused worker keeps its first GPU's CUDA
        # context): one after the other, each in a new process
        assert task_options(0.0).get("max_calls") is None and task_options(0.5)["max_calls"] == 1
        gpu_task = ray.remote(**task_options(gpus))(run_task)
        pids = [ray.get(gpu_task.remote(stage_fn(stage), {}, {}))["probe"]["pid"][0].as_py() for _ in range(3)]
        assert len(set(pids)) == 3, pids
        # device auto: CUDA only where it can run. The cluster declares GPUs, but without CuPy (this machine)
        # the kernels could not use them, so auto is the CPU path; so it is when tasks request no GPU
        auto = StageContext(_cfg(tmp_path, "retrieval.device=auto"), ctx.bank, None, use_ray=True)
        has_cupy = importlib.util.find_spec("cupy") is not None
        assert kernel_device(auto, "auto") == ("cuda" if has_cupy else "cpu")
        no_task_gpus = StageContext(_cfg(tmp_path, "ray.num_gpus_per_task=0"), ctx.bank, None, use_ray=True)
        assert kernel_device(no_task_gpus, "auto") == "cpu"
    finally:
        ray.shutdown()
    assert kernel_device(StageContext(_cfg(tmp_path), ctx.bank, None, use_ray=False), "auto") == "cpu"


def test_tasks_never_open_the_bank(tmp_path, indexed) -> None:
    """The driver reads a shard's inputs; the bank is then moved away; the task still computes the same table."""
    import ray

    cfg = _cfg(indexed)
    bank = Bank(indexed / "bank")
    results = Bank(indexed / "results")
    ctx = StageContext(cfg, bank, results, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    # the fingerprints the run committed its parts under (nodes: the rank plan digests each history's nodes)
    for stage in (NodesStage(), AssociateStage(), RankStage()):
        ctx.fingerprints[stage.name] = json.loads((tables.store_of(ctx, stage).path / "_stages" / f"{stage.name}.json")
                                                  .read_text())["fingerprint"]
    assoc, rank = AssociateStage(), RankStage()
    prefix = tables.prefix(assoc, ctx)
    part = current_coverage(ctx, prefix).parts[0]  # a stored unit of the index: its segments are in edge_segments
    units = {assoc: {"part": part, "segments": [list(s) for s in stored_segments(ctx, prefix)[part]]},
             # part names as the runner gives them; the plan of the run's answer, which had no rankings yet (a
             # plan now holds only the histories no stored part covers)
             rank: tables.name_units(rank, ctx, rank.plan(dataclasses.replace(ctx, results=None)))[0]}
    table = {"associate": "edges", "rank": "rankings"}
    want: dict[str, pa.Table] = {}
    payloads = {}
    for stage, unit in units.items():
        payloads[stage.name] = (stage, stage.inputs(ctx, unit), stage.active(ctx).params)
        want[stage.name] = tables.store_of(ctx, stage).read(table[stage.name], parts=[unit["part"]])
    moved = tmp_path / "elsewhere"
    shutil.move(str(indexed), str(moved))
    try:
        ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False)
        try:
            for name, (stage, payload, params) in payloads.items():
                got = ray.get(ray.remote(run_task).remote(stage_fn(stage), payload, params))[table[name]]
                if stage.writes[0].store == "results":  # the executor writes results in key order
                    got = key_order(table[name], got)
                assert got.num_rows and got.equals(want[name].select(got.column_names)), name
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

    def actor_count(stage, ctx):
        return placement(stage, stage.active(ctx), ctx).actors

    def actor_config(stage, ctx):
        return placement(stage, stage.active(ctx), ctx).config

    stage = EncodeStage()
    bank = Bank(indexed / "bank")
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        ctx = StageContext(_cfg(indexed), bank, Bank(indexed / "results"), use_ray=True)
        resolve_stage_runtimes(ctx)
        runner.compute_fingerprints(ctx)
        assert ctx.resolved["encoder"]["device"] == "cpu"
        assert actor_count(stage, ctx) == 2 and actor_config(stage, ctx)["threads"] == 1
        gen = GenerateStage()  # the LLM-free generator holds no model: one 1-thread actor per CPU too
        assert ctx.cfg.generation.generator == "llm-free"
        assert actor_count(gen, ctx) == 2 and actor_config(gen, ctx)["threads"] == 1
        with_llm = StageContext(_cfg(indexed, "generation.generator=llm+fallback"), bank, None, use_ray=True)
        resolve_stage_runtimes(with_llm)
        assert actor_count(gen, with_llm) == 1 and actor_config(gen, with_llm)["threads"] is None
        # the generator's CPU actors then serve the encode stage: the same processes, the encoder loaded into
        # them (no fresh process, no second round of imports), computing the bank's vectors bit for bit
        pools: dict = {}
        gen_pool = _pool_for(gen, placement(gen, gen.active(ctx), ctx), pools, n_units=10)
        gen_actors = [a._actor_id for a in gen_pool.actors]
        pool = _pool_for(stage, placement(stage, stage.active(ctx), ctx), pools, n_units=10)
        try:
            assert pool is gen_pool and [a._actor_id for a in pool.actors] == gen_actors and len(gen_actors) == 2
            assert ray.get([a.torch_threads.remote() for a in pool.actors]) == [1, 1]
            key = keys.encoder_key(ctx)
            have = bank.read("embeddings", ["text_hash", "vector"], filter=pc.field("encoder") == key)
            hashes = have["text_hash"].to_pylist()[:40]
            payload = stage.inputs(ctx, {"part": "probe", "hashes": hashes})
            got = ray.get(pool.actors[1].call.remote(stage_fn(stage), payload, stage.active(ctx).params))["embeddings"]
            want = np.asarray(have["vector"].to_pylist()[:40], np.float32)
            assert got["text_hash"].to_pylist() == hashes
            assert np.array_equal(np.asarray(got["vector"].to_pylist(), np.float32), want)
            # a model that fails to load is not reused into: the caller starts fresh actors (and fails as before)
            bad = {**placement(stage, stage.active(ctx), ctx).config, "encoder": {
                **placement(stage, stage.active(ctx), ctx).config["encoder"], "model": str(tmp_path / "no-model")}}
            assert pool.reuse_for("encoder", bad, 1) is False
        finally:
            pool.close()
        fixed = StageContext(_cfg(indexed, "encoder.actors=3", "llm.threads=2"), bank, None, use_ray=True)
        resolve_stage_runtimes(fixed)
        assert actor_count(stage, fixed) == 3 and actor_config(stage, fixed)["threads"] == 2
        gpu = StageContext(_cfg(indexed, "encoder.device=cuda", "ray.model_actors=4", "ray.num_gpus_per_model_actor=1"),
                           bank, None, use_ray=True)
        resolve_stage_runtimes(gpu)
        assert actor_count(stage, gpu) == 4 and actor_config(stage, gpu)["threads"] is None
    finally:
        ray.shutdown()
    # without Ray the one in-process model uses the cores it is given (llm.threads)
    local = StageContext(_cfg(indexed), bank, None, use_ray=False)
    resolve_stage_runtimes(local)
    assert actor_config(stage, local)["threads"] is None


def test_gpu_request_the_cluster_cannot_meet_fails_fast_with_exit_3(tmp_path) -> None:
    """A local Ray with no GPU (CUDA_VISIBLE_DEVICES="" makes Ray detect none, on any machine) and a config that
    gives model actors a GPU: the encoder resolves to CUDA and its GPU request ends the run with one line and
    exit 3, where Ray alone would wait forever, before the first stage (not after ingest,
    generate and cards)."""
    out = tmp_path / "run"
    exe = str(Path(sys.executable).with_name("memgas"))
    args = [exe, "run", "configs/demo.yaml", "--set", f"output_dir={out}", "--set", "ray.num_gpus_per_model_actor=1"]
    for setting in SETTINGS:
        args += ["--set", setting]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("memgas run: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "stage encode" in errors[0] and "needs 1 GPU per worker" in errors[0] and "has 0 GPUs" in errors[0], errors
    assert took < 60, f"took {took:.0f} s"
    assert not (out / "bank").exists(), sorted(p.name for p in out.rglob("*"))  # no stage ran, not even ingest


def test_runtime_env_forwards_vllm_settings_and_no_secrets(monkeypatch) -> None:
    """Workers get VLLM_* and the offline flags through the job's runtime_env, which Ray logs: no secret value
    is in it. A local Ray's workers still see the secrets, inherited from the driver's process."""
    import ray

    secrets = {"HF_TOKEN": "hf_secret_value_1", "MEMGAS_DB_PASSWORD": "secret_value_2",
               "VLLM_API_KEY": "secret_value_3", "HF_HUB_TOKEN": "secret_value_4"}
    for k, v in {**secrets, "VLLM_BATCH_INVARIANT": "1", "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for quiet in QUIET_WORKER_ENV:  # so that only the runtime_env can give them to the worker
        monkeypatch.delenv(quiet, raising=False)
    fwd = forwarded_env()
    assert fwd["VLLM_BATCH_INVARIANT"] == "1" and fwd["HF_HUB_OFFLINE"] == "1"
    assert not set(secrets) & set(fwd)
    init_ray(None, num_cpus=1)
    try:
        runtime_env = ray.get_runtime_context().runtime_env
        logged = json.dumps(dict(runtime_env))
        assert runtime_env["env_vars"]["VLLM_BATCH_INVARIANT"] == "1"
        assert not [v for v in secrets.values() if v in logged], logged

        @ray.remote(num_cpus=0)
        def worker_env() -> dict[str, str | None]:
            return {k: os.environ.get(k) for k in ("VLLM_BATCH_INVARIANT", *secrets, *QUIET_WORKER_ENV)}

        # the libraries' progress bars are off in the workers (the driver shows one bar per stage)
        assert ray.get(worker_env.remote()) == {"VLLM_BATCH_INVARIANT": "1", **secrets, **QUIET_WORKER_ENV}
    finally:
        ray.shutdown()


def test_workers_keep_their_progress_bars_under_verbose(monkeypatch) -> None:
    """``-v`` (the root logger at DEBUG) shows everything: the workers' environment is not quietened."""
    import logging

    for quiet in QUIET_WORKER_ENV:
        monkeypatch.delenv(quiet, raising=False)
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.INFO)
    assert QUIET_WORKER_ENV.items() <= worker_env().items()
    monkeypatch.setattr(root, "level", logging.DEBUG)
    assert not set(QUIET_WORKER_ENV) & set(worker_env())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.Popen:
    """``ray start ... --block`` in its own session, returned once it prints "Ray runtime started" (a worker
    has then joined the head), its output drained by a thread so the pipe never fills."""
    import threading

    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    started, lines = threading.Event(), []

    def drain() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                started.set()

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.time() + timeout
    while not started.wait(0.2):
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, 9)
            raise AssertionError(f"{' '.join(args[1:3])} did not start:\n{''.join(lines[-30:])}")
    return proc


def _node_env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[int]:
    """The port of a real two-node local cluster (one CPU each), shared by this module's two cluster tests:
    starting and stopping one costs more than either job."""
    nodes, port = _two_nodes(_node_env())
    try:
        yield port
    finally:
        _stop_nodes(nodes, port)


def test_two_node_local_cluster_runs_the_job(tmp_path, indexed, two_nodes) -> None:
    out = tmp_path / "cluster"
    exe = str(Path(sys.executable).with_name("memgas"))
    args = [exe, "run", "configs/demo.yaml", "--address", f"127.0.0.1:{two_nodes}", "--set", f"output_dir={out}"]
    for s in SETTINGS:
        args += ["--set", s]
    proc = subprocess.run(args, cwd=REPO, env=_node_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rankings(out) == _rankings(indexed)


def _two_nodes(env: dict[str, str]) -> tuple[list[subprocess.Popen], int]:
    """A head and a worker node of one CPU each (``ray start --block``, each in its own session)."""
    ray_exe = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    nodes: list[subprocess.Popen] = []
    try:
        nodes.append(_start_node([ray_exe, "start", "--head", f"--port={port}", "--num-cpus=1", "--block",
                                  "--include-dashboard=false"], env))
        nodes.append(_start_node([ray_exe, "start", f"--address=127.0.0.1:{port}", "--num-cpus=1", "--block"], env))
    except BaseException:
        _stop_nodes(nodes, port)
        raise
    return nodes, port


def _stop_nodes(nodes: list[subprocess.Popen], port: int) -> None:
    # SIGTERM, then SIGKILL: `ray start --block` answers SIGTERM by stopping its daemons one by one with
    # ~30 s of grace each time (measured: 30-33 s per node), more than the job itself takes here. Every
    # daemon of a node (gcs_server, raylet, dashboard agents) is in its process group.
    for p in reversed(nodes):
        try:
            os.killpg(p.pid, 15)
            p.wait(timeout=3)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait(timeout=60)
    # `ray start` records its address for later ray.init() calls; ours is gone, so is the record
    current = Path("/tmp/ray/ray_current_cluster")
    if current.exists() and current.read_text().strip().endswith(f":{port}"):
        current.unlink()


def test_one_history_cut_into_tasks_on_two_nodes_equals_one_task(tmp_path, monkeypatch, two_nodes) -> None:
    """ONE synthetic history of 360 sessions (seeded 32-d vectors written into the bank, no encoder), exact and
    IVF: associated in one in-process task over its whole matrix (the default constants), then on a real
    two-node cluster cut into several Ray tasks (3 exact units, 4 IVF units) whose node vectors reach them in
    blocks of 16 sessions through the object store. Edges, and under IVF the saved index, are the same
    bytes; so are those of 250 sessions then an append of 110 over the saved index. The driver is this
    process (its module constants cut the plan; the IVF grid and the recall sample's size, 100 rows here,
    travel with the units: each unit stores its 100 smallest row keys, and the history keeps the one
    task's 100). Which node ran which
    task is Ray's choice and is not asserted: with one CPU per node and up to four units in flight, the
    units are spread over both."""
    import ray

    from memgas.pipeline.association import ivf_search

    from .test_node_blocks import (
        GRID,
        IVF_SMALL,
        _history_sample,
        _stored_recall_rows,
        associate_ctx,
        associate_rows,
        copy_parts,
        run_associate,
        seeded_bank,
        small_units,
    )

    modes = {"exact": {}, "ivf": IVF_SMALL}
    monkeypatch.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    monkeypatch.setattr(ivf_search, "RECALL_ROWS", 100)
    want = {}
    for mode, assoc in modes.items():
        bank, _ = seeded_bank(tmp_path / f"one-{mode}", {"h": 360})
        units, _ = run_associate(associate_ctx(bank, assoc))
        assert [s[:3] for u in units for s in u["segments"]] == [["h", 0, 360]]
        want[mode] = associate_rows(bank)
    small_units(monkeypatch)
    port = two_nodes
    try:
        ray.init(address=f"127.0.0.1:{port}", configure_logging=False, log_to_driver=False)
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert len(alive) == 2 and all(n["Resources"].get("CPU") == 1 for n in alive)
        for mode, assoc in modes.items():
            bank, _ = seeded_bank(tmp_path / f"cut-{mode}", {"h": 360})
            units, stats = run_associate(associate_ctx(bank, assoc, use_ray=True))
            assert len(units) == (4 if mode == "ivf" else 3) and all(u["size"] == 1 for u in units)
            got = associate_rows(bank)
            assert got["edges"] == want[mode]["edges"], mode
            assert got["ivf_index"] == want[mode]["ivf_index"] and bool(got["ivf_index"]) == (mode == "ivf")
            # IVF units [96, 192), [192, 288), [288, 360): 368, 384 and 288 rows past node 400, each stores
            # its 100 smallest keys that 100 earlier rows do not beat
            stored = _stored_recall_rows("h", [(96, 192), (192, 288), (288, 360)], 400, 100)
            assert len(got["ivf_recall"]) == (sum(stored.values()) if mode == "ivf" else 0)
            assert _history_sample(got["ivf_recall"]) == _history_sample(want[mode]["ivf_recall"])
        # an append over the saved index: 250 sessions, then 110 more in two units, both starting from the
        # saved index (put once into the object store, shared by reference)
        first, _ = seeded_bank(tmp_path / "first", {"h": 250})
        run_associate(associate_ctx(first, IVF_SMALL, use_ray=True))
        grown, _ = seeded_bank(tmp_path / "grown", {"h": 360})
        copy_parts(first, grown)
        units, stats = run_associate(associate_ctx(grown, IVF_SMALL, use_ray=True))
        assert len(units) == 2 and stats["ivf_index_reused"] == 1
        got = associate_rows(grown)
        assert got["edges"] == want["ivf"]["edges"] and got["ivf_index"] == want["ivf"]["ivf_index"]
    finally:
        ray.shutdown()
