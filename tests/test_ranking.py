"""The ranking measure (benchmarks/ranking.py): the planner orders a job's layouts as published sweeps measured."""
import pytest
import yaml

from benchmarks.ranking import SWEEPS, Sweep, Variant, published_sweeps


def test_agreement_and_regret_count_as_defined():
    """Three variants measured 1 < 2 < 3 s and predicted in the order b, a, c: of the three pairs only (a, b) is
    reversed; the variant predicted fastest (b) ran 2 s against the fastest's 1 s: regret +100%. A predicted
    tie agrees with neither order."""
    sweep = Sweep("s", "t", (Variant("a", 1.0, 2.0), Variant("b", 2.0, 1.0), Variant("c", 3.0, 3.0)))
    assert sweep.agreeing() == 2 and len(sweep.pairs) == 3
    assert sweep.top1_regret() == pytest.approx(1.0)
    assert Sweep("s", "t", (Variant("a", 1.0, 2.0), Variant("b", 2.0, 2.0))).agreeing() == 0


# sweeps the model orders wrong (docs/ranking.md): Megatron-Bridge's FP8-CS runs with Megatron FSDP against FP8-MX
# ones with tensor and pipeline parallelism, which NVIDIA measured 4-26% slower and the model predicts within 2%
# or faster; strict, so that a model that gets them right says so
# their Megatron FSDP variants ran with activations offloaded to the Grace CPU (cpu_offloading_num_layers), which
# the planner does not model: it recomputes layers to fit them instead (benchmarks/sweeps.yaml)
MISORDERED = {"Llama 3 70B, 64 GB200, Megatron-Bridge 26.02", "Llama 3 70B, 64 GB200, Megatron-Bridge 25.09",
              "Llama 3.1 405B, 128 GB200, Megatron-Bridge 25.09"}
SWEEP_NAMES = [entry["name"] for entry in yaml.safe_load(SWEEPS.read_text())]


@pytest.fixture(scope="module")
def predicted_sweeps():
    return {sweep.name: sweep for sweep in published_sweeps()}


@pytest.mark.heavy
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason="misordered"))
                                  if name in MISORDERED else name for name in SWEEP_NAMES])
def test_published_sweeps_are_ordered_as_measured(predicted_sweeps, name):
    """Never-fitted sweeps (benchmarks/sweeps.yaml: torchtitan's pipeline schedules, async TP and Float8 tables;
    Megatron-Bridge's FP8 recipes and layouts on GB200 and B200): each pair of variants is predicted in the order
    its source measured."""
    sweep = predicted_sweeps[name]
    assert sweep.agreeing() == len(sweep.pairs), sweep
