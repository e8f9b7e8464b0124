"""Tiny transformers models for the runtime tests: real classes, small configs, fp32 on CPU."""
import torch
import transformers

from runtime.examples import Logits


def llama():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def llama_logits():
    return Logits(llama())


def gpt2_logits():
    """GPT-2: Conv1D projections, a fused c_attn, learned positions, tied embeddings."""
    config = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, n_positions=64, vocab_size=256,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    return Logits(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"))


def qwen3_logits():
    """Qwen3: per-head q/k norms inside the attention's tensor-parallel pair."""
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    return Logits(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"))


def mixtral_logits():
    """Mixtral: 4 experts, top-2 routing (transformers' fused MixtralExperts), grouped-query attention."""
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                        tie_word_embeddings=False)
    return Logits(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"))


def qwen3_moe_logits():
    """Qwen3-MoE: 4 experts, top-2, per-head q/k norms."""
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, vocab_size=256, num_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=64, tie_word_embeddings=False)
    return Logits(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"))


def qwen2_moe_logits():
    """Qwen2-MoE: 4 routed experts, top-2, and a shared expert (96 wide) with its sigmoid gate."""
    config = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256, num_experts=4,
                                         num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    return Logits(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"))


def gemma3_logits():
    """Gemma 3: a sliding-window layer (8 keys per query) and a full-attention one, as its layer_types alternate."""
    config = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                           sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                           max_position_embeddings=64)
    return Logits(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"))


class LogitsAndAux(torch.nn.Module):
    """The logits and the router's load-balancing loss, which transformers' MoE models return with
    output_router_logits=True (a user's loss adds it, scaled)."""
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        out = self.model(input_ids=tokens, use_cache=False, output_router_logits=True)
        return {"logits": out.logits, "aux_loss": out.aux_loss}


def mixtral_with_aux():
    return LogitsAndAux(mixtral_logits().model)
