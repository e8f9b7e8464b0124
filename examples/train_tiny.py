"""The runtime's training driver run from a checkout (installed: `python -m runtime.train` or `planner-train`).

    torchrun --nproc-per-node 8 examples/train_tiny.py --model tiny-llama --plan plan.yaml
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
