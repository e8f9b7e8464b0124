"""Every class of bad input, generated: hypothesis draws many instances of each class (not the ones once found),
and every one must end as cli_runner.check says: exit 0 or 2 with one paragraph naming the file or field, never
a traceback, within 10 s.

Classes: nesting depth (YAML flow and block, JSON), YAML aliases that expand past any real input, special files
(FIFO, device, directory) where a data file is read, extreme but finite numbers in every numeric field of a device
and a cluster profile (reaching the solver), and recovery settings, counts and --top values out of range.
"""
import json
import re
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cli_runner import check, run

pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[1]
DEVICE = yaml.safe_load((ROOT / "hardware_profiles/devices/h100-sxm.yaml").read_text())
CLUSTER = yaml.safe_load((ROOT / "hardware_profiles/clusters/dgx-h100.yaml").read_text())
TINY_JOB = ["--num-devices", "8", "--global-batch", "16", "--time-limit", "5"]
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# where a data file is read, and the command that reads it
PLACES = ("device", "model-yaml", "config-json", "plan-file", "cluster")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    base = tmp_path_factory.mktemp("classes")
    assert run(["plan", "--model", "tiny-llama", "--device", "h100-sxm", *TINY_JOB, "--out",
                str(base / "good-plan.yaml")]).code == 0
    return base


def command_reading(place: str, path: Path) -> list[str]:
    if place == "device":
        return ["plan", "--model", "tiny-llama", "--device", str(path), *TINY_JOB]
    if place == "cluster":
        return ["plan", "--model", "tiny-llama", "--cluster", str(path), *TINY_JOB]
    if place in ("model-yaml", "config-json"):
        return ["plan", "--model", str(path), "--device", "h100-sxm", "--seq-len", "32", *TINY_JOB]
    return ["export", str(path), "--to", "megatron"]


def suffix(place: str) -> str:
    return ".json" if place == "config-json" else ".yaml"


def nested(depth: int, style: str) -> str:
    if style == "json":
        return "[" * depth + "]" * depth
    if style == "flow":
        return "a: " + "[" * depth + "]" * depth + "\n"
    return "".join("  " * level + "- \n" if level < depth - 1 else "  " * level + "- x\n" for level in range(depth))


@SETTINGS
@given(depth=st.one_of(st.integers(1, 80), st.integers(80, 100_000)), style=st.sampled_from(["json", "flow", "block"]),
       place=st.sampled_from(PLACES))
def test_nesting_of_any_depth_is_refused_in_bounded_time(workdir, depth, style, place):
    path = workdir / f"nested-{place}{suffix(place)}"
    path.write_text(nested(min(depth, 2_000) if style == "block" else depth, "json" if suffix(place) == ".json"
                           else style))
    check(run(command_reading(place, path)), f"{place} {style} depth {depth}", valid=False)


def laughs(levels: int, fanout: int) -> str:
    lines = [f"l0: &l0 [{', '.join(['lol'] * fanout)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fanout)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nname: *l{levels - 1}\n"


@SETTINGS
@given(levels=st.integers(1, 12), fanout=st.integers(1, 16),
       place=st.sampled_from(("device", "model-yaml", "plan-file", "cluster")))
def test_aliases_that_expand_past_any_real_input_are_refused_quickly(workdir, levels, fanout, place):
    path = workdir / f"laughs-{place}.yaml"
    path.write_text(laughs(levels, fanout))
    check(run(command_reading(place, path)), f"{place} {levels} levels x {fanout}", valid=False)


@pytest.fixture(scope="module")
def special_files(workdir):
    fifo = workdir / "a-fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    folder = workdir / "a-folder.yaml"
    folder.mkdir(exist_ok=True)
    telemetry = workdir / "telemetry"
    telemetry.mkdir(exist_ok=True)
    return {"fifo": fifo, "dev-zero": Path("/dev/zero"), "dev-null": Path("/dev/null"), "folder": folder,
            "telemetry": telemetry}


@SETTINGS
@given(kind=st.sampled_from(["fifo", "dev-zero", "dev-null", "folder"]),
       place=st.sampled_from((*PLACES, "telemetry")))
def test_special_files_are_never_read_as_data(special_files, kind, place):
    target = special_files[kind]
    if place == "telemetry":   # a rank's telemetry file that is a link to it
        link = special_files["telemetry"] / "rank-0.jsonl"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        args = ["calibrate", "--telemetry", str(special_files["telemetry"])]
    else:
        link = special_files["folder"].parent / f"{kind}-as-{place}{suffix(place)}"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        args = command_reading(place, link)
    check(run(args), f"{kind} as {place}", valid=False)


def numeric_paths(data, prefix=()):
    """Every numeric leaf of a profile, as a key path."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from numeric_paths(value, (*prefix, key))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield (*prefix, key)


EXTREME = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                    st.integers(-320, 308).map(lambda e: float(f"1e{e}")),
                    st.integers(-(10 ** 30), 10 ** 30))


def replaced(data: dict, path: tuple, value) -> dict:
    data = json.loads(json.dumps(data))
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@SETTINGS
@given(path=st.sampled_from(sorted(numeric_paths(DEVICE), key=str)), value=EXTREME)
# a floor of 10 hours per kernel passed the magnitude check and took every term past the solver's horizon: the
# search ran to its limit and found no plan (or blamed memory, "0.0 GB"); now a unit mistake refused at load
@example(path=("gemm", "kernel_floor_us"), value=37_628_993_021)
def test_extreme_numbers_in_a_device_profile_never_reach_the_solver_unchecked(workdir, path, value):
    device = workdir / "extreme-device.yaml"
    device.write_text(yaml.safe_dump(replaced(DEVICE, path, value)))
    outcome = run(command_reading("device", device))
    check(outcome, f"{'.'.join(path)}={value!r}", valid=None)
    if outcome.code == 2 and "field '" in outcome.err and ".yaml" in outcome.err:
        assert path[-1] in outcome.err, f"{'.'.join(path)}={value!r}: {outcome.err[:300]}"


@SETTINGS
@given(path=st.sampled_from(sorted(p for p in numeric_paths(CLUSTER) if p[0] != "device")), value=EXTREME)
def test_extreme_numbers_in_a_cluster_profile_never_reach_the_solver_unchecked(workdir, path, value):
    cluster = workdir / "extreme-cluster.yaml"
    cluster.write_text(yaml.safe_dump(replaced(CLUSTER, path, value)))
    check(run(["plan", "--model", "tiny-llama", "--cluster", str(cluster), "--global-batch", "16",
               "--time-limit", "5", "--objective", "goodput"]), f"{'.'.join(path)}={value!r}", valid=None)


RECOVERY_VALUES = st.one_of(st.floats(), st.integers(-(10 ** 20), 10 ** 20),
                            st.sampled_from(["yes", "no", "", "x", "auto"]))
RECOVERY_KEYS = ["timeout", "spares", "elastic", "sdc_every", "spikes_per_day", "gemm_every", "sdc_seen", "opt_every",
                 "opt_seen", "opt_share", "t"]


@SETTINGS
@given(items=st.lists(st.tuples(st.sampled_from(RECOVERY_KEYS), RECOVERY_VALUES), min_size=1, max_size=4),
       goodput=st.booleans())
def test_recovery_settings_out_of_range_or_repeated_are_refused(items, goodput):
    text = ",".join(f"{key}={value}" for key, value in items)
    keys = [key for key, _ in items]
    numeric_ok = all(_in_range(key, value) for key, value in items)
    valid = goodput and len(set(keys)) == len(keys) and numeric_ok
    objective = ["--objective", "goodput"] if goodput else []
    check(run(["plan", "--model", "tiny-llama", "--device", "h100-sxm", *TINY_JOB, *objective, "--recovery", text]),
          f"--recovery {text} goodput={goodput}", valid=valid)


def _in_range(key: str, value) -> bool:
    """What parse_recovery's documented limits accept, written out from its EXPECTED text and limits."""
    if key in ("spares", "elastic"):
        return value in ("yes", "no")
    if key in ("gemm_every", "opt_every") and value == "auto":
        return True
    if key == "t" or isinstance(value, str):
        return False
    if key in ("sdc_every", "gemm_every", "opt_every") and not isinstance(value, int):
        return False
    if key in ("sdc_seen", "opt_seen"):
        return 0 < value <= 1   # a chance: none at all would never find anything
    limit = {"timeout": 86_400, "sdc_every": 1_000_000, "spikes_per_day": 86_400, "gemm_every": 1_000_000,
             "opt_every": 1_000_000, "opt_share": 1}[key]
    return 0 <= value <= limit   # nan compares false


@SETTINGS
@given(flag=st.sampled_from(["--num-devices", "--global-batch", "--seq-len", "--top", "--devices-per-node"]),
       value=st.integers(-(10 ** 40), 10 ** 40))
def test_counts_of_any_size_are_refused_or_planned_in_bounded_time(flag, value):
    args = ["plan", "--model", "tiny-llama", "--device", "h100-sxm", *TINY_JOB]
    if flag in args:
        args[args.index(flag) + 1] = str(value)
    else:
        args += [flag, str(value)]
    outcome = run(args)
    check(outcome, f"{flag} {value}", valid=None)
    if value <= 0 and flag != "--top":
        assert outcome.code == 2, f"{flag} {value} accepted"


FAMILY_BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
               "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}
FAMILY_EXTRA = {   # what each family's config.json adds to the base
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
    "gemma3_text": {"sliding_window": 16, "sliding_window_pattern": 2, "head_dim": 16},
    "gpt2": {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 64},
    "llama": {}, "gpt_neox": {}, "phi3": {"pad_token_id": 0}, "gemma2": {"attn_logit_softcapping": 50.0, "sliding_window": 16},
}
BAD_VALUES = st.one_of(st.none(), st.sampled_from(["x", "", "8", True, False, [], {}]), st.integers(-(10 ** 12), 10 ** 12),
                       st.floats(allow_nan=False))


@SETTINGS
@given(family=st.sampled_from(sorted(FAMILY_EXTRA)), data=st.data())
def test_config_json_of_every_family_with_keys_missing_or_wrong_names_the_key(workdir, family, data):
    config = {"model_type": family, **FAMILY_BASE, **FAMILY_EXTRA[family]}
    keys = sorted(k for k in config if k != "model_type")
    dropped = data.draw(st.lists(st.sampled_from(keys), max_size=3, unique=True), label="dropped")
    changed = data.draw(st.dictionaries(st.sampled_from(keys), BAD_VALUES, max_size=2), label="changed")
    for key in dropped:
        config.pop(key)
    config.update(changed)
    path = workdir / f"family-{family}.json"
    path.write_text(json.dumps(config))
    outcome = run(command_reading("config-json", path))
    check(outcome, f"{family} without {dropped} with {changed}", valid=None)
    if outcome.code == 2 and "field '" in outcome.err:   # a field named is a config.json key (written or to write),
        named = outcome.err.split("field '", 1)[1].split("'", 1)[0]   # never one of the reader's own fields
        assert named in config or named in dropped or named in ("(top level)", "model_type", "name", "config.json"), \
            outcome.err[:400]


def test_transformers_own_deepseek_v2_defaults_name_the_missing_top_k(workdir):
    """transformers' DeepseekV2Config() has 64 routed experts and num_experts_per_tok null: the reader must not
    assume a top-k (it took 2), and the error names the config.json key, not a module of the captured graph."""
    transformers = pytest.importorskip("transformers")
    path = workdir / "deepseek-v2-defaults.json"
    path.write_text(json.dumps(transformers.DeepseekV2Config().to_dict()))
    outcome = run(command_reading("config-json", path))
    check(outcome, "DeepseekV2Config defaults", valid=False)
    assert f"{path}: field 'num_experts_per_tok'" in " ".join(outcome.err.split()), outcome.err[:400]
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "num_experts_per_tok": 6, "num_hidden_layers": 2}))
    check(run(command_reading("config-json", path)), "DeepseekV2Config with its top-k", valid=True)


@SETTINGS
@given(kind=st.sampled_from(["fifo", "folder", "link"]), command=st.sampled_from(["plan", "calibrate"]))
def test_outputs_are_never_special_files_or_links(special_files, kind, command):
    target = {"fifo": special_files["fifo"], "folder": special_files["folder"]}.get(kind)
    if kind == "link":
        target = special_files["folder"].parent / "out-link.yaml"
        target.unlink(missing_ok=True)
        target.symlink_to(special_files["folder"].parent / "elsewhere.yaml")
    args = ["plan", "--model", "tiny-llama", "--device", "h100-sxm", *TINY_JOB, "--out", str(target)] \
        if command == "plan" else ["calibrate", "--telemetry", str(special_files["telemetry"]), "--out", str(target)]
    check(run(args), f"{command} --out {kind}", valid=False)
    assert not (special_files["folder"].parent / "elsewhere.yaml").exists()


@pytest.fixture(scope="module")
def good_plan(workdir):
    return yaml.safe_load((workdir / "good-plan.yaml").read_text())


MODULE_TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["--output=/tmp/x", "$(touch owned)", "a b", "layers.0;",
                                                                "-x", "layers..1", "", "layers.3"]))


@SETTINGS
@given(name=MODULE_TEXT, target=st.sampled_from(["megatron", "torchtitan", "deepspeed", "torchrun", "sbatch"]))
def test_hand_edited_stage_module_names_never_reach_an_exported_command(workdir, good_plan, name, target):
    data = json.loads(json.dumps(good_plan))
    data["stages"][0]["modules"] = [name, *data["stages"][0]["modules"][1:]]
    path = workdir / "edited-plan.yaml"
    path.write_text(yaml.safe_dump(data))
    plain = bool(re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$", name))
    outcome = run(["export", str(path), "--to", target])
    check(outcome, f"module {name!r} to {target}", valid=plain)


@pytest.fixture(scope="module")
def moe_plan(workdir):
    """A MoE plan whose experts spread over two H100 nodes, dispatched DeepEP-style as the search chose."""
    path = workdir / "moe-plan.yaml"
    assert run(["plan", "--model", "qwen3-30b-a3b", "--device", "h100-sxm", "--num-devices", "16", "--global-batch",
                "64", "--fix", "tp=1,pp=1,cp=1,ep=16,a2a_overlap=false", "--out", str(path)]).code == 0
    data = yaml.safe_load(path.read_text())
    assert data["layout"]["moe_dispatcher"] == "deepep" and data["layout"]["flex_dispatcher_backend"] == "deepep"
    return data


# hand edits of a plan's dispatcher fields, and whether Megatron-Core (and the device) could run what they say
DISPATCHER_EDITS = [
    ({"moe_dispatcher": "alltoall", "flex_dispatcher_backend": None}, True),
    ({"moe_dispatcher": "allgather", "flex_dispatcher_backend": None}, True),
    ({"moe_dispatcher": "allgather", "moe_a2a_overlap": True}, False),   # TransformerConfig refuses it
    ({"moe_dispatcher": "nccl"}, False),
    ({"moe_dispatcher": ["deepep"]}, False),
    ({"flex_dispatcher_backend": "nvshmem"}, False),
    ({"moe_dispatcher": 3}, False),
    # TP overlap where there are no TP collectives, as text, and beside combined 1F1B where H100 runs one of them
    ({"tp_comm_overlap": True}, False),
    ({"tp_comm_overlap": "true"}, False),
    ({"tp": 2, "dp": 8, "sp": True, "tp_comm_overlap": True, "moe_a2a_overlap": True}, False),
    # activation offloading beside the plan's selective recomputation (TransformerConfig refuses it), of every
    # layer, negative, as text
    ({"offload_layers": 4}, False),
    ({"offload_layers": 48}, False),
    ({"offload_layers": -1}, False),
    ({"offload_layers": "4"}, False),
]


@SETTINGS
@given(edit=st.sampled_from(DISPATCHER_EDITS), target=st.sampled_from(["megatron", "torchtitan", "torchrun"]))
def test_hand_edited_dispatcher_fields_are_exported_as_megatron_runs_them_or_refused(workdir, moe_plan, edit, target):
    """A plan file's dispatcher, overlap and flex backend as a person might edit them: what Megatron-Core runs
    exports, anything else exits 2 with one paragraph."""
    changes, valid = edit
    data = json.loads(json.dumps(moe_plan))
    data["layout"].update(changes)
    path = workdir / "edited-moe-plan.yaml"
    path.write_text(yaml.safe_dump(data))
    outcome = run(["export", str(path), "--to", target])
    check(outcome, f"{changes} to {target}", valid=valid)


def test_a_deepep_plan_on_a_device_without_its_kernels_is_refused(workdir, moe_plan):
    """The same plan moved by hand onto a device whose profile names no DeepEP-style kernels (MI300X):
    refused, naming the dispatcher."""
    data = json.loads(json.dumps(moe_plan))
    data["device_profile"] = "mi300x"
    path = workdir / "mi300x-plan.yaml"
    path.write_text(yaml.safe_dump(data))
    outcome = run(["export", str(path), "--to", "megatron"])
    check(outcome, "deepep on a device without flex kernels", valid=False)
    assert "dispatcher=deepep on mi300x" in outcome.err
