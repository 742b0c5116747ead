"""Fine-tune a causal LM with `transformers.Trainer`, and look at what it writes after every evaluation.

An ordinary Trainer script; the three lines marked `# hangwatch` are all it takes to run it under
`hangwatch run configs/examples/hf_trainer.yaml`: heartbeats (steps, eval, checkpoint and generate phases),
and after a hang or a crash a restart that resumes from the last *good* checkpoint.  Outside hangwatch the
same script runs as it always did.

`tiny_model` stands in for `from_pretrained` so the example runs on a CPU with no model hub.
"""

from __future__ import annotations

import argparse

import tiny_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from hangwatch.daemon.integrations.transformers import HangwatchCallback, resume_from  # hangwatch

PROMPTS = ["question 3: what is 3 plus 3? answer:", "question 60: what is 60 plus 60? answer:"]


class SampleGenerations(TrainerCallback):
    """After each evaluation, generate an answer for a few prompts: a quick look at what the model learned."""

    def __init__(self, tok, max_new_tokens: int):
        self.tok = tok
        self.max_new_tokens = max_new_tokens

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        for prompt in PROMPTS:
            enc = self.tok(prompt, return_tensors="pt", return_token_type_ids=False).to(model.device)
            out = model.generate(
                **enc, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=self.tok.pad_token_id
            )
            answer = self.tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            print(f"step {state.global_step}: {prompt!r} -> {answer!r}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output-dir", default="out/hf_trainer")
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--eval-steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=12)
    args = p.parse_args(argv)

    tok = tiny_model.tokenizer()
    model = tiny_model.model(tok, seed=0)
    train_ds = tiny_model.TextDataset(tok, tiny_model.TEXTS[:48])
    eval_ds = tiny_model.TextDataset(tok, tiny_model.TEXTS[48:56])

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=2,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        logging_steps=4,
        report_to=[],
        use_cpu=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tok,
        callbacks=[SampleGenerations(tok, args.max_new_tokens), HangwatchCallback()],  # hangwatch
    )
    trainer.train(resume_from_checkpoint=resume_from())  # hangwatch
    trainer.save_model(f"{args.output_dir}/final")


if __name__ == "__main__":
    main()
