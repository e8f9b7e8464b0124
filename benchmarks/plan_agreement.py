"""Does a transformers module plan as its config.json does? For each family in tests/models/hf, plan
the transformers class (captured by recording) and the reference decoder built from the same
config.json, on the same cluster and batch, and compare the layouts and predictions.

    .venv/bin/python benchmarks/plan_agreement.py        (needs the test extra: transformers)

make test checks three of these families (tests/test_capture_hf.py); this runs all fifteen.
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import planner  # noqa: E402
from planner.graph_capture.model_sources import config_from_hf  # noqa: E402
from planner.graph_capture.transformers_models import transformers_model  # noqa: E402

SEQ = 4096
# devices sized to the model so that each plan has a real choice to make
DEVICES = {"llama3.1-405b": 1024, "deepseek-v3": 1024, "qwen3-235b-a22b": 512, "mixtral-8x22b": 256,
           "llama3.1-70b": 256, "gpt-neox-20b": 64, "gemma3-12b": 64, "gemma2-9b": 64}


def main() -> None:
    print("| family | devices | seq | layout (module) | same layout as the config | step s module / config |")
    print("|---|---|---|---|---|---|")
    for path in sorted((ROOT / "tests" / "models" / "hf").glob("*.json")):
        raw = json.loads(path.read_text())
        devices = DEVICES.get(path.stem, 32)
        seq = min(SEQ, raw.get("n_positions") or SEQ)
        kwargs = dict(device="h100-sxm", num_devices=devices, global_batch=4 * devices, seq_len=seq)
        start = time.perf_counter()
        module = planner.plan(transformers_model(raw, name=path.stem), **kwargs)
        config = planner.plan(config_from_hf(raw, path.stem).model_copy(update={"hf_config": None}), **kwargs)
        same = module.to_layout() == config.to_layout()
        lay = module.layout
        text = f"dp{lay.dp} tp{lay.tp} pp{lay.pp} vp{lay.vp} cp{lay.cp} ep{lay.ep} mbs{lay.mbs} zero{lay.zero}"
        print(f"| {path.stem} | {devices} | {seq} | {text} | {'yes' if same else 'no'} | "
              f"{module.step_time_s:.3f} / {config.step_time_s:.3f} ({time.perf_counter() - start:.0f} s) |")


if __name__ == "__main__":
    main()
