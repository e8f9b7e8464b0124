"""Capture time per model: built-in configs (the reference decoder) and transformers' own classes.

    .venv/bin/python benchmarks/capture_speed.py

Whole capture: build on meta, trace or record, measure each distinct layer kind once. The transformers
rows (needs the test extra) build the class from tests/models/hf/<name>.json with
AutoModelForCausalLM.from_config on meta, then capture the module; build and capture are timed apart,
wall and CPU seconds, at 4,096 tokens.
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.graph_capture.model_capture import _capture_cached, capture  # noqa: E402
from planner.graph_capture.model_config import ModelConfig  # noqa: E402
from planner.graph_capture.transformers_models import transformers_model  # noqa: E402

MODELS = ["llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x22b", "qwen3-235b-a22b", "deepseek-v3"]
HF_MODELS = ["llama3.1-8b", "llama3.1-405b", "mixtral-8x22b", "qwen3-235b-a22b", "deepseek-v3", "gemma3-12b"]
HF_SEQ = 4096


def width_series():
    """Same depth, growing width: capture time should stay flat (meta tensors hold no data)."""
    for hidden in (1024, 4096, 16384, 65536):
        yield ModelConfig(name=f"width-{hidden}", num_layers=32, hidden_size=hidden, num_attention_heads=64,
                          num_query_groups=8, ffn_hidden_size=4 * hidden, vocab_size=128256, seq_length=8192)


def timed(function):
    wall, cpu = time.perf_counter(), time.process_time()
    result = function()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def hf_module(name: str):
    raw = json.loads((ROOT / "tests" / "models" / "hf" / f"{name}.json").read_text())
    return transformers_model(raw, name=name)


def main() -> None:
    capture("tiny-llama")  # import and first-dispatch costs out of the measurements
    print("| model | parameters | capture s (wall) | CPU s |")
    print("|---|---|---|---|")
    for name in MODELS + list(width_series()):
        _capture_cached.cache_clear()
        graph, wall, cpu = timed(lambda: capture(name))
        print(f"| {graph.name} | {graph.total_params / 1e9:.1f} B | {wall:.2f} | {cpu:.2f} |")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("\ntransformers is not installed: no transformers rows (pip install -e '.[test]')")
        return
    print("\n| transformers class | parameters | build s | capture s (wall) | CPU s | front end |")
    print("|---|---|---|---|---|---|")
    for name in HF_MODELS:
        module, build_s, _ = timed(lambda: hf_module(name))
        graph, wall, cpu = timed(lambda: capture(module, seq_len=HF_SEQ))
        print(f"| {type(module).__name__} ({name}) | {graph.total_params / 1e9:.1f} B | {build_s:.2f} | "
              f"{wall:.2f} | {cpu:.2f} | {graph.front_end} |")


if __name__ == "__main__":
    main()
