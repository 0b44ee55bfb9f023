"""fxmem under HF's Trainer and TRL's SFTTrainer as users write them: fxmem.compile_ in place, the trainers'
defaults otherwise (remove_unused_columns=True), against the trainers' own inductor compile."""

import torch

import fxmem
from tests.conftest import tiny_model

TRAINING = dict(max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                save_strategy="no", use_cpu=True, seed=0, data_seed=0)


def _losses(trainer) -> list[float]:
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _assert_same_losses(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference) == 3
    for got, want in zip(losses, reference, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, reference)


def _token_rows(examples: int = 8, length: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(examples):
        ids = torch.randint(0, 256, (length,), generator=generator)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return rows


def _trainer_losses(tmp_path, with_fxmem: bool) -> tuple[list[float], fxmem.Backend | None]:
    from transformers import Trainer, TrainingArguments
    model, _ = tiny_model("llama", lora=True, layers=1)  # one block: the trainers' wiring is tested, not the depth
    backend = fxmem.compile_(model, preset="exact") if with_fxmem else None
    args = TrainingArguments(output_dir=str(tmp_path / str(with_fxmem)), torch_compile=not with_fxmem, **TRAINING)
    return _losses(Trainer(model=model, args=args, train_dataset=_token_rows())), backend


def test_trainer_trains_a_model_compiled_in_place_as_its_own_inductor_compile_does(tmp_path):
    losses, backend = _trainer_losses(tmp_path, with_fxmem=True)
    assert any(region.kind == "training" for region in backend.regions)  # fxmem compiled what Trainer ran
    reference, _ = _trainer_losses(tmp_path, with_fxmem=False)
    _assert_same_losses(losses, reference)


def _word_tokenizer():
    """A word-level tokenizer over the tiny model's vocabulary, built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = {f"w{i}": i for i in range(250)} | {"<pad>": 250, "<unk>": 251, "<eos>": 252}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def _sft_losses(tmp_path, with_fxmem: bool) -> tuple[list[float], fxmem.Backend | None]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    generator = torch.Generator().manual_seed(0)
    text = Dataset.from_list([{"text": " ".join(f"w{int(i)}" for i in torch.randint(0, 250, (15,), generator=generator))}
                              for _ in range(8)])
    model, _ = tiny_model("llama", lora=True, layers=1)
    backend = fxmem.compile_(model, preset="exact") if with_fxmem else None
    args = SFTConfig(output_dir=str(tmp_path / f"sft-{with_fxmem}"), torch_compile=not with_fxmem, max_length=32,
                     **TRAINING)
    trainer = SFTTrainer(model=model, args=args, train_dataset=text, processing_class=_word_tokenizer())
    return _losses(trainer), backend


def test_trl_sft_trainer_trains_a_model_compiled_in_place_as_its_own_inductor_compile_does(tmp_path):
    losses, backend = _sft_losses(tmp_path, with_fxmem=True)
    assert any(region.kind == "training" for region in backend.regions)  # fxmem compiled the training step
    reference, _ = _sft_losses(tmp_path, with_fxmem=False)
    _assert_same_losses(losses, reference)


def test_trainer_runs_the_guard_on_its_batches(tmp_path):
    from transformers import Trainer, TrainingArguments

    from tests.models import GUARD_LLAMA
    model, batch = GUARD_LLAMA.build()  # B past init, real text: 1-bit codes bend it
    rows = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids} for ids in batch["input_ids"]]
    backend = fxmem.compile_(model, preset="hyclora-4bit", bits=1, qkv_bits=None, linear_input_bits=None,
                             guard_cosine=0.99, guard_every=2)
    args = TrainingArguments(output_dir=str(tmp_path / "guarded"), **TRAINING)
    _losses(Trainer(model=model, args=args, train_dataset=rows * 4))
    assert [(c.forward, c.tokens) for c in backend.guard_checks] == [(1, 64), (3, 64)]
    assert backend.guard_checks[0].cosine_before < 0.9 and backend.guard_checks[0].demotions
    assert all(c.met for c in backend.guard_checks)
    assert {key for region in backend.regions for key in region.demoted} == set(backend.demotions)
