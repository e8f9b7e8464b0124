"""Published training runs (shared/validation/published_runs.yaml) as model, cluster and layout inputs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from cost_models.layout import Layout, Recompute
from hardware_profiles.loader import cluster_from_device, list_devices
from hardware_profiles.schema import Cluster

from .model_config import MLAConfig, ModelConfig, MoEConfig

DEFAULT_RUNS = Path(__file__).resolve().parents[1].parent / "shared" / "validation" / "published_runs.yaml"
LAYOUT_FIELDS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "vp": "vp", "micro_batch": "mbs"}


@dataclass(frozen=True)
class PublishedRun:
    id: str
    model: ModelConfig
    cluster: Cluster
    global_batch: int
    seq_len: int
    known: dict                 # layout fields the source gives (planner.plan pins)
    measured_step_s: float
    measured_field: str         # which measurement the step time comes from
    evidence: str
    flops_convention: str


def _model(run: dict) -> ModelConfig:
    m = run["model"]
    activation = m.get("activation") or "gelu"
    gpt = activation == "gelu"
    year = run["id"].split("-")[0]
    moe = m.get("moe")
    mla = m.get("mla")
    heads = m["num_attention_heads"]
    return ModelConfig(
        name=run["id"], num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=heads,
        num_query_groups=m.get("num_query_groups") or heads, head_dim=m.get("head_dim"),
        ffn_hidden_size=m.get("ffn_hidden_size") or 4 * m["hidden_size"], vocab_size=m.get("vocab_size") or 51200,
        seq_length=m["seq_length"], activation=activation, normalization="layernorm" if gpt else "rmsnorm",
        position_embedding="learned" if gpt else "rope",
        tied_embeddings=gpt if m.get("tied_embeddings") is None else bool(m["tied_embeddings"]),
        attention="mla" if mla else ("mha" if (m.get("num_query_groups") or heads) == heads else "gqa"),
        # Megatron-LM of 2021-2022 materialised the attention matrix; later stacks run flash attention
        attention_impl="math" if year in ("narayanan21", "korthikanti22") else "flash",
        add_bias=gpt, mla=MLAConfig(**mla) if mla else None,
        moe=MoEConfig(**{k: v for k, v in moe.items() if v is not None}) if moe else None)


def _step_time(run: dict, gbs: int, seq: int) -> tuple[float | None, str]:
    measured = run["measured"]
    if measured.get("step_time_s"):
        return float(measured["step_time_s"]), "step_time_s"
    per_device = measured.get("tokens_per_s_per_device")
    if per_device:
        return gbs * seq / (per_device * run["hardware"]["num_devices"]), "tokens_per_s_per_device"
    return None, ""


def load_runs(path: Path | str = DEFAULT_RUNS) -> tuple[list[PublishedRun], list[tuple[str, str]]]:
    """Runs that can be predicted, and (id, why not) for the rest."""
    runs, skipped = [], []
    for run in yaml.safe_load(Path(path).read_text()):
        layout, hardware = run["layout"], run["hardware"]
        gbs = layout.get("global_batch")
        if not gbs:
            skipped.append((run["id"], "no global batch"))
            continue
        if hardware["device"] not in list_devices():
            skipped.append((run["id"], f"device {hardware['device']} has no profile"))
            continue
        seq = run["model"]["seq_length"]
        step, field = _step_time(run, gbs, seq)
        if step is None:
            skipped.append((run["id"], "no measured step time or throughput"))
            continue
        try:
            model = _model(run)
        except Exception as exc:  # an incomplete model row
            skipped.append((run["id"], f"model incomplete: {str(exc).splitlines()[0]}"))
            continue
        known = {key: layout[src] for src, key in LAYOUT_FIELDS.items() if layout.get(src) is not None}
        if layout.get("recompute"):
            known["recompute"] = layout["recompute"]
        if isinstance(layout.get("zero"), int):
            known["zero"] = layout["zero"]
        if layout.get("sequence_parallel") is not None:
            known["sp"] = bool(layout["sequence_parallel"])
        cluster = cluster_from_device(hardware["device"], hardware["num_devices"], hardware.get("devices_per_node"))
        runs.append(PublishedRun(run["id"], model, cluster, gbs, seq, known, step, field, run.get("evidence", ""),
                                 run["measured"].get("flops_convention", "")))
    return runs, skipped


def published_layout(run: PublishedRun, precision: str) -> Layout | None:
    """The run's layout when the source gives every degree (zero and recompute default to Megatron's)."""
    need = ("tp", "pp", "dp", "cp")
    if not all(k in run.known for k in need) or "mbs" not in run.known:
        return None
    known = run.known
    return Layout(dp=known["dp"], tp=known["tp"], pp=known["pp"], vp=known.get("vp", 1), cp=known["cp"],
                  ep=known.get("ep", 1), micro_batch=known["mbs"], global_batch=run.global_batch,
                  zero=known.get("zero", 1), sequence_parallel=known.get("sp", True),
                  recompute=Recompute(known.get("recompute", "none")), precision=precision)
