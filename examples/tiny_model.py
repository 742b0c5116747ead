"""A stand-in for `AutoModelForCausalLM.from_pretrained(...)` / `AutoTokenizer.from_pretrained(...)`: a tiny
Llama built from a config and a character-level tokenizer built locally, so the examples run on a CPU
with no model hub.  In your own script, load your model the way you always do.
"""

from __future__ import annotations

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'-()\n"
TEXTS = [f"question {i}: what is {i} plus {i}? answer: {2 * i}." for i in range(64)]


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.FixedLength(length=1)
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=1 << 30,
    )


def model(tok, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class TextDataset(torch.utils.data.Dataset):
    """Causal-LM examples: input_ids, attention_mask and labels (padding masked out), fixed length."""

    def __init__(self, tok, texts=TEXTS, length: int = 48):
        self.rows = []
        for text in texts:
            enc = tok(
                text + tok.eos_token, padding="max_length", truncation=True, max_length=length, return_tensors="pt"
            )
            ids, mask = enc["input_ids"][0], enc["attention_mask"][0]
            self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]
