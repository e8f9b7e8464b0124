"""The Trainer (runtime/trainer.py) on a model of one's own: the reference decoder in its tiny config, laid out
by --layout, AdamW, a rollback on loss spikes, checkpoints every 2 steps into --checkpoint-dir, the watchdog.
Started again on the same directory (as torchrun does after a failure) it resumes after the last complete
checkpoint. The installed driver with every setting as a flag is `planner-train` (python -m runtime.train).

    torchrun --nproc-per-node 2 examples/train_tiny.py --layout dp=2,zero=1 --steps 6 --checkpoint-dir /tmp/tiny
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.layout_codec import layout_from, parse_text  # noqa: E402
from planner.graph_capture.model_capture import capture  # noqa: E402
from planner.graph_capture.model_sources import resolve_model  # noqa: E402
from planner.graph_capture.reference_model import build_model  # noqa: E402
from runtime import (Cadence, HealthPolicy, Trainer, TrainerConfig, Watchdog, apply_plan,  # noqa: E402
                     end_distributed, init_distributed)

SEQ, GLOBAL_BATCH = 32, 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="dp=1,zero=0")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpoint-dir", required=True)
    args = parser.parse_args()
    init_distributed("cpu")   # torchrun's ranks, or one process as a one-rank group
    source = resolve_model("tiny-llama")
    torch.manual_seed(0)
    model, graph = build_model(source, "cpu", torch.float32), capture(source, SEQ)
    layout = layout_from(parse_text(args.layout, "--layout"), global_batch=GLOBAL_BATCH)
    parallel = apply_plan(model, graph, layout, "cpu", optimizer="adamw", lr=1e-3, precision="fp32",
                          health=HealthPolicy(on_spike="rollback"))

    def batches(step: int):   # the step's global batch, the same on every rank
        data = torch.randint(0, graph.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        return data[:, :-1], data[:, 1:]

    config = TrainerConfig(steps=args.steps, checkpoint_dir=args.checkpoint_dir, cadence=Cadence(2))
    code = Trainer(parallel, batches, config, Watchdog(300.0, args.checkpoint_dir)).fit()
    del parallel, model   # the layout's state goes while its groups still exist
    end_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
