"""The typed config: every preset loads; bad values are one-line errors naming the key and their source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memgas.pipeline.config import ALL_METHODS, MemgasConfig
from memgas.pipeline.data import FORMATS
from memgas.pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"


@pytest.mark.parametrize("preset", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_loads(preset: Path) -> None:
    cfg = MemgasConfig.load(preset)
    assert cfg.data.format in FORMATS


def test_defaults_are_valid() -> None:
    cfg = MemgasConfig()
    assert cfg.retrieval.methods == list(ALL_METHODS)


# (override, words the one-line error must hold). Add a row for every new rule.
BAD = [
    ("retrieval.store_top=0", "retrieval.store_top"),
    ("retrieval.store_top=10", "largest evaluation.ks"),
    ("retrieval.temp=0", "retrieval.temp"),
    ("retrieval.temp=-1", "retrieval.temp"),
    ("retrieval.num_seeds=0", "retrieval.num_seeds"),
    ("retrieval.num_seeds=-3", "retrieval.num_seeds"),
    ("retrieval.num_seeds=lots", "retrieval.num_seeds"),
    ("retrieval.damping=0", "retrieval.damping"),
    ("retrieval.damping=1", "retrieval.damping"),
    ("retrieval.damping=1.5", "retrieval.damping"),
    ("retrieval.methods=[]", "retrieval.methods"),
    ("retrieval.methods=[memgas,bogus]", "bogus"),
    ("reading.max_questions=-1", "reading.max_questions"),
    ("reading.methods=[bogus]", "bogus"),
    ("reading.top_k=0", "reading.top_k"),
    ("reading.top_k=99", "reading.top_k"),
    ("association.mem_threshold=0", "association.mem_threshold"),
    ("association.mem_threshold=1", "association.mem_threshold"),
    ("association.min_prior_nodes=-1", "association.min_prior_nodes"),
    ("association.topk_edges=0", "association.topk_edges"),
    ("encoder.batch_size=0", "encoder.batch_size"),
    ("llm.batch_size=-1", "llm.batch_size"),
    ("llm.concurrency=0", "llm.concurrency"),
    ("llm.timeout_s=0", "llm.timeout_s"),
    ("llm.max_retries=-1", "llm.max_retries"),
    ("llm.gpu_memory_utilization=1.5", "llm.gpu_memory_utilization"),
    ("ray.model_actors=0", "ray.model_actors"),
    ("encoder.actors=0", "encoder.actors"),
    ("encoder.pair_max_tokens=4", "encoder.pair_max_tokens"),
    ("encoder.pair_max_tokens=abc", "encoder.pair_max_tokens"),
    ("encoder.session_max_tokens=7", "encoder.session_max_tokens"),
    ("encoder.session_max_tokens=-1", "encoder.session_max_tokens"),
    ("ray.shard_size=0", "ray.shard_size"),
    ("ray.generate_unit=0", "ray.generate_unit"),
    ("ray.encode_unit=-5", "ray.encode_unit"),
    ("ray.num_cpus=0", "ray.num_cpus"),
    ("ray.num_gpus_per_model_actor=-1", "ray.num_gpus_per_model_actor"),
    ("evaluation.ks=[]", "evaluation.ks"),
    ("evaluation.ks=[0]", "evaluation.ks[0]"),
    ("evaluation.ks=[1,-5]", "evaluation.ks[1]"),
    ("data.format=csv", "data.format"),
    ("data.limit=-1", "data.limit"),
    ("retrieval.bogus=1", "unknown key"),
    ("retrieval={num_seeds: 0}", "retrieval.num_seeds"),
]


@pytest.mark.parametrize("override, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_override_names_the_set(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        MemgasConfig.load(DEMO, [override])
    msg = str(exc.value)
    assert "\n" not in msg and needle in msg
    assert msg.startswith(f"--set {override}:"), msg


def test_reading_method_must_be_ranked() -> None:
    with pytest.raises(ConfigError, match="does not rank"):
        MemgasConfig.load(DEMO, ["retrieval.methods=[session]", "reading.methods=[memgas]"])
    # reading disabled: nothing to check
    MemgasConfig.load(DEMO, ["retrieval.methods=[session]", "reading.enabled=false"])


def test_tensor_parallel_needs_gpus_per_actor() -> None:
    base = ["llm.backend=vllm", "llm.tensor_parallel_size=2"]
    with pytest.raises(ConfigError, match="ray.num_gpus_per_model_actor=1"):
        MemgasConfig.load(DEMO, [*base, "ray.num_gpus_per_model_actor=1"])
    MemgasConfig.load(DEMO, [*base, "ray.num_gpus_per_model_actor=2"])
    MemgasConfig.load(DEMO, [*base, "ray.num_gpus_per_model_actor=0"])  # 0: Ray does not place GPUs
    MemgasConfig.load(DEMO, ["llm.tensor_parallel_size=2", "ray.num_gpus_per_model_actor=1"])  # not vllm


def test_bad_value_in_the_file_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("retrieval:\n  num_seeds: 0\n")
    with pytest.raises(ConfigError, match=rf"^{f}: retrieval.num_seeds"):
        MemgasConfig.load(f)
    # the same key fixed by --set: fine
    assert MemgasConfig.load(f, ["retrieval.num_seeds=4"]).retrieval.num_seeds == 4


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"retrieval: [\n", "not valid YAML: line"),
        (b"\xff\xfe\x00binary", "not a text file"),
        (b"just a string\n", "expected a mapping"),
        (b"- a\n- b\n", "expected a mapping"),
        (b"retrieval:\n\tnum_seeds: 3\n", "not valid YAML"),
    ],
)
def test_bad_config_files(tmp_path: Path, content: bytes, needle: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_bytes(content)
    with pytest.raises(ConfigError) as exc:
        MemgasConfig.load(f)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_config_path_problems(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        MemgasConfig.load(tmp_path)
    with pytest.raises(ConfigError, match="not found"):
        MemgasConfig.load(tmp_path / "missing.yaml")
    assert MemgasConfig.load(_write(tmp_path / "empty.yaml", "")).name == "demo"


@pytest.mark.parametrize("item", ["noequals", "=3", "a..b=1", "retrieval.num_seeds=[", "data.path.x=1"])
def test_malformed_set(item: str) -> None:
    with pytest.raises(ConfigError, match=r"^--set "):
        MemgasConfig.load(DEMO, [item])


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def test_data_path_relative_to_the_config_file(tmp_path: Path, monkeypatch) -> None:
    """A relative data.path is looked up from the working directory first, then beside the config."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "d.json").write_text("[]")
    cfg_file = _write(tmp_path / "cfg" / "c.yaml", "data:\n  path: d.json\n")
    monkeypatch.chdir(tmp_path)
    assert MemgasConfig.load(cfg_file).data.path == str(cfg_file.parent / "d.json")
    # from the working directory when it exists there
    (tmp_path / "d.json").write_text("[]")
    assert MemgasConfig.load(cfg_file).data.path == "d.json"
    # a --set path is the user's: taken from the working directory only
    assert MemgasConfig.load(cfg_file, ["data.path=nope.json"]).data.path == "nope.json"


def test_check_paths(tmp_path: Path) -> None:
    data = _write(tmp_path / "d.json", "[]")
    ok = MemgasConfig(data={"path": str(data)}, output_dir=str(tmp_path / "out" / "run"))
    ok.check_paths()
    assert not (tmp_path / "out").exists()  # checking creates nothing
    with pytest.raises(ConfigError, match="data.path: .*a directory"):
        MemgasConfig(data={"path": str(tmp_path)}).check_paths(output=False)
    with pytest.raises(ConfigError, match="data.path: .*no such file"):
        MemgasConfig(data={"path": str(tmp_path / "x.json")}).check_paths(output=False)
    with pytest.raises(ConfigError, match="output_dir: .*not a directory"):
        MemgasConfig(data={"path": str(data)}, output_dir=str(data)).check_paths()
    with pytest.raises(ConfigError, match="is a file"):
        MemgasConfig(data={"path": str(data)}, output_dir=str(data / "sub")).check_paths()
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        with pytest.raises(PermissionError):
            MemgasConfig(data={"path": str(data)}, output_dir=str(ro / "run")).check_paths()
