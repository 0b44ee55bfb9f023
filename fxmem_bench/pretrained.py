"""The llama-pretrained workload's weights: a small byte-level Llama pretrained here, deterministically, on the
Python standard library's code with its docstrings taken out, cached under the user's cache directory and checked
by hash. Fine-tuning then reads the docstrings, prose the model has never seen (fxmem_bench.workloads).

Random-weight models have none of the outlier and low-rank structure that activation compression relies on, and
no pretrained causal LM can be downloaded here: this is the one that judges a lossy preset's fidelity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fxmem_bench.data import shuffled_batches, split_windows

BYTE_VOCAB = 256
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "fxmem-pretrain.json"


@dataclass(frozen=True)
class PretrainRecipe:
    """Everything the weights depend on: a change makes another cache entry."""

    hidden: int = 256
    ffn: int = 688
    layers: int = 4
    heads: int = 8
    batch: int = 16
    seq: int = 256
    steps: int = 2400
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 200
    eval_windows: int = 64
    held_out_every: int = 20  # one code file in 20 is never trained on: the pretraining eval loss
    seed: int = 0

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    def config(self) -> Any:
        """The model's transformers LlamaConfig (byte vocabulary, SDPA, no KV cache)."""
        from transformers import LlamaConfig
        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.ffn, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.heads, vocab_size=BYTE_VOCAB,
                           max_position_embeddings=self.seq, attn_implementation="sdpa", use_cache=False)


RECIPE = PretrainRecipe()
BUILD_TIME = "about 20-30 minutes on 2 CPU cores"


def cache_root() -> pathlib.Path:
    """$FXMEM_CACHE_DIR, else $XDG_CACHE_HOME/fxmem, else ~/.cache/fxmem."""
    if os.environ.get("FXMEM_CACHE_DIR"):
        return pathlib.Path(os.environ["FXMEM_CACHE_DIR"])
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "fxmem"


def checkpoint_dir(recipe: PretrainRecipe = RECIPE) -> pathlib.Path:
    return cache_root() / f"llama-pretrained-{recipe.key}"


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(recipe: PretrainRecipe = RECIPE) -> dict | None:
    """The cached build's manifest (recipe, weights' sha256, eval curve), None if there is no build."""
    path = checkpoint_dir(recipe) / MANIFEST_FILE
    return json.loads(path.read_text()) if path.exists() else None


def verified_checkpoint(recipe: PretrainRecipe = RECIPE) -> pathlib.Path:
    """The cached build's directory, its weights checked against the hash recorded when they were built."""
    directory = checkpoint_dir(recipe)
    manifest = read_manifest(recipe)
    if manifest is None or not (directory / WEIGHTS_FILE).exists():
        raise FileNotFoundError(f"no llama-pretrained weights in {directory}: build them with "
                                f"`fxmem bench pretrain` ({BUILD_TIME})")
    actual = file_sha256(directory / WEIGHTS_FILE)
    if actual != manifest["sha256"]:
        raise ValueError(f"llama-pretrained weights in {directory} do not match their recorded hash "
                         f"(sha256 {actual[:16]}..., recorded {manifest['sha256'][:16]}...): rebuild them with "
                         f"`fxmem bench pretrain --rebuild`")
    return directory


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' loading and saving bars off: a benchmark loads a model per setting."""
    from transformers.utils import logging as transformers_logging
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            transformers_logging.enable_progress_bar()


def load_pretrained(recipe: PretrainRecipe = RECIPE) -> torch.nn.Module:
    """The pretrained LlamaForCausalLM (checked by hash), built first if absent."""
    from transformers import LlamaForCausalLM
    if read_manifest(recipe) is None:
        warnings.warn(f"llama-pretrained weights absent from {checkpoint_dir(recipe)}: pretraining them now "
                      f"({BUILD_TIME}; `fxmem bench pretrain` does the same and shows its progress)", stacklevel=2)
        build(recipe)
    with quiet_progress_bars():
        return LlamaForCausalLM.from_pretrained(verified_checkpoint(recipe), dtype=torch.float32)


def code_windows(recipe: PretrainRecipe, evaluation: bool) -> torch.Tensor:
    """The pretraining corpus (code without docstrings), training files or held-out ones."""
    return split_windows(0, recipe.seq, every=recipe.held_out_every, evaluation=evaluation)


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch: int = 16) -> tuple[float, float]:
    """(mean next-token loss, next-token accuracy) of ``model`` over ``windows``, in eval mode."""
    training = model.training
    model.eval()
    loss_sum = correct = count = 0.0
    for start in range(0, windows.shape[0], batch):
        tokens = windows[start:start + batch].to(next(model.parameters()).device)
        logits = model(input_ids=tokens).logits[:, :-1].float()
        targets = tokens[:, 1:]
        loss_sum += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == targets).sum().item()
        count += targets.numel()
    model.train(training)
    return loss_sum / count, correct / count


def learning_rate(recipe: PretrainRecipe, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def build(recipe: PretrainRecipe = RECIPE, *,
          on_eval: Callable[[int, float, float], None] = lambda step, loss, accuracy: None) -> pathlib.Path:
    """Pretrain from a seeded initialisation and write the weights and their manifest (replacing any build of the
    same recipe). Deterministic for a given machine and torch build."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(recipe.config())
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": other, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    batches = shuffled_batches(code_windows(recipe, evaluation=False), recipe.batch, recipe.seed)
    eval_windows = code_windows(recipe, evaluation=True)[: recipe.eval_windows]
    curve = []
    started = time.perf_counter()
    for step in range(recipe.steps + 1):
        if step % recipe.eval_every == 0 or step == recipe.steps:
            loss, accuracy = evaluate(model, eval_windows)
            curve.append({"step": step, "eval_loss": loss, "eval_accuracy": accuracy})
            on_eval(step, loss, accuracy)
        if step == recipe.steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        tokens = next(batches)
        model(input_ids=tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    directory = checkpoint_dir(recipe)
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed: an interrupted build leaves no half-written cache entry.
    with tempfile.TemporaryDirectory(dir=directory.parent) as staging:
        model.save_pretrained(staging)
        manifest = {"recipe": dataclasses.asdict(recipe), "sha256": file_sha256(pathlib.Path(staging, WEIGHTS_FILE)),
                    "eval_curve": curve, "seconds": time.perf_counter() - started, "torch": torch.__version__,
                    "threads": torch.get_num_threads()}
        pathlib.Path(staging, MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        if directory.exists():
            shutil.rmtree(directory)
        os.rename(staging, directory)
        pathlib.Path(staging).mkdir()  # for TemporaryDirectory's own cleanup
    return directory
