"""A small causal language model trained by Hugging Face's Trainer on gangflow's runtime API.

GPT-2's architecture at toy size (2 layers, width 64), initialised from a config (nothing is
downloaded), on the `charlm` corpus (standard-library source files, DVC-versioned: data/corpus),
with a byte-level BPE tokenizer trained on the corpus' train split. Run in every rank of the gang
(`training.entrypoint: charlm.train:main` in pipelines/charlm.yaml).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import SimpleNamespace
from pathlib import Path

from trainer.integrations import huggingface as gangflow_hf  # first: the ranks run offline

import torch  # noqa: E402

#: Token id 0 ends every file (and pads nothing: the blocks are full).
END_OF_TEXT = "<|endoftext|>"


def train_tokenizer(texts: Sequence[str], vocab: int):
    """A byte-level BPE tokenizer trained on `texts` (deterministic for the same texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT)


def shared_tokenizer(run, texts: Sequence[str], vocab: int, resume: str | None):
    """The tokenizer every rank uses: the resumed checkpoint's, or one rank 0 trains and sends."""
    from transformers import PreTrainedTokenizerFast

    if resume is not None:
        return PreTrainedTokenizerFast.from_pretrained(resume, local_files_only=True)
    payload = [train_tokenizer(texts, vocab).backend_tokenizer.to_str() if run.rank == 0 else None]
    if run.world_size > 1:
        torch.distributed.broadcast_object_list(payload, src=0)
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(payload[0]), eos_token=END_OF_TEXT,
                                   bos_token=END_OF_TEXT)


def blocks(tokenizer, texts: Sequence[str], block: int) -> torch.Tensor:
    """The texts as one token stream (each file ended by END_OF_TEXT), cut into full blocks."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    usable = len(ids) // block * block
    return torch.tensor(ids[:usable], dtype=torch.long).view(-1, block)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __len__(self) -> int:
        return len(self.tensor)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tensor[index], "labels": self.tensor[index]}


def build_model(tokenizer, args: SimpleNamespace):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=args.block, n_embd=args.width, n_layer=args.layers, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: a resumed run replays the same steps
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def main(*, vocab: int = 512, width: int = 64, layers: int = 2, block: int = 128, warmup_steps: int = 10,
         lr_scheduler: str = "linear") -> int:
    """One rank's training. The model's shape comes from `training.kwargs`; the run's
    `train.max_steps`, `train.batch_size` (global: split over the ranks), `train.lr`, `train.seed`
    and `checkpoint.every_steps` from `run.params` (the trigger form can change them)."""
    import pandas as pd
    from transformers import Trainer, TrainingArguments, default_data_collator, set_seed

    from trainer import runtime

    run = runtime.init(config={"vocab": vocab, "width": width, "layers": layers, "block": block,
                               "warmup_steps": warmup_steps, "lr_scheduler": lr_scheduler})
    params = run.params
    max_steps, batch = int(params.get("train.max_steps", 240)), int(params.get("train.batch_size", 16))
    lr, seed = float(params.get("train.lr", 3e-3)), int(params.get("train.seed", 20261203))
    if batch % run.world_size:
        raise ValueError(f"train.batch_size={batch} is not a multiple of the world size {run.world_size}")
    texts = list(pd.read_parquet(run.dataset() / "train.parquet")["text"])
    resume = gangflow_hf.resume_checkpoint(run)
    tokenizer = shared_tokenizer(run, texts, vocab, resume)
    set_seed(seed)
    model = build_model(tokenizer, SimpleNamespace(block=block, width=width, layers=layers))
    training_args = TrainingArguments(
        output_dir=gangflow_hf.scratch_dir(run), max_steps=max_steps, per_device_train_batch_size=batch // run.world_size,
        learning_rate=lr, lr_scheduler_type=lr_scheduler, warmup_steps=warmup_steps, weight_decay=0.0, seed=seed,
        save_strategy="steps", save_steps=int(params.get("checkpoint.every_steps", 40)), logging_steps=20,
        report_to=[], disable_tqdm=True, use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=Blocks(blocks(tokenizer, texts, block)),
                      processing_class=tokenizer, data_collator=default_data_collator)  # full blocks: no padding
    result = gangflow_hf.train(trainer, run, checkpoint=resume)
    if run.rank == 0:
        final = Path(training_args.output_dir) / "final"
        trainer.save_model(str(final))  # the weights (safetensors), config.json and the tokenizer
        (final / "training_args.bin").unlink(missing_ok=True)  # a pickle: nothing a loader should open
        (final / "charlm.json").write_text(json.dumps({"block": block}))
        run.log_model(final, flavour="transformers", metrics={"train_loss": float(result.training_loss)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
