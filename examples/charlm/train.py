"""A small causal language model trained by Hugging Face's Trainer on gangflow's runtime API.

GPT-2's architecture at toy size (2 layers, width 64), initialised from a config (nothing is
downloaded), on the `charlm` corpus (standard-library source files, DVC-versioned: data/corpus),
with a byte-level BPE tokenizer trained on the corpus' train split. Run in every rank of the gang
(`training.entrypoint: charlm.train:main`); alone: `torchrun --nproc-per-node 2 -m charlm.train`
with examples/ on PYTHONPATH and the runtime's environment set.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from trainer.integrations import huggingface as gangflow_hf  # first: the ranks run offline

import torch  # noqa: E402

#: Token id 0 ends every file (and pads nothing: the blocks are full).
END_OF_TEXT = "<|endoftext|>"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="charlm.train", description=__doc__)
    parser.add_argument("--max-steps", type=int, default=240)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--block", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=512, help="BPE vocabulary size")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=20261203)
    return parser.parse_args(argv)


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


def build_model(tokenizer, args: argparse.Namespace):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=args.block, n_embd=args.width, n_layer=args.layers, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: a resumed run replays the same steps
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def main(argv: Sequence[str] | None = None) -> int:
    import pandas as pd
    from transformers import Trainer, TrainingArguments, default_data_collator, set_seed

    from trainer import runtime

    args = parse_args(argv)
    run = runtime.init()
    data = run.dataset()
    texts = list(pd.read_parquet(data / "train.parquet")["text"])
    resume = gangflow_hf.resume_checkpoint(run)
    tokenizer = shared_tokenizer(run, texts, args.vocab, resume)
    set_seed(args.seed)
    model = build_model(tokenizer, args)
    training_args = TrainingArguments(
        output_dir=gangflow_hf.scratch_dir(run), max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=10, weight_decay=0.0, seed=args.seed,
        save_strategy="steps", save_steps=args.save_steps, logging_steps=20, report_to=[], disable_tqdm=True,
        use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=Blocks(blocks(tokenizer, texts, args.block)),
                      processing_class=tokenizer, data_collator=default_data_collator)  # full blocks: no padding
    gangflow_hf.train(trainer, run, checkpoint=resume)
    if run.rank == 0:
        final = Path(training_args.output_dir) / "final"
        trainer.save_model(str(final))  # the weights (safetensors), config.json and the tokenizer
        (final / "training_args.bin").unlink(missing_ok=True)  # a pickle: nothing a loader should open
        (final / "charlm.json").write_text(json.dumps({"block": args.block}))
        run.log_model(final)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
