"""Bad input, generated: a seeded fuzz suite over every input the CLI and the API take.

Each case is built from a valid input with one change drawn from a pool whose validity is known, or from
free-form text whose validity is not; for every case the command must end with exit 0 (valid) or 2 (one
paragraph naming the file or field), never a traceback or another status, and within 10 s. Known-invalid
changes must exit 2 and known-valid ones 0.
"""
import json
import random
import shlex
import time
from pathlib import Path

import pytest
import yaml

from cli_runner import CASE_LIMIT_S, check, run_cli
from hardware_profiles import UserInputError
from planner import api

pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[1]
SEED = 20261201
TINY = ["--model", "tiny-llama", "--device", "h100-sxm", "--num-devices", "8", "--global-batch", "16"]

BAD_INTS = [0, -1, -8, 10 ** 15, 1.5, "x", "", True, None, [], {}, "1e3", float("nan")]
BAD_TEXT = ["", " ", "banana", "x" * 5000, "nan", "-1", "1e400", "a,b=c", "../../etc/passwd", "$(touch owned)",
            "tp=2;rm", "\x00", "é"]
FLAG_VALUES = {
    "--num-devices": (["8", "16"], ["0", "-8", "abc", "9" * 40, "1.5", "nan", ""]),
    "--global-batch": (["16", "32"], ["0", "-1", "abc", "9" * 40, "2.5"]),
    "--seq-len": (["32", "64"], ["0", "-3", "abc", "99999999999", "1.5"]),
    "--precision": (["bf16", "fp8"], ["", "fp64", "BF16", "fp8 "]),
    "--time-limit": (["5", "30"], ["nan", "-5", "inf", "abc"]),
    "--devices-per-node": (["4", "8"], ["0", "-1", "3", "abc"]),
    "--top": (["1", "3"], ["abc"]),
    "--objective": (["step-time", "goodput"], ["speed", ""]),
    "--stack": (["megatron-core", "torchtitan", "mindspeed"], ["", "megatron", "no/such.yaml"]),
}
LAYOUT_KEYS = ["dp", "tp", "pp", "vp", "cp", "ep", "etp", "mbs", "gbs", "zero", "recompute", "sp", "precision",
               "grad_reduce", "fp8_recipe", "order", "schedule", "tq", ""]
LAYOUT_VALUES = ["1", "2", "4", "8", "0", "-1", "3", "1.5", "x", "", "none", "full", "selective", "bf16", "fp8",
                 "true", "false", "tp-cp-ep-dp-pp", "tp-pp", "9" * 30, "delayed", "tensorwise", "dualpipev", "1f1b",
                 "interleaved-1f1b"]


def mutate(data: dict, rng: random.Random, pool) -> tuple[dict, str]:
    """One field (possibly nested) replaced by a value from `pool`, or removed."""
    data = json.loads(json.dumps(data))
    target, path = data, []
    while True:
        key = rng.choice(sorted(target))
        path.append(key)
        if isinstance(target[key], dict) and rng.random() < 0.7:
            target = target[key]
            continue
        break
    value = rng.choice(pool + ["<delete>"])
    if value == "<delete>":
        del target[key]
    else:
        target[key] = value
    return data, f"{'.'.join(path)}={value!r}"[:80]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    plan_path = base / "plan.yaml"
    api.plan("tiny-llama", device="h100-sxm", num_devices=8, global_batch=16).save(plan_path)
    return {
        "dir": base,
        "plan": yaml.safe_load(plan_path.read_text()),
        "model": yaml.safe_load((ROOT / "planner/models/tiny-llama.yaml").read_text()),
        "cluster": yaml.safe_load((ROOT / "hardware_profiles/clusters/dgx-h100.yaml").read_text()),
        "device": yaml.safe_load((ROOT / "hardware_profiles/devices/h100-sxm.yaml").read_text()),
        "hf": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64},
    }


def cases(rng: random.Random, inputs: dict):
    """(description, argv, known validity or None) for every class of input."""
    base = inputs["dir"]
    for i in range(200):   # CLI flags: one flag changed at a time
        flag = rng.choice(sorted(FLAG_VALUES))
        good, bad = FLAG_VALUES[flag]
        valid = rng.random() < 0.3
        value = rng.choice(good if valid else bad)
        args = [a for a in TINY]
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
        if flag == "--devices-per-node" and valid:
            valid = None   # fine on its own; with 8 devices on nodes of 4 or 8
        if flag == "--precision" and value == "fp8":
            valid = True
        yield f"flag {flag} {value!r}", ["plan", *args], valid
    for i in range(300):   # layout text
        items = [f"{rng.choice(LAYOUT_KEYS)}={rng.choice(LAYOUT_VALUES)}" for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.1:
            items.append(rng.choice(BAD_TEXT))
        text = ",".join(items)
        stack = ["--stack", "torchtitan"] if rng.random() < 0.3 else []   # it has DualPipeV
        yield f"layout {text[:60]!r}", [rng.choice(["plan", "evaluate"]), *TINY, *stack,
                                         "--fix" if rng.random() < 0.5 else "--layout", text], None
    for name, key, pool, writer in (("model", "model", BAD_INTS + BAD_TEXT, "yaml"),
                                    ("hf", "hf", BAD_INTS + BAD_TEXT + [False], "json"),
                                    ("cluster", "cluster", BAD_INTS + BAD_TEXT, "yaml"),
                                    ("device", "device", BAD_INTS + BAD_TEXT, "yaml")):
        for i in range(80):   # input files: one field changed or removed
            data, change = mutate(inputs[key], rng, pool)
            path = base / f"{name}-{i}.{'json' if writer == 'json' else 'yaml'}"
            if name == "device":
                cluster = dict(inputs["cluster"], device=path.name, name="fuzz-cluster")
                path.write_text(yaml.safe_dump(data))
                target = base / f"cluster-for-{i}.yaml"
                target.write_text(yaml.safe_dump(cluster))
                args = ["plan", "--model", "tiny-llama", "--cluster", str(target), "--num-devices", "8",
                        "--global-batch", "16"]
            else:
                path.write_text(json.dumps(data) if writer == "json" else yaml.safe_dump(data))
                args = (["plan", "--model", "tiny-llama", "--cluster", str(path), "--num-devices", "8",
                         "--global-batch", "16"] if name == "cluster" else
                        ["plan", "--model", str(path), "--device", "h100-sxm", "--num-devices", "8",
                         "--global-batch", "16", "--seq-len", "32"])
            yield f"{name} {change}", args, None
    for i in range(120):   # plan files given to export
        data, change = mutate(inputs["plan"], rng, BAD_INTS + BAD_TEXT)
        path = base / f"plan-{i}.yaml"
        path.write_text(yaml.safe_dump(data))
        yield f"plan file {change}", ["export", str(path), "--to", rng.choice(["megatron", "torchtitan",
                                                                              "deepspeed", "torchrun"])], None
    raw = ["", "{", "[1, 2]", "x: [", "\x00\x01", "- - -", "a: b: c", "null", "42", "'just text'"]
    for i, text in enumerate(raw):   # files that are not the structure they should be
        for suffix, command in ((".yaml", "plan-model"), (".json", "plan-model"), (".yaml", "export")):
            path = base / f"raw-{i}{suffix}"
            path.write_text(text)
            args = ["export", str(path), "--to", "megatron"] if command == "export" else \
                ["plan", "--model", str(path), "--device", "h100-sxm", "--num-devices", "8", "--global-batch", "16"]
            yield f"raw {command} {text!r}", args, False
    sources = ["raise RuntimeError('boom')", "def build():\n    raise ValueError('no')\n",
               "def build():\n    return 42\n", "import sys\nsys.exit(3)\n", "def build(:\n",
               "import not_a_module_anywhere\n", "build = 5\n", "def build():\n    import sys; sys.exit(0)\n",
               "def other():\n    pass\n"]
    for i, source in enumerate(sources):   # user factories that fail
        path = base / f"factory{i}.py"
        path.write_text(source)
        yield f"factory {source[:30]!r}", ["plan", "--model", f"{path}:build", "--seq-len", "32", "--device",
                                           "h100-sxm", "--num-devices", "8", "--global-batch", "16"], False
    for i in range(60):   # what-if sweeps and token budgets
        key = rng.choice(["num-devices", "device", "seq-len", "global-batch", "inter-node-bandwidth-gbps", "speed", ""])
        values = ",".join(rng.choice(["8", "16", "0", "-8", "x", "", "h100-sxm", "9" * 30, "1.5"])
                          for _ in range(rng.randint(0, 3)))
        tokens = rng.choice(["1T", "15T", "nan", "inf", "-1T", "0", "1e400", "T", "5"])
        yield f"whatif {key}={values} tokens={tokens}", ["whatif", "--model", "tiny-llama", "--device", "h100-sxm",
                                                         "--num-devices", "8", "--global-batch", "16", "--sweep",
                                                         f"{key}={values}", "--tokens", tokens,
                                                         "--time-limit", "5"], None
    (base / "adir").mkdir(exist_ok=True)
    (base / "afile.yaml").write_text("")
    (base / "link.yaml").unlink(missing_ok=True)
    (base / "link.yaml").symlink_to(base / "afile.yaml")
    for out in [str(base / "adir"), str(base / "new") + "/", str(base / "plan.txt"), str(base / "link.yaml"),
                str(base / "missing" / "deeper" / "p.yaml"), "/proc/nope.yaml", ""]:
        yield f"--out {out!r}", ["plan", *TINY, "--out", out], False
    for out in [str(base / "afile.yaml"), str(base / "link.yaml")]:
        yield f"whatif --out {out!r}", ["whatif", "--model", "tiny-llama", "--device", "h100-sxm", "--sweep",
                                        "num-devices=8", "--global-batch", "16", "--out", out], False


def test_cli_never_crashes_hangs_or_accepts_silently(inputs, capsys, monkeypatch):
    rng = random.Random(SEED)
    seen = 0
    for case, args, valid in cases(rng, inputs):
        check(run_cli(args, capsys, monkeypatch), f"{case} :: {shlex.join(args)[:200]}", valid)
        seen += 1
    assert seen >= 1000


API_VALUES = BAD_INTS + BAD_TEXT + [1, 2, 4, 8, "full", "none", "fp8", ("tp", "cp"), "dualpipev", "1f1b"]


def test_api_raises_only_user_input_errors():
    """The API's bad input raises UserInputError, never KeyError, TypeError or ZeroDivisionError."""
    rng = random.Random(SEED + 1)
    keys = ["dp", "tp", "pp", "vp", "cp", "ep", "etp", "mbs", "zero", "recompute", "sp", "precision", "order",
            "grad_reduce", "fp8_recipe", "gbs", "schedule", "tq"]
    for _ in range(300):
        kwargs = {rng.choice(keys): rng.choice(API_VALUES) for _ in range(rng.randint(1, 3))}
        shape = dict(device="h100-sxm", num_devices=rng.choice([8, 8, 8, 0, -1, 1.5, "8"]),
                     global_batch=rng.choice([16, 16, 16, 0, -4, 2.5, "16", True]),
                     seq_len=rng.choice([None, None, 32, 0, 1.5]), time_limit_s=rng.choice([5.0, 5.0, -1.0, float("nan")]))
        started = time.perf_counter()
        try:
            if rng.random() < 0.5:
                api.plan("tiny-llama", **shape, **kwargs)
            else:
                api.evaluate("tiny-llama", layout=kwargs, **shape)
        except UserInputError:
            pass
        assert time.perf_counter() - started < CASE_LIMIT_S, kwargs
