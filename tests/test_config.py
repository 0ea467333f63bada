"""Config schema: defaults, YAML + --set overrides, and one clear ConfigError per bad config."""

import pytest
import yaml

from dspark_cluster import ConfigError, load_config
from dspark_cluster.config import DEFAULT_CONFIG_PATH, parse_overrides


def test_bundled_default_and_overrides(checkpoint, tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    assert raw["model"]["path"] == "tiny-moe"
    path = checkpoint("qwen3_moe")
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"model": {"path": str(path)}, "scheduler": {"block_size": 8}}))
    cfg = load_config(f, ["scheduler.max_num_seqs=7", "parallel.tensor=2", "parallel.executor=ray", "eplb.enabled=true",
                          "scheduler.kv_cache_memory=1GiB"])
    assert cfg.scheduler.block_size == 8 and cfg.scheduler.max_num_seqs == 7
    assert cfg.parallel.tensor == 2 and cfg.eplb.enabled is True
    assert int(cfg.scheduler.kv_cache_memory) == 2**30
    assert cfg.speculative.method == "none" and cfg.parallel.backend == "auto"
    assert parse_overrides(["a.b.c=[1, 2]", "x=none"]) == {"a": {"b": {"c": [1, 2]}}, "x": "none"}
    # auto / on / off switches as a user writes them: YAML reads a bare on / off as a boolean
    cfg = load_config(None, ["model.compile=off", "parallel.compiled_graph=on"])
    assert cfg.model.compile == "off" and cfg.parallel.compiled_graph == "on"
    f.write_text("model:\n  compile: on\nparallel:\n  compiled_graph: off\n")
    cfg = load_config(f)
    assert cfg.model.compile == "on" and cfg.parallel.compiled_graph == "off"
    with pytest.raises(ConfigError, match="model.compile"):
        load_config(None, ["model.compile=fast"])


def test_relative_model_path_resolves_beside_the_yaml(checkpoint, tmp_path):
    path = checkpoint("llama")
    (tmp_path / "ckpt").symlink_to(path)
    f = tmp_path / "x.yaml"
    f.write_text("model: {path: ckpt}\n")
    assert load_config(f).model.path == str((tmp_path / "ckpt").resolve())


BAD = [
    ({"parallel": {"tensor": -2}}, "parallel.tensor"),
    ({"parallel": {"tensor": 3}}, "parallel.tensor"),  # 3 does not divide 4 heads
    ({"parallel": {"tensor": 2, "data": 3}}, "parallel"),  # 8 experts over 6 ranks
    ({"parallel": {"tensor": 4}, "eplb": {"num_redundant_experts": 2}}, "eplb.num_redundant_experts"),
    ({"parallel": {"executor": "slurm"}}, "parallel.executor"),
    ({"parallel": {"device": "cpu", "backend": "nccl"}}, "parallel.backend"),
    ({"scheduler": {"block_size": 0}}, "scheduler.block_size"),
    ({"scheduler": {"max_num_seqs": "lots"}}, "scheduler.max_num_seqs"),
    ({"scheduler": {"num_kv_blocks": -5}}, "num_kv_blocks"),
    ({"scheduler": {"kv_cache_memory": "ten gigs"}}, "scheduler.kv_cache_memory"),
    ({"scheduler": {"max_model_len": 100000}}, "scheduler.max_model_len"),
    ({"scheduler": {"max_batch": 4}}, "scheduler.max_batch"),
    ({"speculative": {"method": "draft_model"}}, "draft_model"),
    ({"speculative": {"method": "medusa"}}, "speculative.method"),
    ({"speculative": {"num_tokens": -1}}, "speculative.num_tokens"),
    ({"speculative": {"prior_acceptance": 1.0}}, "speculative.prior_acceptance"),  # a survival in (0, 1), or null
    ({"speculative": {"draft_passes": 3}}, "speculative.draft_passes"),  # auto, 1 or 2
    ({"eplb": {"policy": "random", "num_redundant_experts": -1}}, "eplb.policy"),
    ({"modle": {"path": "x"}}, "modle"),
    ({"model": {"dtype": "int8"}}, "model.dtype"),
    ({"workload": {"request_rate": -1.0}}, "workload.request_rate"),
    ({"workload": {"kind": "prompts", "prompt_len": [4, 8]}}, "prompt_len"),  # the prompt set's lengths are its own
    ({"speculative": {"method": "ngram", "calibration": {"enabled": True}}}, "calibration.enabled"),
    ({"speculative": {"calibration": {"learning_rate": 0}}}, "speculative.calibration.learning_rate"),
]


@pytest.mark.parametrize("override, key", BAD, ids=[k for _, k in BAD])
def test_bad_config_is_refused_naming_the_key(override, key, checkpoint):
    data = {"model": {"path": str(checkpoint("qwen3_moe"))}, "parallel": {"executor": "ray"}}
    for section, values in override.items():
        data.setdefault(section, {}).update(values) if isinstance(data.get(section), dict) else data.update({section: values})
    with pytest.raises(ConfigError) as e:
        load_config(data)
    assert key in str(e.value)


def test_every_problem_is_listed_with_value_and_fix(checkpoint):
    with pytest.raises(ConfigError) as e:
        load_config({"model": {"path": str(checkpoint("qwen3_moe"))},
                     "parallel": {"tensor": 0, "executor": "mpi"}, "scheduler": {"block_size": -1}, "bogus": 1})
    msg = str(e.value)
    assert len(e.value.problems) == 4
    assert "parallel.tensor: got 0" in msg and "greater than or equal to 1" in msg
    assert "'ray' or 'local'" in msg
    assert "bogus: unknown key; accepted keys: model, parallel" in msg


def test_missing_files_and_bad_overrides():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml")
    with pytest.raises(ConfigError, match="model.path"):
        load_config({"model": {"path": "/nowhere"}})
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["scheduler.block_size"])


@pytest.mark.parametrize("method, draft, fix", [
    ("dspark", "tiny-draft", "use speculative.method: draft_model for a plain causal LM"),
    ("draft_model", "tiny-dspark", "use speculative.method: dspark"),
])
def test_a_drafter_of_the_wrong_kind_is_one_config_error_from_the_cli(method, draft, fix, tmp_path, monkeypatch,
                                                                      capsys):
    """`speculative.method: dspark` pointed at a plain causal LM (and the reverse): the ConfigError's one
    line names the field, the value and the fix, and nothing else is printed (no traceback)."""
    from dspark_cluster.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["run", "--set", f"speculative.method={method}", "--set", f"speculative.draft_model={draft}",
                 "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: invalid configuration: speculative.draft_model: got '") and f"{draft}'" in line
    assert fix in line
