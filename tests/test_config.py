"""The config: its schema (core/config.py) and its rules (core/validation.py, core/rules.py).

Schema: the defaults load and validate, `--set` converts each field type, an unknown key names
the closest known one, every range names its key, and the module imports nothing of the
project. Validation: a cross-field error of each part with its message, each on the side of
the split it belongs to (the config's own rules, `check_config`, or the layout's,
`check_layout`), and every shipped launch/configs/*.toml, completed as its launcher completes
it, passing at a world size that fits its layout. Real parts: the TOML files on disk, a built
dataset for the recipes' data, the modules imported in a fresh interpreter.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from core.config import FP8_RECIPES, RANGES, Config, ConfigError, MoEConfig, field_docs, load_config
from core.rules import RECOMPUTE_MODULES, moe_layer_rule, recompute_set
from core.validation import check_config, check_layout, check_moe, check_split_masters, validate
from dataservice.build import build_dataset, make_corpus

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "launch" / "configs"
PROJECT = ("protos", "dataservice", "core", "moe", "interop", "bench")


# ---- the schema --------------------------------------------------------------------------

def _project_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append("." if node.level else node.module or "")
    return [name for name in found if name == "." or name.split(".")[0] in PROJECT]


def test_config_is_a_leaf_and_the_rules_load_no_torch():
    assert _project_imports(ROOT / "core" / "config.py") == []
    # What importing them really loads, in a fresh interpreter: the planner reads the rules and
    # the validation without torch, and neither reaches the parallel steps, the trainer or moe.
    probe = ("import sys, core.config; print(sorted(m for m in sys.modules if m.split('.')[0] in {0!r})); "
             "import core.validation, core.rules; print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'moe') or m.startswith(('core.parallel', 'core.train', 'core.planner'))))").format(PROJECT)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    config_loads, rules_load = done.stdout.splitlines()
    assert config_loads == "['core', 'core.config']" and rules_load == "[]", done.stdout


def test_defaults_load_and_validate():
    assert load_config() == Config() and load_config(None, []).to_dict() == Config().to_dict()
    config = validate(load_config(), 1)
    assert config.parallel.dp == 1 and config.train.precision == "auto"
    assert FP8_RECIPES == typing.get_args(typing.get_type_hints(type(config.train))["fp8_recipe"])


@pytest.mark.parametrize("setting, key, value", [
    ("model.num_layers=4", "model.num_layers", 4),
    ("train.lr=.001", "train.lr", 0.001),  # not TOML, but a number
    ("train.lr=1", "train.lr", 1.0),  # a whole number for a float key
    ("train.compile=true", "train.compile", True),
    ("train.compile=False", "train.compile", False),
    ("data.dataset=/tmp/my data", "data.dataset", "/tmp/my data"),  # a bare word is text
    ("data.consumer=42", "data.consumer", "42"),
    ("train.precision=bf16", "train.precision", "bf16"),
    ("model.moe.dense_layers=[0, 3]", "model.moe.dense_layers", [0, 3]),
    ("train.recompute_modules=['mlp', 'norms']", "train.recompute_modules", ["mlp", "norms"]),
])
def test_set_converts_each_field_type(setting, key, value):
    section, _, name = key.rpartition(".")
    got = getattr(functools.reduce(getattr, section.split("."), load_config(None, [setting])), name)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("setting, message", [
    ("model.dim=abc", "model.dim must be int (a whole number, e.g. model.dim=64), got 'abc'"),
    ("model.dim=64.0", "model.dim must be int (a whole number, e.g. model.dim=64), got 64.0"),
    ("train.lr=fast", "train.lr must be float (a number, e.g. train.lr=0.003), got 'fast'"),
    ("train.lr=inf", "train.lr must be a finite number, got inf"),
    ("train.compile=yes", "train.compile must be true or false, got 'yes'"),
    ("train.precision=fp16", "train.precision='fp16' must be 'auto', 'fp32', 'bf16' or 'fp8'"),
    ("model.moe.dense_layers=[0.5]", "model.moe.dense_layers must be a list of whole numbers (e.g. "
                                     "model.moe.dense_layers=[0, 3]), got [0.5]"),
    ("train.recompute_modules=mlp", "train.recompute_modules must be a list of names"),
    ("model=3", "'model' is a section; give keys like 'model.<name>'"),
    ("model.dim", "--set expects KEY=VALUE (e.g. --set model.num_layers=4), got 'model.dim'"),
    ("model..dim=3", "the key must be a dotted path such as model.num_layers"),
])
def test_set_refuses_a_value_of_the_wrong_type(setting, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [setting])


@pytest.mark.parametrize("setting, message", [
    ("model.num_layer=2", "unknown config key 'model.num_layer' (did you mean 'model.num_layers'? known keys here: "),
    ("modle.dim=2", "unknown config key 'modle' (did you mean 'model'? known keys here: checkpoint, data, eval, "
                    "model, parallel, train)"),
    ("model.moe.top=2", "did you mean 'model.moe.top_k'?"),
    ("train.zzz=1", "unknown config key 'train.zzz' (known keys here: beta1, beta2, "),
])
def test_unknown_keys_name_the_closest_known_one(setting, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [setting])


def test_the_file_then_each_set_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nnum_layers = 3\n[train]\nmax_steps = 7\n")
    config = load_config(path, ["model.dim=128", "train.run_dir=/tmp/x", "model.dim=96"])
    assert (config.model.num_layers, config.model.dim, config.train.max_steps, config.train.run_dir) == \
        (3, 96, 7, "/tmp/x")
    path.write_text("[model]\nlayers = 3\n")
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'model.layers'")):
        load_config(path)


def test_every_key_has_a_type_and_a_one_line_doc():
    docs = field_docs()
    assert len(docs) > 60 and "model.moe.top_k" in docs
    for key, doc in docs.items():
        assert doc and "\n" not in doc and len(doc) < 140, (key, doc)
    hints = typing.get_type_hints(type(Config().train))
    assert typing.get_args(hints["precision"]) == ("auto", "fp32", "bf16", "fp8")


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_range_is_checked_and_names_the_key(key):
    spec = RANGES[key]
    if spec.startswith(">="):
        bad = int(spec[2:]) - 1
    elif spec.startswith(">"):
        bad = int(spec[1:])
    else:  # [a, b) or [a, b]: the top, or just above it
        bad = int(spec[1:-1].split(",")[1]) + (spec.endswith("]"))
    section, _, name = key.rpartition(".")
    config = Config()
    owner = functools.reduce(getattr, section.split("."), config)
    setattr(owner, name, type(getattr(owner, name))(bad))
    with pytest.raises(ConfigError, match="^" + re.escape(f"{key}={getattr(owner, name)!r} must be {spec}")):
        validate(config, 1)


def test_code_built_configs_go_through_the_same_checks():
    config = Config()
    config.train.precision = "fp16"
    with pytest.raises(ConfigError, match=r"train.precision='fp16' must be 'auto', 'fp32', 'bf16' or 'fp8'"):
        validate(config, 1)
    config = Config()
    config.model.dim = 64.0
    with pytest.raises(ConfigError, match="model.dim must be int"):
        validate(config, 1)
    assert dataclasses.asdict(validate(load_config(None, ["train.lr=.01"]), 1))["train"]["lr"] == 0.01


# ---- the rules between keys ---------------------------------------------------------------

# The config's own rules: they hold or fail whatever the layout and the world size.
CONFIG_ERRORS = [
    (["model.dim=60", "model.num_heads=8"], "model.dim=60 must be divisible by model.num_heads=8 (or give the head "
                                            "size as model.head_dim)"),
    (["model.num_kv_heads=3"], "model.num_heads=4 must be a multiple of model.num_kv_heads=3"),
    (["model.head_dim=15"], "model.head_dim=15 must be even (rotary embeddings turn pairs of features)"),
    (["model.dim=20"], "model.dim / model.num_heads = 20 / 4 = 5 must be even"),
    (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4.0"],
     "model.rope_scaling.type='yarn' needs model.rope_scaling.original_max_position_embeddings > 0 (the "
     "pretraining context length), got 0"),
    (["model.rope_scaling.factor=2.0"], "model.rope_scaling.factor=2.0 has no effect with "
                                        "model.rope_scaling.type='none'"),
    (["model.rope_scaling.type=llama3", "model.rope_scaling.original_max_position_embeddings=64",
      "model.rope_scaling.low_freq_factor=4.0"],
     "model.rope_scaling.high_freq_factor=4.0 must exceed model.rope_scaling.low_freq_factor=4.0"),
    (["model.moe.num_experts=4", "model.moe.top_k=5"], "model.moe.top_k=5 must be between 1 and num_experts=4"),
    (["model.moe.num_experts=4", "model.moe.first_k_dense=2"],
     "model.moe.first_k_dense=2 leaves no MoE layer among model.num_layers=2"),
    (["model.moe.num_experts=4", "model.moe.dense_layers=[5]"],
     "model.moe.dense_layers=[5] must name distinct layers in [0, model.num_layers=2)"),
    (["train.min_lr=0.1"], "train.min_lr=0.1 must not exceed train.lr=0.003"),
    (['train.run_dir=" "'], "train.run_dir is empty; give the run a folder"),
    (["train.cuda_graphs=true"], "train.cuda_graphs=true replays the compiled blocks' graphs and needs "
                                 "train.compile=true"),
    (["train.fp8_recipe=tensorwise"], "train.fp8_recipe='tensorwise' applies to train.precision='fp8' only "
                                      "(now 'auto')"),
    (["train.precision=fp8", "train.fp8_recipe=delayed"], "train.fp8_recipe='delayed' runs through Transformer "
                                                          "Engine: set model.dense_backend='te'"),
    (["model.dense_backend=te", "train.recompute_modules=['norms']"],
     "train.recompute_modules ['norms'] cannot run with model.dense_backend='te'"),
    (["train.recompute_modules=['mlp']", "train.offload_modules=['swiglu']"],
     "train.offload_modules has 'swiglu', which overlaps the recomputed 'mlp'"),
    (["train.fused_loss=true", "parallel.gradient_accumulation_fusion=false"],
     "it needs parallel.gradient_accumulation_fusion=true"),
    (["parallel.split_master_weights=true", "train.precision=fp32"],
     "parallel.split_master_weights keeps fp32 masters as bf16 weights plus their low halves: it needs "
     "train.precision bf16 or fp8, not fp32"),
    (["data.address=h:1", "data.cp_cost=/no/cost.json"], "data.cp_cost is the cost model of the trainer's own server"),
    (["eval.interval=2"], "eval.interval=2 needs held-out data: set eval.dataset=DIR"),
]

# The layout's rules: each config below passes check_config and fails on `world` ranks.
LAYOUT_ERRORS = [
    (["parallel.tp=3"], 3, "parallel.tp=3 must divide model.num_heads=4 and model.num_kv_heads=2"),
    (["parallel.tp=2"], 3, "world size 3 is not a multiple of pp*cp*tp = 1*1*2 = 2"),
    (["parallel.dp=3"], 2, "world size 2 != pp*dp*cp*tp = 1*3*1*1; leave parallel.dp unset to use dp=2"),
    (["parallel.ep=3"], 2, "parallel.ep=3 must divide dp*cp = 2*1 = 2"),
    (["model.moe.num_experts=6", "parallel.ep=4"], 4, "parallel.ep=4 must divide model.moe.num_experts=6"),
    (["model.moe.num_experts=4", "parallel.tp=2", "parallel.etp=3"], 2,
     "parallel.etp=3 must be 1 (whole experts on every TP rank) or parallel.tp=2"),
    (["parallel.pp=4"], 4, "model.num_layers=2 is smaller than parallel.pp=4"),
    (["train.global_batch_size=6"], 4, "train.global_batch_size=6 must be a multiple of micro_batch_size*dp = 2*4 = 8"),
    (["parallel.tp=2", "train.micro_batch_size=1", "train.seq_len=255"], 2,
     "train.micro_batch_size*train.seq_len = 1*255 must be divisible by parallel.tp=2 for sequence parallelism"),
    (["parallel.pp_virtual_stages=2"], 1, "parallel.pp_virtual_stages=2 needs parallel.pp_schedule='interleaved'"),
    (["model.num_layers=4", "parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2",
      "train.global_batch_size=2"], 2,
     "the interleaved schedule needs micro-batches per step (1) to be a multiple of parallel.pp=2"),
    (["parallel.pp_first_stage_layers=3"], 1, "with one pipeline stage it holds all 2 layers"),
    (["train.precision=fp8", "train.fp8_recipe=tensorwise", "parallel.tp=2"], 2,
     "train.fp8_recipe='tensorwise' with the torch backend (torchao) runs at parallel.tp=1 only (now 2)"),
    (["train.compile=true", "train.cuda_graphs=true", "parallel.pp=2"], 2,
     "train.cuda_graphs=true runs at parallel.pp=1 only (now 2)"),
    (["parallel.cp=2", "parallel.dynamic_cp=true", "model.moe.num_experts=4", "model.moe.capacity_factor=1.25"], 2,
     "parallel.dynamic_cp with model.moe.capacity_factor > 0 is not supported: capacity is counted per rank's tokens"),
    (["eval.interval=2", "eval.address=h:1", "parallel.pp=2"], 2,
     "eval.interval > 0 with parallel.pp > 1 is not supported yet"),
    ([], 0, "the world size must be >= 1, got 0"),
]


@pytest.mark.parametrize("settings, message", CONFIG_ERRORS)
def test_the_configs_own_errors_are_named_whatever_the_layout(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(load_config(None, settings))
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(None, settings), 1)


@pytest.mark.parametrize("settings, world, message", LAYOUT_ERRORS)
def test_layout_errors_come_from_the_layout_alone(settings, world, message):
    config = load_config(None, settings)
    check_config(config)  # nothing wrong with the config itself
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_layout(config, world)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(None, settings), world)


@pytest.mark.parametrize("settings, world", [
    (["train.precision=fp8", "train.compile=true"], 1),
    (["train.compile=true", "model.moe.num_experts=4"], 1),
    (["model.dense_backend=te", "train.precision=fp8", "train.fp8_recipe=delayed",
      "train.recompute_modules=['attention_core']"], 1),
    (["parallel.tp=2", "parallel.pp=2", "model.moe.num_experts=4", "parallel.ep=2", "parallel.etp=2"], 8),
])
def test_settings_that_work_together_pass(settings, world):
    validate(load_config(None, settings), world)


def test_the_layout_derives_dp_and_the_dynamic_cp_budget():
    config = load_config(None, ["parallel.tp=2", "parallel.cp=2", "parallel.dynamic_cp=true", "train.seq_len=256"])
    check_config(config)
    assert check_layout(config, 8) == 2 and config.parallel.dp == 2
    assert config.parallel.cp_token_budget == 2 * 256 // 2  # micro_batch_size*seq_len/cp, static CP's share


def test_split_masters_on_the_device_reads_what_auto_became():
    config = validate(load_config(None, ["parallel.split_master_weights=true"]), 1)  # auto: bf16 on a GPU
    check_split_masters(config, "bf16")
    with pytest.raises(ConfigError, match=re.escape("it needs train.precision bf16 or fp8, not fp32")):
        check_split_masters(config, "fp32")  # auto on a CPU


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_experts=4, top_k=5), "top_k=5 must be between 1 and num_experts=4"),
    (dict(num_experts=8, router="relu"), "router='relu' must be 'softmax' or 'sigmoid'"),
    (dict(num_experts=8, n_groups=3), "n_groups=3 must be >= 1 and divide num_experts=8"),
    (dict(num_experts=8, top_k=4, n_groups=4, topk_groups=1), "top_k=4 exceeds"),
    (dict(num_experts=8, dispatcher="ring"), "dispatcher='ring'"),
    (dict(num_experts=8, capacity_factor=-1.0), "capacity_factor=-1.0 must be >= 0"),
    (dict(num_experts=0), "model.moe.num_experts must be >= 1 for an MoE layer, got 0"),
])
def test_moe_settings_of_a_layer_built_alone_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_moe(MoEConfig(**kwargs))


def test_rules_the_planner_shares():
    train = load_config(None, ["train.recompute=selective", "train.recompute_modules=['norms']"]).train
    assert recompute_set(train) == {"attention_core", "norms"} and set(RECOMPUTE_MODULES) >= recompute_set(train)
    moe = MoEConfig(num_experts=4, first_k_dense=1, moe_every=2, dense_layers=[5])
    assert [i for i in range(8) if moe_layer_rule(moe, i)] == [1, 3, 7]


# ---- the shipped configs ------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("config-data")
    return build_dataset([make_corpus(tmp, n_docs=8, seed=3, max_len=200)], tmp / "shards")


# Each shipped config, completed as its launcher completes it, and a world size its layout fits.
# The fine-tuning recipes hold every section but [model]: launch/finetune_long.sh takes it from
# the import, the context it was trained at (original_max_position_embeddings = 0 in the file)
# from config.json, and both datasets from the conversations.
LLAMA3_8B = ["model.vocab_size=128256", "model.dim=4096", "model.num_layers=32", "model.num_heads=32",
             "model.num_kv_heads=8", "model.ffn_dim=14336", "model.rope_theta=500000.0",
             "model.rope_scaling.original_max_position_embeddings=8192"]
SHIPPED = {
    "deepseek_like": ([], 8),
    "finetune_tiny": (["model.rope_scaling.original_max_position_embeddings=64"], 4),
    "llama3_8b_longctx": (LLAMA3_8B, 8),
    "llama3_8b_long": ([], 8),
    "llama3_8b_long_1gpu": ([], 1),
    "llama3_8b_long_8gpu": ([], 8),
    "mixtral_like": ([], 16),
    "tiny_dense": ([], 1),
    "tiny_moe": ([], 2),
}
RECIPES = ("finetune_tiny", "llama3_8b_longctx", "llama3_8b_long_1gpu", "llama3_8b_long_8gpu")
# The long-context recipes tessera-plan --longest chose carry the whole Llama-3.1-8B [model] they were planned for.
WHOLE_MODEL = ("llama3_8b_long_1gpu", "llama3_8b_long_8gpu")


def test_every_shipped_config_is_covered():
    assert sorted(p.stem for p in CONFIGS.glob("*.toml")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_config_validates_at_a_world_size_that_fits_it(name, built):
    settings, world = SHIPPED[name]
    if name in RECIPES:
        settings = settings + [f"data.dataset={built}", f"eval.dataset={built}"]
    config = validate(load_config(CONFIGS / f"{name}.toml", settings), world)
    p = config.parallel
    assert p.pp * p.dp * p.cp * p.tp == world and p.dp >= 1
    if name in RECIPES and name not in WHOLE_MODEL:  # as shipped, the file alone names its missing field: the import supplies it
        with pytest.raises(ConfigError, match=re.escape("original_max_position_embeddings > 0")):
            check_config(load_config(CONFIGS / f"{name}.toml"))


def test_a_recipe_cost_model_is_read_from_its_file(tmp_path, built):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"per_token": 1e-6, "per_pair": 1e-9}))
    config = load_config(None, [f"data.dataset={built}", f"data.cp_cost={cost}"])
    assert validate(config, 1).data.cp_cost == str(cost)
    with pytest.raises(ConfigError, match=re.escape("data.cp_cost: cost model /no/cost.json")):
        validate(load_config(None, [f"data.dataset={built}", "data.cp_cost=/no/cost.json"]), 1)
