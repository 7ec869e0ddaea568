"""Tiny transformers built from configs (no download) with their inputs: what the structure tests run on.

Each builder returns ``(model, example kwargs, other kwargs)``: the other inputs have another batch size and length,
so a test can check a result beyond the inputs it was made on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 64
Built = tuple[nn.Module, dict[str, Any], dict[str, Any]]


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _randomize_biases(model: nn.Module, seed: int) -> nn.Module:
    """Nonzero biases, so a row kept or dropped by mistake shows in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") and param.dim() == 1:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return model


def bert(layers: int = 2) -> Built:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=40
    )
    torch.manual_seed(0)
    model = _randomize_biases(transformers.BertModel(config), 1).eval()
    return model, {"input_ids": _ids(2, 7, 2)}, {"input_ids": _ids(3, 11, 3)}


def gpt2(layers: int = 2) -> Built:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_inner=40, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = _randomize_biases(transformers.GPT2LMHeadModel(config), 1).eval()
    return model, {"input_ids": _ids(2, 7, 2)}, {"input_ids": _ids(3, 11, 3)}


def llama(layers: int = 2) -> Built:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=40,
        attention_bias=True,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = _randomize_biases(transformers.LlamaForCausalLM(config), 1).eval()
    return model, {"input_ids": _ids(2, 7, 2)}, {"input_ids": _ids(3, 11, 3)}


def t5() -> Built:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=40, num_layers=1, num_heads=4, feed_forward_proj="gated-gelu"
    )
    torch.manual_seed(0)
    model = transformers.T5Model(config).eval()
    example = {"input_ids": _ids(2, 7, 2), "decoder_input_ids": _ids(2, 5, 4)}
    other = {"input_ids": _ids(3, 9, 3), "decoder_input_ids": _ids(3, 6, 5)}
    return model, example, other


def encoder_layer() -> Built:
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, 40, batch_first=True).eval()
    g = torch.Generator().manual_seed(2)
    return model, {"src": torch.randn(2, 7, 32, generator=g)}, {"src": torch.randn(3, 5, 32, generator=g)}


BUILDERS: dict[str, Callable[[], Built]] = {
    "bert": bert,
    "gpt2": gpt2,
    "llama": llama,
    "t5": t5,
    "encoder_layer": encoder_layer,
}


def opt_with_projection() -> nn.Module:
    """OPT-350m's shape in small: ``word_embed_proj_dim != hidden_size``, so ``lm_head`` (tied to the input embedding)
    reads ``project_out``'s rows, which look like an MLP's neurons."""
    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        ffn_dim=40,
        num_attention_heads=4,
        word_embed_proj_dim=16,
        do_layer_norm_before=False,
    )
    return transformers.OPTForCausalLM(config).eval()


def outputs(model: nn.Module, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The floating outputs of one forward without a cache."""
    if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
        kwargs = {**kwargs, "use_cache": False}
    with torch.no_grad():
        out = model(**kwargs)
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
