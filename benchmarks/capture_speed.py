"""Capture and analysis time per model (whole capture: build on meta, trace, measure each layer kind).

    .venv/bin/python benchmarks/capture_speed.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.capture.model_capture import _capture_cached, capture  # noqa: E402
from planner.capture.model_config import ModelConfig  # noqa: E402

MODELS = ["llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x22b", "qwen3-235b-a22b", "deepseek-v3"]


def width_series():
    """Same depth, growing width: capture time should stay flat (meta tensors hold no data)."""
    for hidden in (1024, 4096, 16384, 65536):
        yield ModelConfig(name=f"width-{hidden}", num_layers=32, hidden_size=hidden, num_attention_heads=64,
                          num_query_groups=8, ffn_hidden_size=4 * hidden, vocab_size=128256, seq_length=8192)


def main() -> None:
    capture("tiny-llama")  # import and first-dispatch costs out of the measurements
    print("| model | parameters | capture s |")
    print("|---|---|---|")
    for name in MODELS + list(width_series()):
        _capture_cached.cache_clear()
        start = time.perf_counter()
        graph = capture(name)
        elapsed = time.perf_counter() - start
        print(f"| {graph.name} | {graph.total_params / 1e9:.1f} B | {elapsed:.2f} |")


if __name__ == "__main__":
    main()
