"""How sure a prediction is: the band of measured step times the plan's prediction is consistent with, from the
held-out residuals of published runs like it (planner/error_bands.yaml, written by benchmarks/error_bands.py:
fitted on one half of shared/validation, its coverage counted on the other)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hardware_profiles.parsing import parse_yaml, read_bounded_text

BANDS_PATH = Path(__file__).resolve().parent / "error_bands.yaml"


@dataclass(frozen=True)
class ErrorBand:
    kind: str                 # dense or MoE: the runs it was fitted on
    low: float                # residual (predicted / measured - 1) at the split-conformal 90% band's low end
    high: float               # and at its high end (benchmarks/error_bands.py `band`)
    fitted_runs: int
    held_out_covered: int
    held_out_runs: int
    pooled: bool = False      # fitted on every class's runs: too few of its own

    def measured_s(self, predicted_s: float) -> tuple[float, float]:
        """The measured step times the prediction is consistent with: predicted / (1 + high) .. / (1 + low)."""
        return predicted_s / (1 + self.high), predicted_s / (1 + self.low)

    def words(self) -> str:
        fitted = f"{self.fitted_runs} fitted, every class pooled: too few {self.kind} runs" if self.pooled else \
            f"{self.fitted_runs} fitted"
        return (f"{self.kind} runs' 90% conformal band of residuals {self.low:+.0%}..{self.high:+.0%} ({fitted}; "
                f"{self.held_out_covered} of {self.held_out_runs} held-out {self.kind} runs inside)")


@lru_cache(maxsize=1)
def _bands() -> dict:
    return parse_yaml(read_bounded_text(BANDS_PATH, "error-band table", 1 << 16), str(BANDS_PATH)) or {}


def band_for(moe: bool) -> ErrorBand | None:
    """The band of the class a model belongs to; None where no table was written."""
    kind = "MoE" if moe else "dense"
    entry = _bands().get(kind) if BANDS_PATH.exists() else None
    if not entry:
        return None
    return ErrorBand(kind, entry["low"], entry["high"], entry["fitted_runs"], entry["held_out_covered"],
                     entry["held_out_runs"], bool(entry.get("pooled", False)))
