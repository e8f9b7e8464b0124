"""Run by tests/test_zero3_collectives.py in a process of its own: Megatron-Core's own GPT transformer layer (its
local spec, built on CPU in one gloo process), GPT-3 style (biases, LayerNorm) and Llama style (no biases,
RMSNorm, SwiGLU). Prints a JSON object: style -> the layer's parameter names."""
import json
import os
import sys
import warnings

import torch.distributed as dist

warnings.filterwarnings("ignore")


def main(port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    names = {}
    for style, bias, gated, norm in (("gpt", True, False, "LayerNorm"), ("llama", False, True, "RMSNorm")):
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                                   add_bias_linear=bias, gated_linear_unit=gated, normalization=norm)
        layer = build_module(get_gpt_layer_local_spec(normalization=norm), config=config, layer_number=1)
        names[style] = [name for name, _ in layer.named_parameters()]
    print(json.dumps(names))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
