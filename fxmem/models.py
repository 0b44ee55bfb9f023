"""The one model builder of `fxmem inspect` and `fxmem whatif`: a transformers model from its config, LoRA on every
linear of every block, and an example batch."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch

from fxmem.choices import NAMED_SHAPES

# LoRA on every linear of every block (regexes PEFT full-matches against module names); other families get PEFT's
# "all-linear" (every linear but the output layer).
LORA_TARGETS = {
    "llama": r".*layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
    "bert": r".*layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense"
            r"|output\.dense)",
}
_TARGET_FAMILY = {"llama": "llama", "mistral": "llama", "bert": "bert", "roberta": "bert"}

def hf_config(model: Any) -> Any:
    """A transformers config: ``model`` itself if it is one, else a named shape or a config.json (file or
    directory)."""
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig
    if isinstance(model, PretrainedConfig):
        return model
    if model in NAMED_SHAPES:
        values = dict(NAMED_SHAPES[model])
        return CONFIG_MAPPING[values.pop("model_type")](**values)
    path = pathlib.Path(model)
    if not path.exists():
        raise ValueError(f"unknown model {model!r}: valid names: {', '.join(NAMED_SHAPES)}, "
                         "or a path to a HuggingFace config.json")
    json.loads((path / "config.json" if path.is_dir() else path).read_text())  # a clear error on a bad file
    return AutoConfig.from_pretrained(path)


def is_causal_lm(config: Any) -> bool:
    """Built as a causal LM (a loss from labels) rather than a bare encoder."""
    return config.model_type in ("llama", "mistral") or any(
        a.endswith("ForCausalLM") for a in (getattr(config, "architectures", None) or []))


def build_lora_model(config: Any, rank: int, dtype: torch.dtype, device: torch.device | str = "meta"
                     ) -> torch.nn.Module:
    """The model of ``config`` (random weights, SDPA attention, no KV cache) in training mode, with LoRA (alpha =
    rank, dropout 0) on every linear of every block, prepared as ``fxmem.compile_`` prepares it
    (``fxmem.prepare_peft``); rank 0: no LoRA (full fine-tuning)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel, AutoModelForCausalLM

    from fxmem.peft_lora import prepare_peft

    config.use_cache = False
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = (AutoModelForCausalLM if is_causal_lm(config) else AutoModel).from_config(config, dtype=dtype)
    if rank:
        family = _TARGET_FAMILY.get(config.model_type)
        targets = LORA_TARGETS[family] if family else "all-linear"
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=targets))
        prepare_peft(model)
    model.train()
    return model


def example_batch(config: Any, batch: int, seq: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Token ids (zeros: what is saved depends on the shapes alone), and labels for a causal LM."""
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids} if is_causal_lm(config) else {"input_ids": ids}
