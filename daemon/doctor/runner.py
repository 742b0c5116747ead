"""The doctor's runner: which checks run, in which order, each time-boxed, with what they share (the
tokenizer, the data as the worker's `validate_file` reads it, the loaded model).

Two sets.  `cheap` (what `hangwatch run` runs before the first attempt): config, data files, tokenizer,
chat template, labels, LR and schedule, device placement from the environment, disk, py-spy — no torch,
well under a second for the tiny model.  The full set adds the memory estimate (the worker's model built
on the meta device), then — only when it fits — the worker's `load_model`, one forward/backward, the
batch padding, a time-boxed generate per eval prompt, and a real py-spy attach.

Each check runs in a daemon thread joined with a time limit: a check that hangs (a generate, a model load
from a stalled filesystem) becomes a FAIL naming the limit, and the doctor goes on to the next.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from hangwatch.common import gpus
from hangwatch.common.example_shape import first_line_problem
from hangwatch.daemon.doctor import plan_checks as plan
from hangwatch.daemon.doctor import text_checks as text
from hangwatch.daemon.doctor.findings import FAIL, Finding, fail, ok, skip

CHEAP_TIMEOUT_S = 120.0  # tokenizer load, validating a large data file
MODEL_TIMEOUT_S = 300.0
WORK_TIMEOUT_S = 120.0


def timed(name: str, fn: Callable[[], Finding], timeout_s: float) -> Finding:
    """fn() in a daemon thread, at most `timeout_s`; an exception or the time limit becomes a FAIL."""
    box: dict = {}

    def target() -> None:
        try:
            box["finding"] = fn()
        except BaseException as exc:  # noqa: BLE001 - any failure of a check is its finding
            box["error"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=target, name=f"doctor:{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    took = time.monotonic() - t0
    if thread.is_alive():
        finding = fail(
            name, f"did not finish within {timeout_s:g}s", "look at what it waits for (py-spy dump the doctor)"
        )
    elif "error" in box:
        exc = box["error"]
        finding = fail(
            name,
            f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            "fix what the error names",
        )
    else:
        finding = box["finding"]
    finding.seconds = took
    return finding


class Doctor:
    """One preflight of one config.  `env`: the environment the worker will inherit (before worker.env)."""

    def __init__(
        self,
        cfg,
        *,
        cheap: bool = False,
        env: Optional[dict] = None,
        gpu_uuids: Callable[[], Optional[Sequence[str]]] = gpus.nvml_uuids,
    ):
        self.cfg = cfg
        self.cheap = cheap
        self.env = dict(os.environ if env is None else env)
        self.gpu_uuids = gpu_uuids  # the machine's GPUs as NVML lists them; None without NVML
        self.findings: list[Finding] = []
        self.tok = None
        self.train: list = []
        self.train_problems: list = []
        self.eval: list = []
        self.eval_problems: list = []
        self.counts = None
        self.bundle = None

    def add(self, name: str, fn: Callable[[], Finding], timeout_s: float = CHEAP_TIMEOUT_S) -> Finding:
        f = timed(name, fn, timeout_s)
        self.findings.append(f)
        return f

    # ---- the sets ---------------------------------------------------------------------------------

    def run(self) -> list[Finding]:
        cfg = self.cfg
        builtin = cfg.worker.command is None
        if builtin:
            self.run_text_checks()
            self.add("learning rate", self.lr_finding)
        self.add("device placement", self.placement_finding)
        if not self.cheap and builtin:
            self.add("memory estimate", self.memory_finding, MODEL_TIMEOUT_S)
        self.add("disk", self.disk_finding)
        if cfg.worker.nnodes > 1:
            self.add(
                "rendezvous",
                lambda: plan.check_rendezvous(cfg.worker.rdzv_endpoint, cfg.checkpoint.dir, cfg.worker.nnodes),
            )
        self.add("py-spy", self.py_spy_finding, 30)
        if not self.cheap and builtin:
            self.run_model_checks()
        if not builtin:
            self.findings.append(
                skip(
                    "training checks",
                    "worker.command is your own script: the doctor checks the "
                    "built-in worker's tokenizer, data, model and schedule",
                )
            )
        return self.findings

    def run_text_checks(self) -> None:
        cfg = self.cfg
        loaded = self.add("tokenizer", self.load_tokenizer)
        if loaded.status == FAIL:
            return
        if cfg.data.train:
            self.add("training data", lambda: self.data_finding("training", cfg.data.train, True))
        else:
            self.findings.append(
                skip("training data", "data.inbox: files are checked as they arrive (`hangwatch submit`)")
            )
        if cfg.data.eval:
            self.add("eval data", lambda: self.data_finding("eval", cfg.data.eval, False))
        examples = self.train or self.eval
        self.add("tokenizer special tokens", lambda: text.check_special_tokens(self.tok, examples))
        self.add(
            "chat template",
            lambda: text.check_chat_template(self.tok, text.first_object(cfg.data.train or cfg.data.eval)),
        )
        self.add("decoded example", lambda: text.check_example(self.tok, examples))
        self.add("label alignment", lambda: text.check_label_alignment(examples, text.special_ids(self.tok)["eos"][1]))

    def run_model_checks(self) -> None:
        memory = next((f for f in self.findings if f.check == "memory estimate"), None)
        placement = next((f for f in self.findings if f.check == "device placement"), None)
        if (
            self.tok is None
            or (memory is not None and memory.status == FAIL)
            or (placement and placement.status == FAIL)
        ):
            why = "the memory estimate" if memory is not None and memory.status == FAIL else "the failures above"
            self.findings.append(skip("model checks", f"model not loaded because of {why}"))
            return
        loaded = self.add("model load", self.load_model, float(self.cfg.watchdog.startup_timeout_s))
        if loaded.status == FAIL:
            return
        from hangwatch.daemon.doctor import model_checks

        chunk = (self.train or self.eval)[: self.cfg.train.micro_batch_size]
        if not chunk:
            self.findings.append(skip("forward/backward", "no usable example"))
        else:
            from hangwatch.daemon.data import collate

            eos = self.bundle.tokenizer.eos_token_id
            self.add(
                "batch padding",
                lambda: model_checks.check_batch(collate(chunk, self.bundle.tokenizer.pad_token_id), chunk, eos),
                WORK_TIMEOUT_S,
            )
            self.add(
                "forward/backward",
                lambda: model_checks.check_forward_backward(self.bundle, chunk, list(self.cfg.lora.modules_to_save)),
                WORK_TIMEOUT_S,
            )
        prompts = [p if isinstance(p, str) else p.prompt for p in self.cfg.eval.prompts]
        budget = model_checks.PROBE_SECONDS * len(prompts) + WORK_TIMEOUT_S
        self.add("generate / eos", lambda: self.generate_finding(prompts), budget)

    # ---- what the checks share ---------------------------------------------------------------------

    def load_tokenizer(self) -> Finding:
        from hangwatch.daemon.data import load_tokenizer

        self.tok = load_tokenizer(self.cfg)
        kind = type(self.tok).__name__
        return ok(
            "tokenizer", f"{self.cfg.model.name_or_path or 'tiny'} ({kind}, the tokenizer the worker's ids come from)"
        )

    def data_finding(self, what: str, path: str, required: bool) -> Finding:
        from hangwatch.daemon.data import validate_file

        examples, problems = validate_file(path, self.tok, self.cfg)
        if what == "training":
            self.train, self.train_problems = examples, problems
        else:
            self.eval, self.eval_problems = examples, problems
        try:
            with open(path, "rb") as f:
                first = first_line_problem(f)
        except OSError:
            first = None  # validate_file said why, as a problem at line 0
        return text.check_data(what, path, examples, problems, required=required, first_line=first)

    def world(self) -> int:
        return self.cfg.worker.nproc_per_node if self.cfg.worker.command is None else 1

    def lr_finding(self) -> Finding:
        t = self.cfg.train
        return plan.check_lr_schedule(
            t.lr,
            t.warmup_steps,
            t.max_steps,
            pretrained=bool(self.cfg.model.name_or_path),
            effective_batch=t.micro_batch_size * t.grad_accum * self.world(),
            n_examples=len(self.train) or None,
        )

    def visible(self) -> Optional[str]:
        return self.cfg.worker.env.get("CUDA_VISIBLE_DEVICES", self.env.get("CUDA_VISIBLE_DEVICES"))

    def placement_finding(self) -> Finding:
        visible = self.visible()
        nproc = self.cfg.worker.nproc_per_node
        device = self.cfg.model.device
        seen = gpus.worker_gpus(self.env, self.cfg.worker.env, self.gpu_uuids()) if device != "cpu" else None
        if self.cfg.worker.command is None:  # the built-in worker's NCCL: the refusal validate-config and run make
            problem = gpus.placement_problem(device, nproc, seen)
            if problem is not None:
                return fail("device placement", f"{'.'.join(problem.key)}: {problem.problem}", problem.fix)
        count = seen.visible if seen is not None else plan.visible_count(visible)
        if not self.cheap:
            import torch

            torch_count = torch.cuda.device_count()
            count = torch_count if count is None else min(count, torch_count)
        return plan.check_placement(device, nproc, count, visible)

    def disk_finding(self) -> Finding:
        root = Path(self.cfg.checkpoint.dir) if self.cfg.checkpoint.dir else Path(self.cfg.run_dir) / "checkpoints"
        where = plan.existing_dir(root)
        free = shutil.disk_usage(where).free
        size, basis = plan.newest_checkpoint_bytes(root), "measured on the newest checkpoint"
        if size is None and self.counts is not None:
            size, basis = (
                self.counts.n_trainable * 12 + (64 << 10),
                "estimated: 4 bytes per trainable parameter + AdamW's 8",
            )
        return plan.check_disk(self.cfg.checkpoint.keep_last, size, free, str(where), basis=basis)

    def py_spy_finding(self) -> Finding:
        w = self.cfg.watchdog
        exe = plan.find_py_spy(w.py_spy_path)
        probe = None
        if not self.cheap and w.py_spy and exe is not None:
            probe = plan.probe_py_spy(exe, min(w.py_spy_timeout_s, 20))
        return plan.check_py_spy(w.py_spy, exe, plan.ptrace_scope(), plan.has_cap_sys_ptrace(), probe)

    def memory_finding(self) -> Finding:
        import torch

        from hangwatch.daemon.doctor import memory_estimate

        cfg = self.cfg
        cuda = cfg.model.device == "cuda" or (cfg.model.device == "auto" and torch.cuda.is_available())
        if cuda and not torch.cuda.is_available():
            return skip("memory estimate", "no CUDA device (see device placement)")
        bf16_ok = cuda and torch.cuda.is_bf16_supported()
        self.counts = counts = memory_estimate.meta_counts(cfg)
        four_bit = bool(getattr(cfg.model, "load_in_4bit", False))
        ckpt = bool(getattr(cfg.model, "gradient_checkpointing", False))
        wbytes = memory_estimate.weight_bytes_per_param(cfg.model.dtype, four_bit, cuda, bf16_ok)
        abytes = 2 if cuda and bf16_ok and cfg.model.dtype != "float32" else 4
        parts = memory_estimate.estimate(
            counts,
            micro_batch=cfg.train.micro_batch_size,
            max_length=cfg.data.max_length,
            weight_bytes=wbytes,
            act_bytes=abytes,
            gradient_checkpointing=ckpt,
            cuda=cuda,
        )
        available, where = memory_estimate.available_memory(cuda)
        dtype_text = (
            f"base weights {'4-bit' if four_bit else {2.0: 'bfloat16', 4.0: 'float32'}.get(wbytes, wbytes)}, "
            f"compute {'bfloat16' if abytes == 2 else 'float32'}, trainable float32"
            f"{', gradient checkpointing' if ckpt else ''}"
        )
        shape_text = (
            f"{counts.total:,} parameters ({counts.n_trainable:,} trainable), {counts.layers} layers × hidden "
            f"{counts.hidden}, micro_batch_size {cfg.train.micro_batch_size} × max_length {cfg.data.max_length}"
        )
        return memory_estimate.check_memory(parts, available, where, dtype_text=dtype_text, shape_text=shape_text)

    def load_model(self) -> Finding:
        from hangwatch.daemon.model import load_model
        from hangwatch.daemon.standby_worker import prepare_torch

        t0 = time.monotonic()
        prepare_torch(self.cfg)  # as the worker does before it builds its model (threads, determinism)
        self.bundle = load_model(self.cfg)
        params = list(self.bundle.model.parameters())
        size = sum(p.numel() * p.element_size() for p in params)
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
        return ok(
            "model load",
            f"load_model in {time.monotonic() - t0:.1f}s on {self.bundle.device}: "
            f"{size / (1 << 20):.1f} MiB of parameters ({', '.join(dtypes)})",
        )

    def generate_finding(self, prompts: list[str]) -> Finding:
        from hangwatch.daemon.doctor import model_checks

        cfg = self.cfg
        if not prompts:
            return skip("generate / eos", "no eval.prompts")
        if not cfg.eval.every_steps:
            return skip("generate / eos", "eval.every_steps is 0: the run never generates")
        n = min(cfg.eval.max_new_tokens, model_checks.PROBE_TOKENS)
        probes = [model_checks.probe_generate(self.bundle, p, cfg.eval, n, model_checks.PROBE_SECONDS) for p in prompts]
        budgets = cfg.watchdog.phase_budgets_s
        tok = self.bundle.tokenizer
        return model_checks.check_generate(
            probes,
            eos=tok.eos_token_id,
            eos_text=str(tok.eos_token),
            max_new_tokens=cfg.eval.max_new_tokens,
            do_sample=cfg.eval.do_sample,
            budget_s=budgets.get("generate", cfg.watchdog.default_phase_budget_s),
        )
