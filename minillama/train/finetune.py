r"""LoRA or full fine-tuning of a real checkpoint with the hand-written backward pass, on plain
text, prompt/completion pairs or chat conversations: the examples, their masks and the run
(:class:`Finetuner`). The ``finetune`` and ``merge`` commands are :mod:`minillama.cli.finetune`.

Data (``--data``, ``--val-data``):

* a ``.jsonl`` file, one record per line: ``{"messages": [{"role", "content"}, ...]}`` rendered
  with the model's chat template, the loss on the tokens of every assistant turn (its end-of-turn
  token included) and nowhere else; ``{"prompt", "completion"}`` with the loss on the completion
  and its EOS; or ``{"text"}`` with the loss everywhere;
* any other file: plain text, cut into windows of ``--context`` + 1 tokens.

Chat masks are built from characters, not from token prefixes: for assistant message i the
trained span runs from the end of the conversation rendered up to message i with the generation
prompt (the assistant header) to the end of the conversation rendered through message i, cut just
after its last end-of-turn token; a token is trained when it starts inside a span (token
character offsets of the whole rendered conversation). A template that does not render a shorter
conversation as a prefix of a longer one falls back to finding the message's content.

Records that are not JSON, have no assistant turn or do not fit the context are reported with
their line number (``--skip-bad`` skips them). Examples are padded to the longest of their batch
(padding targets are ignored; causal attention never lets a real token see the padding after it).
With ``--pack`` each of the B rows of a micro-batch holds as many whole examples (in the sampler's
order) as fit in ``--context`` tokens: a token attends only within its own example
(block-diagonal causal mask) and RoPE positions restart at every example, so a packed example
computes exactly what it computes alone (:mod:`minillama.model.packing`).

Each step: A = ``--grad-accum`` micro-batches, g = mean of their gradients
(:class:`minillama.train.step.DataParallelStep`, as pretraining), global-norm clipping, AdamW on
the trainable parameters only (the adapters, or everything with ``--full``), the warmup + cosine
schedule of :func:`minillama.train.optim.lr_at`. ``OUT/ckpt.safetensors`` (atomic) holds the
trainable tensors, the AdamW moments and the state (step, data position, dropout RNG, history);
``--resume`` continues bit for bit. LoRA runs also write the adapter as PEFT does
(``OUT/adapter_config.json`` + ``OUT/adapter_model.safetensors``); ``--full`` runs write a
minillama checkpoint that ``generate -c OUT`` loads.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from minillama.core.errors import MinillamaError
from minillama.io.chat_template import encode_rendered, render_chat
from minillama.io.checkpoint import atomic_write, read_safetensors, save_checkpoint
from minillama.io.load import load_params
from minillama.io.peft import save_peft
from minillama.model.lora import LoRA, LoRAConfig, parse_targets
from minillama.model.packing import draw_packed, pack_batch
from minillama.model.transformer import Transformer
from minillama.train.distributed import SingleProcess
from minillama.train.memplan import settle
from minillama.train.optim import AdamW, clip_grad_norm, lr_at
from minillama.train.step import DataParallelStep
from minillama.train.trainer import _progress

CKPT_NAME = "ckpt.safetensors"
FORMAT = "minillama-finetune"


# ---------------------------------------------------------------------------------------------
# examples: token ids and the mask of trained targets
# ---------------------------------------------------------------------------------------------
@dataclass
class Example:
    """One training sequence: ids (n,) and ``train`` (n,) bools, True where token i is a target
    (predicted from the tokens before it)."""

    ids: np.ndarray
    train: np.ndarray


class BadRecord(MinillamaError):
    pass


def token_offsets(tok, text: str) -> tuple[list[int], list[int]]:
    """(ids, start character of each token) of ``text`` tokenized with no BOS: the `tokenizers`
    offsets when the tokenizer runs through it, else the per-token bytes, checked to spell the
    text."""
    inner = getattr(tok, "_tok", None)
    if inner is not None and hasattr(inner, "encode"):
        enc = inner.encode(text, add_special_tokens=False)
        if hasattr(enc, "offsets"):
            return list(enc.ids), [int(s) for s, _ in enc.offsets]
    ids = encode_rendered(tok, text)  # nothing added: the template wrote BOS where wanted
    if not hasattr(tok, "decode_bytes"):
        raise MinillamaError("chat data needs a tokenizer that reports token offsets")
    spell = getattr(tok, "token_bytes", None) or (lambda i: tok.decode_bytes([i]))
    starts = align(text.encode("utf-8"), [spell(i) for i in ids])
    char_at = np.cumsum([0] + [len(c.encode("utf-8")) for c in text])  # byte offset of char i
    return ids, [int(np.searchsorted(char_at, s, side="right") - 1) for s in starts]


def align(raw: bytes, pieces: list[bytes]) -> list[int]:
    """The byte offset in ``raw`` where each token's piece starts. A piece may carry a leading
    space the text lacks (SentencePiece's prefix space); anything else that does not spell
    ``raw`` in order is an error."""
    starts, at = [], 0
    for p in pieces:
        starts.append(at)
        if raw.startswith(p, at):
            at += len(p)
        elif p.startswith(b" ") and raw.startswith(p[1:], at):
            at += len(p) - 1
        else:
            raise MinillamaError("cannot align the chat template's text with its tokens (the "
                                 "tokenizer does not spell the text back byte for byte)")
    if at != len(raw):
        raise MinillamaError("cannot align the chat template's text with its tokens (the "
                             "tokens spell a shorter text)")
    return starts


def render(tok, messages, add_generation_prompt: bool) -> str:
    """The conversation through the model's chat template
    (:func:`minillama.io.chat_template.render_chat`)."""
    return render_chat(tok, messages, add_generation_prompt)


def _stop_strings(tok) -> list[str]:
    inner = getattr(tok, "_tok", None)
    ids = {i for i in [getattr(tok, "eos_id", None), *getattr(tok, "stop_ids", ())]
           if i is not None}
    out = []
    for i in ids:
        spell = getattr(tok, "token_bytes", None) or (lambda j: tok.decode_bytes([j]))
        s = inner.id_to_token(i) if inner is not None else spell(i).decode("utf-8", "replace")
        if s:
            out.append(s)
    return out


def assistant_spans(tok, messages) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of every assistant turn."""
    full = render(tok, messages, False)
    stops = _stop_strings(tok)
    spans, prev = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(tok, messages[:i], True) if i else ""
        upto = render(tok, messages[:i + 1], False)
        if full.startswith(upto) and upto.startswith(head) and len(head) >= prev:
            start, end = len(head), len(upto)
        else:  # the template does not render prefixes as prefixes: find the content
            start = full.find(m["content"], prev)
            if start < 0:
                raise BadRecord(f"message {i}: the chat template does not render the "
                                f"assistant's content verbatim")
            end = start + len(m["content"])
            after = [end + len(s) for s in stops if full.startswith(s, end)]
            end = max(after, default=end)
        cut = [start + k + len(s) for s in stops
               if (k := full[start:end].rfind(s)) >= 0]
        end = max(cut, default=end)  # the last end-of-turn token closes the span
        spans.append((start, end))
        prev = end
    return full, spans


def chat_example(tok, messages) -> Example:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise BadRecord("'messages' must be a non-empty list of {\"role\", \"content\"} strings")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant turn")
    text, spans = assistant_spans(tok, messages)
    ids, starts = token_offsets(tok, text)
    train = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        train |= (np.asarray(starts) >= s) & (np.asarray(starts) < e)
    train[0] = False
    if not train.any():
        raise BadRecord("the assistant turns hold no tokens")
    return Example(np.asarray(ids, dtype=np.int64), train)


def prompt_example(tok, prompt: str, completion: str) -> Example:
    p = tok.encode(prompt, bos=True)
    c = tok.encode(completion, eos=True)
    if not c:
        raise BadRecord("empty completion")
    train = np.r_[np.zeros(len(p), dtype=bool), np.ones(len(c), dtype=bool)]
    train[0] = False
    return Example(np.asarray(p + c, dtype=np.int64), train)


def load_examples(path, tok, context: int, skip_bad: bool = False,
                  warn=None) -> list[Example]:
    """The examples of a data file (see the module docstring). Each holds at most context + 1
    tokens; longer plain text is cut into windows."""
    path = Path(path)
    if not path.is_file():
        raise MinillamaError(f"data file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MinillamaError(f"{path} is not UTF-8 text (byte {e.start})") from None
    if path.suffix.lower() not in (".jsonl", ".json"):
        ids = np.asarray(tok.encode(text, bos=True), dtype=np.int64)
        if len(ids) < 2:
            raise MinillamaError(f"{path} holds fewer than 2 tokens")
        out = []
        for s in range(0, len(ids) - 1, context):
            w = ids[s:s + context + 1]
            if len(w) >= 2:
                tr = np.ones(len(w), dtype=bool)
                tr[0] = False
                out.append(Example(w, tr))
        return out
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            ex = _record(json.loads(line), tok)
            if len(ex.ids) > context + 1:
                raise BadRecord(f"{len(ex.ids)} tokens do not fit the context of {context} + 1")
        except (ValueError, RecursionError, MinillamaError) as e:
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            if isinstance(e, (ValueError, RecursionError)) and not isinstance(e, MinillamaError):
                msg = f"not JSON ({msg})"
            if not skip_bad:
                raise MinillamaError(f"{path}:{n}: {msg} (--skip-bad skips such records)") \
                    from None
            if warn is not None:
                warn(f"skipped {path}:{n}: {msg}")
            continue
        out.append(ex)
    if not out:
        raise MinillamaError(f"{path} holds no usable record")
    return out


def _record(rec, tok) -> Example:
    if not isinstance(rec, dict):
        raise BadRecord("a record must be a JSON object")
    if "messages" in rec:
        return chat_example(tok, rec["messages"])
    if "prompt" in rec or "completion" in rec:
        p, c = rec.get("prompt"), rec.get("completion")
        if not isinstance(p, str) or not isinstance(c, str):
            raise BadRecord("'prompt' and 'completion' must both be strings")
        return prompt_example(tok, p, c)
    if isinstance(rec.get("text"), str):
        ids = np.asarray(tok.encode(rec["text"], bos=True), dtype=np.int64)
        tr = np.ones(len(ids), dtype=bool)
        tr[0] = False
        return Example(ids, tr)
    raise BadRecord("a record needs 'messages', 'prompt'/'completion' or 'text'")


def pad_batch(examples: list[Example], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, targets), both (B, T) with T = the longest example minus one: tokens x = ids[:-1],
    targets y = ids[1:] where trained, -1 (ignored) elsewhere and in the padding."""
    T = max(len(e.ids) for e in examples) - 1
    x = np.full((len(examples), T), pad_id, dtype=np.int64)
    y = np.full((len(examples), T), -1, dtype=np.int64)
    for i, e in enumerate(examples):
        n = len(e.ids) - 1
        x[i, :n] = e.ids[:-1]
        y[i, :n] = np.where(e.train[1:], e.ids[1:], -1)
    return x, y


class Sampler:
    """Batches of B examples, each epoch a fresh permutation of ``seed`` and the epoch number;
    the state (epoch, position) is two integers."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._perm = (None, None)

    def _order(self):
        if self._perm[0] != self.epoch:
            self._perm = (self.epoch,
                          np.random.default_rng([self.seed, self.epoch]).permutation(self.n))
        return self._perm[1]

    def peek(self) -> int:
        """The index :meth:`next` returns next (nothing is drawn)."""
        return int(self._order()[self.pos])

    def next(self, B: int) -> list[int]:
        out = []
        while len(out) < B:
            take = self._order()[self.pos:self.pos + B - len(out)]
            out += take.tolist()
            self.pos += len(take)
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state(self) -> list[int]:
        return [self.epoch, self.pos]


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
#: settings saved with the run (``--resume`` takes them from the checkpoint)
SETTINGS = ("checkpoint", "data", "val_data", "val_fraction", "full", "lora_rank", "lora_alpha",
            "lora_targets", "lora_dropout", "rslora", "steps", "batch_size", "grad_accum",
            "context", "lr", "min_lr", "warmup", "weight_decay", "grad_clip", "eval_interval",
            "seed", "backend", "skip_bad", "pack", "recompute")


class Finetuner:
    """The base model, its adapters (or every weight with ``full``), the data and the optimizer."""

    def __init__(self, s: dict[str, Any], out, progress: bool = True, say=print):
        self.s, self.out, self.progress, self.say = s, Path(out), progress, say
        fmt, cfg, params, tok = load_params(s["checkpoint"])
        if tok is None:
            raise MinillamaError(f"{s['checkpoint']} has no tokenizer; fine-tuning needs the "
                                 f"model's own")
        self.tok, self.cfg = tok, cfg
        context = s["context"] or min(cfg.max_seq_len, 512)
        if context > cfg.max_seq_len:
            raise MinillamaError(f"--context {context} exceeds the model's context of "
                                 f"{cfg.max_seq_len}")
        s["context"] = context
        self.model = Transformer(cfg, params, backend=s["backend"], dtype=np.float32)
        self.model.recompute = bool(s.get("recompute"))
        self.lora = None
        if not s["full"]:
            lc = LoRAConfig(rank=s["lora_rank"], alpha=s["lora_alpha"],
                            targets=parse_targets(s["lora_targets"]),
                            dropout=s["lora_dropout"], rslora=s["rslora"])
            self.lora = LoRA(self.model, lc, seed=s["seed"]).attach(self.model)
            self.trainable = self.lora.params
        else:
            self.trainable = self.model.params
        self.opt = AdamW(self.trainable, lr=s["lr"], betas=(0.9, 0.999), eps=1e-8,
                         weight_decay=s["weight_decay"], backend=self.model.backend)
        self._load_data(say)
        self.step, self.history = 0, {"train": [], "val": []}
        self.train_seconds, self.tokens_seen, self.example_tokens = 0.0, 0, 0
        self._step_tokens = 0  # positions (padding included) drawn in the step under way
        self.grad_step = DataParallelStep(self.model, None, SingleProcess(), s["batch_size"],
                                          s["grad_accum"], draw=self._draw,
                                          params=self.trainable, skip_untrained=True)

    def _load_data(self, say) -> None:
        s = self.s

        def warn(m):
            return say(f"minillama: warning: {m}")

        ex = load_examples(s["data"], self.tok, s["context"], s["skip_bad"], warn)
        if s["val_data"]:
            val = load_examples(s["val_data"], self.tok, s["context"], s["skip_bad"], warn)
        else:
            k = int(math.ceil(len(ex) * s["val_fraction"])) if len(ex) > 1 else 0
            order = np.random.default_rng([s["seed"], 2]).permutation(len(ex))
            val = [ex[i] for i in order[len(ex) - k:]] if k else []
            ex = [ex[i] for i in order[:len(ex) - k]]
        self.train_ex, self.val_ex = ex, val
        self.sampler = Sampler(len(ex), s["seed"])
        self.pad_id = int(getattr(self.tok, "eos_id", None) or 0)

    # --- steps -------------------------------------------------------------------------------
    def _draw(self):
        """One micro-batch for :attr:`grad_step`: (tokens, targets, forward keywords), counting
        its positions and example tokens."""
        x, y, seg, real = next_batch(self)
        self._step_tokens += x.size
        self.example_tokens += real
        return x, y, ({} if seg is None else {"segments": seg})

    def train_step(self) -> tuple[float, float]:
        """One optimizer step: the mean loss and gradient of ``--grad-accum`` micro-batches
        (:class:`~minillama.train.step.DataParallelStep`, one process), clipping, AdamW; returns
        (loss, lr)."""
        s = self.s
        lr = lr_at(self.step, s["lr"], s["warmup"], s["steps"], s["min_lr"])
        self._step_tokens = 0
        loss, grads = self.grad_step.mean_loss_and_grads()
        if not math.isfinite(loss):
            raise MinillamaError(f"fine-tuning diverged: loss {loss} at step {self.step + 1} "
                                 f"(try a lower --lr)")
        clip_grad_norm(grads, s["grad_clip"])
        self.opt.step(grads, lr=lr)
        self.step += 1
        self.tokens_seen += self._step_tokens
        self.history["train"].append([self.step, loss])
        return loss, lr

    def evaluate(self, examples=None) -> float | None:
        """Token-weighted mean loss over the held-out examples (None without any)."""
        examples = self.val_ex if examples is None else examples
        total, count = 0.0, 0
        B = self.s["batch_size"]
        for i in range(0, len(examples), B):
            x, y = pad_batch(examples[i:i + B], self.pad_id)
            n = int((y >= 0).sum())
            if n:
                total += self.model.loss(x, y) * n
                count += n
        return total / count if count else None

    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        s = self.s
        end = s["steps"] if stop_at is None else min(stop_at, s["steps"])
        bar = _progress(total=s["steps"], initial=self.step, enabled=self.progress)
        try:
            if self.step == 0:
                v = self.evaluate()
                if v is not None:
                    self.history["val"].append([0, v])
                    bar.write(f"step 0: val loss {v:.4f}")
            while self.step < end:
                t0 = time.perf_counter()
                loss, lr = self.train_step()
                self.train_seconds += time.perf_counter() - t0
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
                if self.step % s["eval_interval"] == 0 or self.step == s["steps"]:
                    v = self.evaluate()
                    if v is not None:
                        self.history["val"].append([self.step, v])
                        bar.write(f"step {self.step}: train loss {loss:.4f}, val loss {v:.4f}")
                    self.save()
            if self.step == end and self.step % s["eval_interval"] and end != s["steps"]:
                self.save()  # --stop-at between evaluations
        finally:
            bar.close()
        val = self.history["val"]
        return {"steps": self.step, "train_loss": self.history["train"][-1][1]
                if self.history["train"] else None, "val_loss": val[-1][1] if val else None,
                "first_val_loss": val[0][1] if val else None,
                "tokens_per_second": self.tokens_seen / max(self.train_seconds, 1e-9),
                "example_tokens_per_second": self.example_tokens / max(self.train_seconds, 1e-9)}

    # --- checkpoints -------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        st = {"step": self.step, "optim_step": self.opt.t, "data": self.sampler.state(),
              "history": self.history, "settings": self.s, "tokens_seen": self.tokens_seen,
              "example_tokens": self.example_tokens, "train_seconds": self.train_seconds}
        if self.lora is not None:
            st["dropout_rng"] = self.lora.rng.bit_generator.state
        return st

    def save(self) -> Path:
        be = self.model.backend
        optim = {}
        for k in self.trainable:
            optim[f"optim.m.{k}"] = be.to_numpy(self.opt.m[k])
            optim[f"optim.v.{k}"] = be.to_numpy(self.opt.v[k])
        meta = {"finetune_state": self.state()}
        path = self.out / CKPT_NAME
        if self.lora is None:
            save_checkpoint(path, self.cfg, self.model.params, tokenizer=self.tok,
                            extra_tensors=optim, extra_metadata=meta)
            return path
        tensors = {f"lora.{k}": np.ascontiguousarray(be.to_numpy(v))
                   for k, v in self.lora.params.items()}
        tensors.update({k: np.ascontiguousarray(v) for k, v in optim.items()})
        md = {"format": FORMAT, "finetune_state": json.dumps(meta["finetune_state"])}
        atomic_write(path, lambda t: save_file(tensors, t, metadata=md), "checkpoint")
        save_peft(self.lora, self.out, base_model=str(self.s["checkpoint"]))
        return path

    def resume(self) -> None:
        path = self.out / CKPT_NAME
        tensors, raw = read_safetensors(path)
        st = json.loads(raw["finetune_state"])
        be = self.model.backend
        src = ({k[len("lora."):]: v for k, v in tensors.items() if k.startswith("lora.")}
               if self.lora is not None else
               {k: v for k, v in tensors.items() if not k.startswith("optim.")})
        for k in self.trainable:
            if k not in src or tuple(src[k].shape) != tuple(self.trainable[k].shape):
                raise MinillamaError(f"--resume: {path} does not hold {k} for this run")
            self.trainable[k][...] = be.asarray(src[k], dtype=self.model.dtype)
        self.opt.load_state_dict({
            "step": st["optim_step"],
            "m": {k[8:]: v for k, v in tensors.items() if k.startswith("optim.m.")},
            "v": {k[8:]: v for k, v in tensors.items() if k.startswith("optim.v.")}})
        self.step = int(st["step"])
        self.sampler.epoch, self.sampler.pos = (int(v) for v in st["data"])
        self.history = st["history"]
        self.tokens_seen = int(st.get("tokens_seen", 0))
        self.example_tokens = int(st.get("example_tokens", 0))
        self.train_seconds = float(st.get("train_seconds", 0.0))
        if self.lora is not None and "dropout_rng" in st:
            self.lora.rng.bit_generator.state = st["dropout_rng"]


def batch_length(ft: Finetuner) -> int:
    """T of the longest micro-batch the run ``ft`` makes: ``--context`` with ``--pack`` (rows
    are filled up to it), else the longest example less one (a padded batch is as long as its
    longest example's x = ids[:-1]; held-out examples included, evaluation pads the same way)."""
    if ft.s.get("pack"):
        return ft.s["context"]
    return max(len(e.ids) for e in ft.train_ex + ft.val_ex) - 1


def settle_memory(ft: Finetuner, max_memory: int | None, say) -> None:
    """Print the run's memory plan and hold it to ``max_memory``
    (:func:`~minillama.train.memplan.settle`): a refusal is a :class:`MinillamaError`; recompute
    turned on to fit is set on the model and in the saved settings."""
    s = ft.s
    p = settle(ft.model, ft.trainable, s["batch_size"], batch_length(ft), s["grad_accum"],
               bool(s.get("recompute")), max_memory, say, _shorter(ft))
    if p.recompute and not s.get("recompute"):
        s["recompute"] = ft.model.recompute = True


def _shorter(ft: Finetuner):
    """What a shorter ``--context`` t costs the data of ``ft`` (for
    :func:`~minillama.train.memplan.settle`): nothing for plain text (cut into shorter windows);
    records longer than t are errors, so ``--skip-bad`` and how many it drops (None: all)."""
    if Path(ft.s["data"]).suffix.lower() not in (".jsonl", ".json"):
        return None
    lengths = [len(e.ids) - 1 for e in ft.train_ex + ft.val_ex]

    def shorter(t: int):
        n = sum(k > t for k in lengths)
        if n == len(lengths):
            return None
        return (" --skip-bad", f"drops {n} of {len(lengths)} examples") if n else ("", "")

    return shorter


def next_batch(ft: Finetuner):
    """One micro-batch of the run ``ft``: (tokens, targets, segments, example tokens), segments
    None unless ``--pack``; the last the number of positions that are not padding."""
    s = ft.s
    if s.get("pack"):
        rows = draw_packed(ft.train_ex, ft.sampler, s["batch_size"], s["context"])
        real = sum(len(e.ids) - 1 for row in rows for e in row)
        return (*pack_batch(rows, ft.pad_id), real)
    ex = [ft.train_ex[i] for i in ft.sampler.next(s["batch_size"])]
    return (*pad_batch(ex, ft.pad_id), None, sum(len(e.ids) - 1 for e in ex))


def saved_settings(out) -> dict[str, Any]:
    """The settings of the run in ``out`` (for ``--resume``)."""
    path = Path(out) / CKPT_NAME
    if not path.is_file():
        raise MinillamaError(f"--resume: no checkpoint at {path}")
    _, raw = read_safetensors(path)
    try:
        return dict(json.loads(raw["finetune_state"])["settings"])
    except (KeyError, ValueError, TypeError):
        raise MinillamaError(f"--resume: {path} is not a fine-tuning checkpoint") from None
