"""Write the GPT configurations of shared/validation/published_runs.yaml as built-in model YAMLs
(planner/models/<name>.yaml), one per distinct configuration, named after its first run.

    .venv/bin/python benchmarks/published_models.py
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from planner.graph_capture.model_sources import MODEL_DIR  # noqa: E402
from benchmarks.published import DEFAULT_RUNS, _model  # noqa: E402

FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
          "seq_length", "activation", "normalization", "position_embedding", "tied_embeddings", "attention",
          "add_bias")   # not attention_impl: the stack decides how a config's attention runs


def main() -> None:
    seen = set()
    for run in yaml.safe_load(Path(DEFAULT_RUNS).read_text()):
        if (run["model"].get("activation") or "gelu") != "gelu" or run["model"].get("moe"):
            continue
        try:
            config = _model(run)
        except Exception:  # incomplete rows are skipped, as by benchmarks/accuracy.py
            continue
        key = tuple(getattr(config, f) for f in FIELDS)
        if key in seen:
            continue
        seen.add(key)
        name = re.sub(r"-(selective|full|\d+gpu)$", "", re.sub(r"-(selective|full)$", "", run["id"]))
        name = re.sub(r"-\d+gpu$", "", name)
        data = {"name": name, **{f: getattr(config, f) for f in FIELDS},
                **({"dropout": config.dropout} if "dropout" in config.model_fields_set else {})}
        header = f"# {run['model']['name']}: from shared/validation/published_runs.yaml run {run['id']} ({run['source'][:80]}...)\n"
        (MODEL_DIR / f"{name}.yaml").write_text(header + yaml.safe_dump(data, sort_keys=False))
        print(name)


if __name__ == "__main__":
    main()
