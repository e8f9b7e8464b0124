"""Measure, on one CUDA GPU, what the cost models predict: GEMM rates by shape and dtype (FP8 with and
without current-scaling quantisation), fine-grained expert GEMMs, fused attention, HBM copy, host time
per launched op, and whole training steps of the reference decoder (time and memory).

    python benchmarks/gpu_measure.py --out results.json          # on a machine with a GPU
    python benchmarks/gpu_measure.py --smoke --out /tmp/s.json   # tiny shapes on the CPU: checks the script

It imports only torch and the reference model, so it runs under a GPU machine's own torch. The
predictions these numbers are compared with are made on any machine by `benchmarks/gpu_compare.py`.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

# the reference decoder without the package's solver dependencies: a GPU machine's own Python has
# torch and pydantic, not necessarily OR-Tools
_package = types.ModuleType("planner")
_package.__path__ = [str(Path(__file__).resolve().parents[1] / "planner")]
sys.modules.setdefault("planner", _package)

from planner.graph_capture.model_config import ModelConfig  # noqa: E402
from planner.graph_capture.reference_model import build_model  # noqa: E402

FP8_MAX = 448.0  # largest float8_e4m3fn value

# (name, M tokens, N out, K in): square, dense-transformer and fine-grained expert GEMMs
GEMM_SHAPES = ([(f"square-{n}", n, n, n) for n in (1024, 2048, 4096, 8192, 16384)]
               + [(f"llama8b-{name}-{m}", m, n, k) for m in (2048, 8192, 16384)
                  for name, n, k in (("qkv", 6144, 4096), ("fc1", 28672, 4096), ("fc2", 4096, 14336))]
               + [(f"expert-{name}-{m}", m, n, k) for m in (256, 512, 1024, 2048, 4096, 8192)
                  for name, n, k in (("fc1", 1536, 2048), ("fc2", 2048, 768))])

# the reference decoder trained in bf16 with fp32 master weights and Adam moments
E2E_MODELS = {
    "llama-1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=16,
                     ffn_hidden_size=5632, vocab_size=32000, seq_length=4096),
    "llama-3b-gqa": dict(num_layers=28, hidden_size=3072, num_attention_heads=24, num_query_groups=8,
                         ffn_hidden_size=8192, vocab_size=128256, seq_length=4096),
    "gpt-1p3b-math": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                          vocab_size=51200, seq_length=2048, activation="gelu", normalization="layernorm",
                          position_embedding="learned", attention="mha", attention_impl="math", add_bias=True),
}
E2E_BATCHES = {"llama-1b": (1, 4), "llama-3b-gqa": (1, 2), "gpt-1p3b-math": (1, 4)}


class Timer:
    """Seconds per call of fn: CUDA events on a GPU, wall clock on the CPU."""

    def __init__(self, device: str, min_time_s: float):
        self.device, self.min_time_s = device, min_time_s

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fn, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        once = max(time.perf_counter() - start, 1e-6)
        reps = int(max(3, min(200, self.min_time_s / once)))
        if self.device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return begin.elapsed_time(end) / 1e3 / reps
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 current scaling (Transformer Engine's recipe): amax of this tensor, scale, cast."""
    scale = FP8_MAX / x.abs().amax().float().clamp(min=1e-12)
    return (x * scale).to(torch.float8_e4m3fn), scale.reciprocal()


def fp8_matmul(a8, a_inv, b8_colmajor, b_inv):
    return torch._scaled_mm(a8, b8_colmajor, scale_a=a_inv, scale_b=b_inv, out_dtype=torch.bfloat16)


def gemms(timer: Timer, device: str, fp8: bool, shapes) -> list[dict]:
    rows = []
    for name, m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        row = {"name": name, "m": m, "n": n, "k": k, "bf16_s": timer(lambda: a @ b)}
        if fp8:
            b8, b_inv = quantize(b.t().contiguous())
            b8 = b8.t()                                  # column-major, as _scaled_mm wants
            a8, a_inv = quantize(a)
            row["fp8_s"] = timer(lambda: fp8_matmul(a8, a_inv, b8, b_inv))
            row["fp8_quantized_s"] = timer(lambda: fp8_matmul(*quantize(a), b8, b_inv))
        rows.append(row)
        print(f"gemm {name:24s} bf16 {2 * m * n * k / row['bf16_s'] / 1e12:7.1f} TFLOP/s"
              + (f"  fp8 {2 * m * n * k / row['fp8_s'] / 1e12:7.1f}  fp8+quant "
                 f"{2 * m * n * k / row['fp8_quantized_s'] / 1e12:7.1f}" if fp8 else ""), flush=True)
    return rows


def experts(timer: Timer, device: str, fp8: bool, local_experts: int, hidden: int, ffn: int,
            tokens_per_expert: tuple[int, ...]) -> list[dict]:
    """Forward of `local_experts` SwiGLU experts, one GEMM each (a loop, as grouped GEMMs issue them)."""
    rows = []
    up = torch.randn(local_experts, hidden, 2 * ffn, device=device, dtype=torch.bfloat16) * hidden ** -0.5
    down = torch.randn(local_experts, ffn, hidden, device=device, dtype=torch.bfloat16) * ffn ** -0.5
    for tokens in tokens_per_expert:
        x = torch.randn(local_experts, tokens, hidden, device=device, dtype=torch.bfloat16)

        def loop_bf16():
            for e in range(local_experts):
                gate, lin = (x[e] @ up[e]).chunk(2, dim=-1)
                (F.silu(gate) * lin) @ down[e]

        row = {"local_experts": local_experts, "tokens_per_expert": tokens, "hidden": hidden, "ffn": ffn,
               "flops": local_experts * 2 * tokens * hidden * 3 * ffn, "bf16_loop_s": timer(loop_bf16),
               "bf16_bmm_s": timer(lambda: torch.bmm(F.silu(torch.bmm(x, up[..., :ffn])) * torch.bmm(x, up[..., ffn:]), down))}
        if fp8:
            up8 = [quantize(up[e].t().contiguous()) for e in range(local_experts)]
            down8 = [quantize(down[e].t().contiguous()) for e in range(local_experts)]

            def loop_fp8():
                for e in range(local_experts):
                    h = fp8_matmul(*quantize(x[e]), up8[e][0].t(), up8[e][1])
                    gate, lin = h.chunk(2, dim=-1)
                    fp8_matmul(*quantize(F.silu(gate) * lin), down8[e][0].t(), down8[e][1])

            row["fp8_quantized_loop_s"] = timer(loop_fp8)
        rows.append(row)
        print(f"experts x{local_experts} tokens {tokens:5d}: " + "  ".join(
            f"{k} {row['flops'] / v / 1e12:6.1f} TFLOP/s" for k, v in row.items() if k.endswith("_s")), flush=True)
    return rows


def casts(timer: Timer, device: str, shapes) -> list[dict]:
    """FP8 casts of a bf16 activation as fused kernels (torch.compile): current scaling (amax pass, then
    scale and cast into row- and column-wise copies) and delayed scaling (scale known: cast only)."""
    compile_ = torch.compile if device == "cuda" else (lambda f: f)
    dtype = torch.float8_e4m3fn

    @compile_
    def current(x):
        scale = FP8_MAX / x.abs().amax().float().clamp(min=1e-12)
        return (x * scale).to(dtype), (x.t() * scale).to(dtype).contiguous(), scale

    @compile_
    def delayed(x, scale):
        return (x * scale).to(dtype), (x.t() * scale).to(dtype).contiguous()

    rows = []
    for tokens, width in shapes:
        x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
        scale = torch.tensor(1.0, device=device)
        rows.append({"tokens": tokens, "width": width, "elements": tokens * width,
                     "current_s": timer(lambda: current(x)), "delayed_s": timer(lambda: delayed(x, scale))})
        row = rows[-1]
        print(f"fp8 cast {tokens}x{width}: current {row['current_s'] * 1e6:.0f} us "
              f"({row['current_s'] / row['elements'] * 1e12:.2f} ps/element), delayed {row['delayed_s'] * 1e6:.0f} us",
              flush=True)
    return rows


def attention(timer: Timer, device: str, cases) -> list[dict]:
    rows = []
    for batch, heads, kv_heads, seq, dim in cases:
        q = torch.randn(batch, heads, seq, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(batch, kv_heads, seq, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(batch, kv_heads, seq, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        gqa = kv_heads != heads

        def forward():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        grad = torch.randn_like(q)
        row = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "seq": seq, "head_dim": dim,
               "causal_forward_flops": 2 * batch * heads * seq * seq * dim,  # 4bhs^2d halved by the mask
               "forward_s": timer(forward),
               "forward_backward_s": timer(lambda: torch.autograd.backward(forward(), grad))}
        if device == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            try:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    forward()
                row["flash_kernel"] = True
            except RuntimeError:
                row["flash_kernel"] = False
        rows.append(row)
        print(f"attention b{batch} h{heads}/{kv_heads} s{seq}: fwd {row['causal_forward_flops'] / row['forward_s'] / 1e12:6.1f} "
              f"TFLOP/s, fwd+bwd {3.5 * row['causal_forward_flops'] / row['forward_backward_s'] / 1e12:6.1f} TFLOP/s "
              f"flash {row.get('flash_kernel')}", flush=True)
    return rows


def hbm_and_host(timer: Timer, device: str, copy_bytes: int) -> dict:
    src = torch.empty(copy_bytes // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_s = timer(lambda: dst.copy_(src))
    tiny = torch.zeros(1, device=device)
    timer.sync()
    launches = 5000
    start = time.perf_counter()
    for _ in range(launches):
        tiny.add_(1.0)
    timer.sync()
    per_op = (time.perf_counter() - start) / launches
    print(f"hbm copy {2 * copy_bytes / copy_s / 1e9:.0f} GB/s (read + write); host {per_op * 1e6:.1f} us per op",
          flush=True)
    return {"copy_bytes": copy_bytes, "copy_s": copy_s, "host_s_per_small_op": per_op}


def train_steps(device: str, name: str, fields: dict, micro_batch: int, steps: int) -> dict:
    """bf16 forward/backward of the reference decoder, fp32 master weights and Adam moments (16 B per
    parameter with bf16 gradients), fp32 cross-entropy: step time and memory by phase."""
    cfg = ModelConfig(name=name, **fields)
    torch.manual_seed(0)
    model = build_model(cfg, device=device, dtype=torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().float() for p in params]
    optimizer = torch.optim.AdamW(master, lr=1e-5, fused=device == "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    memory = torch.cuda.memory_allocated if device == "cuda" else (lambda: 0)
    record: dict = {"model": name, "config": fields, "micro_batch": micro_batch,
                    "parameters": sum(p.numel() for p in params)}

    def step(measure: bool):
        before = memory()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), targets.reshape(-1))
        del logits
        after_forward = memory()
        loss.backward()
        for p, m in zip(params, master):   # fp32 gradient per parameter, then release the bf16 one
            m.grad = p.grad.float()
            p.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
        if measure:
            record.update(states_bytes=before, forward_saved_bytes=after_forward - before,
                          peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else 0)

    for _ in range(2):
        step(False)
    step(True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step(False)
    sync()
    record["step_s"] = (time.perf_counter() - start) / steps
    print(f"train {name} mbs {micro_batch}: {record['step_s'] * 1e3:.1f} ms/step, states "
          f"{record['states_bytes'] / 1e9:.2f} GB, saved by forward {record['forward_saved_bytes'] / 1e9:.2f} GB, "
          f"peak {record['peak_bytes'] / 1e9:.2f} GB", flush=True)
    del model, optimizer, master, params
    if device == "cuda":
        torch.cuda.empty_cache()
    return record


def smoke_scale(fields: dict) -> dict:
    return {**fields, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "num_query_groups": min(4, fields.get("num_query_groups", 4)) if fields.get("num_query_groups") else None,
            "ffn_hidden_size": 128, "vocab_size": 256, "seq_length": 64}


def guarded(measure):
    try:
        return measure()
    except Exception as exc:  # a failed measurement is recorded, and the others still run
        print(f"failed: {type(exc).__name__}: {exc}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to check the script")
    parser.add_argument("--sections", default="gemm,experts,attention,memory,casts,train",
                        help="comma-separated sections to measure")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    timer = Timer(device, 0.002 if args.smoke else 0.05)
    fp8 = device == "cuda" and hasattr(torch, "float8_e4m3fn")
    result: dict = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        result["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit",
             "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    out = Path(args.out)
    shapes = [(n, 64, 64, 64) for n, *_ in GEMM_SHAPES[:3]] if args.smoke else GEMM_SHAPES
    sections = {
        "gemm": lambda: gemms(timer, device, fp8, shapes),
        # Qwen3-30B-A3B's experts at EP 8 (16 local), Qwen3-235B-A22B's at EP 32 (4 local)
        "experts": lambda: (experts(timer, device, fp8, 4, 64, 32, (16,)) if args.smoke else
                            experts(timer, device, fp8, 16, 2048, 768, (512, 1024, 2048, 4096))
                            + experts(timer, device, fp8, 4, 4096, 1536, (1024, 2048, 4096))),
        "attention": lambda: attention(timer, device, [(1, 4, 2, 64, 16)] if args.smoke else [
            (1, 32, 32, 4096, 128), (1, 32, 8, 4096, 128), (1, 32, 32, 8192, 128), (4, 16, 16, 2048, 128)]),
        "memory": lambda: hbm_and_host(timer, device, 1 << 20 if args.smoke else 4 << 30),
        "casts": lambda: casts(timer, device, [(64, 32)] if args.smoke else [(16384, 4096), (16384, 14336),
                                                                           (65536, 2048), (65536, 768)]),
    }
    wanted = args.sections.split(",")
    for name, measure in sections.items():   # each section saved as it ends: a later failure loses nothing
        if name in wanted:
            result[name] = guarded(measure)
            out.write_text(json.dumps(result, indent=1))
    if "train" not in wanted:
        return 0
    result["train"] = []
    for name, fields in E2E_MODELS.items():
        for micro_batch in E2E_BATCHES[name]:
            result["train"].append(guarded(lambda: train_steps(
                device, name, smoke_scale(fields) if args.smoke else fields, micro_batch, 1 if args.smoke else 5)))
            out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
